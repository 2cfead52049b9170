"""ModelRunner: owns the model and the paged KV cache; turns a scheduled batch into step tensors and logits."""
from __future__ import annotations

import functools
import logging
import os
import time

import numpy as np
import torch
from torch import nn

from kvgate.engine.config import EngineConfig
from kvgate.engine.cuda_graph import StepGraphs
from kvgate.engine.distributed.parallel_state import get_pp_group, get_tp_group, get_world_group
from kvgate.engine.forward_context import forward_context
from kvgate.engine.kv_offload import OffloadStore
from kvgate.engine.kv_offload.disk import rank_directory
from kvgate.engine.models.layers import use_fused_ops
from kvgate.engine.models.loader import get_model
from kvgate.engine.models.parallel import local_units
from kvgate.engine.step_input import RunnerState, StepInput
from kvgate.kernels.cpu_linear import can_pack, pack_linears
from kvgate.kernels.metadata import AttentionMetadata
from kvgate.kernels.registry import get_attention_backend

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 1 << 30


def tune_cpu_allocator() -> None:
    """Keep freed activation buffers in the heap instead of returning them to the OS: otherwise every large
    step tensor is a fresh mmap whose page faults cost more than the math (prefill ran 1.7x slower)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    libc.mallopt(m_mmap_threshold, 32 << 20)  # the largest value glibc accepts
    libc.mallopt(m_trim_threshold, 1 << 30)
    libc.mallopt(m_top_pad, 64 << 20)


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.device
        self.block_size = config.args.block_size
        mc = config.model_config
        torch.manual_seed(config.args.seed)
        self.attention_fn = get_attention_backend(config.attention_backend)
        self.model = get_model(mc, config.model_path, config.load_format, config.dtype, self.device, config.args.seed,
                               pooling=config.runner == "pooling")
        if self.device.type == "cpu" and os.environ.get("KVGATE_TUNE_MALLOC", "1") == "1":
            tune_cpu_allocator()
        tp, self.pp = get_tp_group(), get_pp_group()
        self.num_kv_heads = local_units(mc.num_key_value_heads, tp)[1]  # this rank's (tensor parallelism)
        self.num_layers = len(self.model.layer_range)  # this stage's (pipeline parallelism)
        if can_pack(self.device, config.dtype) and tp.world_size == 1:  # CPU: oneDNN pre-packed matmuls
            if not self.model.pooling and self.pp.is_last:  # the LM head (or the tied embedding) as a linear to pack
                head = self.model.lm_head if self.model.lm_head is not None else self.model.embed_tokens
                self.model.lm_head = nn.Linear(mc.hidden_size, mc.vocab_size, bias=False)
                self.model.lm_head.weight = head.weight
            pack_linears(self.model)
        self.state = RunnerState(rows=config.max_num_seqs)  # the sequences it runs, as the step messages told it
        # every rank sizes its own cache; all use the smallest number of blocks (the scheduler's is shared)
        self.num_blocks = get_world_group().min_over_ranks(self._num_blocks())
        shape = (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, mc.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=config.kv_cache_dtype, device=self.device)
        for i, layer in enumerate(self.model.local_layers):
            layer.self_attn.attn.k_cache = self.kv_cache[i, 0]
            layer.self_attn.attn.v_cache = self.kv_cache[i, 1]
        self.on_disk: list[bytes] = []  # the disk tier's blocks found at start (every rank has their files)
        self.offload = self._offload_store()
        # The fused RMSNorm / rotary / SiLU-and-mul kernels (kernels/triton_fused.py), KVGATE_FUSED_OPS: "all"
        # (default): in eager steps and inside the decode graphs, where they replace ~40 small torch kernels a layer
        # (the decode step of 193 sequences on an H200: 9.5 -> 7.0 ms of GPU time, benchmarks/RESULTS.md); "eager":
        # in eager steps only, the graphs captured with torch's ops; "none": never.
        fused = os.environ.get("KVGATE_FUSED_OPS", "all")
        if fused not in ("eager", "all", "none"):
            raise ValueError(f"KVGATE_FUSED_OPS must be all, eager or none, got {fused!r}")
        triton_gpu = self.device.type == "cuda" and config.attention_backend == "triton"
        if triton_gpu and fused == "all":
            use_fused_ops(self.model)
        self.graphs: StepGraphs | None = None
        # pooling: prefill only. Each pipeline stage captures its own layers. KVGATE_CUDAGRAPH_MODE (vLLM's
        # cudagraph_mode): "full" (vLLM's FULL): graphs for mixed steps too, decodes next to prompt chunks of up to
        # 2,048 tokens (one H100, 200 clients: 38.5k against 27.3k output tok/s with decode graphs only,
        # benchmarks/RESULTS.md); "decode" (vLLM's FULL_DECODE_ONLY): decode steps only. The default is "full" on one
        # GPU and "decode" with tensor parallelism, where mixed graphs have not run on GPUs yet (with pipeline
        # stages StepGraphs captures decode steps only)
        mode = os.environ.get("KVGATE_CUDAGRAPH_MODE", "full" if tp.world_size == 1 else "decode")
        if mode not in ("full", "decode"):
            raise ValueError(f"KVGATE_CUDAGRAPH_MODE must be full or decode, got {mode!r}")
        if triton_gpu and not config.args.enforce_eager and config.runner == "generate":
            self.graphs = self.step_graphs(mixed=mode == "full")
            self.graphs.capture()
        if triton_gpu and fused == "eager":
            use_fused_ops(self.model)  # after the capture: the graphs keep the torch ops
        if self.device.type == "cuda":
            self.warm_up()

    def step_graphs(self, mixed: bool, capture: bool = True) -> StepGraphs:
        from kvgate.kernels.triton_decode import graph_partition_size

        config = self.config
        return StepGraphs(
            self.model, self.attention_fn, config.max_num_seqs, config.max_model_len, self.block_size,
            config.model_config.hidden_size, config.dtype, self.device,
            functools.partial(graph_partition_size, num_kv_heads=self.num_kv_heads,
                              max_model_len=config.max_model_len, device=self.device),
            first_stage=self.pp.is_first, last_stage=self.pp.is_last,
            max_num_batched_tokens=config.max_num_batched_tokens if mixed else 0, capture=capture)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Run the eager step shapes that live traffic meets once (decodes with and without split-K next to prompt
        chunks, a prompt alone), so that their kernels compile now and not while the first requests wait."""
        t0 = time.perf_counter()
        long_ctx = min(4096, self.config.max_model_len - 1)
        many = max(1, min(64, self.config.max_num_seqs - 2))
        for num_decodes, decode_len, prompts in ((1, long_ctx, [20]), (many, 17, [5, 40]), (0, 0, [33])):
            q_lens = [1] * num_decodes + prompts
            seq_lens = [decode_len] * num_decodes + prompts
            starts = [0]
            for n in q_lens:
                starts.append(starts[-1] + n)
            width = -(-max(seq_lens) // self.block_size)
            dev, tokens = self.device, starts[-1]
            md = AttentionMetadata(
                slot_mapping=torch.full((tokens,), -1, dtype=torch.long, device=dev),  # nothing is stored
                query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
                block_tables=torch.zeros((len(q_lens), width), dtype=torch.int32, device=dev),
                num_decodes=num_decodes, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
                block_size=self.block_size, query_start_loc_cpu=starts, seq_lens_cpu=seq_lens)
            ids = torch.zeros(tokens, dtype=torch.long, device=dev)
            with forward_context(md, self.attention_fn):
                self._local_forward(ids, ids, logits_rows=tokens)
        torch.cuda.synchronize()
        logger.info("warmed up eager steps in %.1fs", time.perf_counter() - t0)

    @property
    def block_bytes(self) -> int:
        mc = self.config.model_config
        elem = torch.empty(0, dtype=self.config.kv_cache_dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * mc.head_dim * elem

    @property
    def block_bytes_all_ranks(self) -> int:
        """A block's bytes summed over every rank: each tensor-parallel slice of every layer."""
        mc = self.config.model_config
        elem = torch.empty(0, dtype=self.config.kv_cache_dtype).element_size()
        return (2 * mc.num_hidden_layers * self.block_size * self.num_kv_heads * mc.head_dim * elem
                * get_tp_group().world_size)

    def _offload_store(self) -> OffloadStore | None:
        """The slots of the KV offload tier on this rank (kv_offloading_size GiB over all ranks: as many slots as
        whole blocks of every rank fit; at least one, as EngineConfig checked), or None when it is off."""
        a = self.config.args
        if a.kv_offloading_size <= 0 or not a.enable_prefix_caching or self.model.pooling:
            return None
        world = get_world_group()
        disk_dir = rank_directory(self.config, world.rank) if a.kv_offloading_disk_dir else None
        store = OffloadStore(self.kv_cache, int(a.kv_offloading_size * (1 << 30)) // self.block_bytes_all_ranks,
                             disk_dir)
        if store.disk is not None:  # the blocks on disk: those every rank has its file of
            self.on_disk = store.disk.keep_common(world.all_gather_object(store.disk.scan()), world.rank)
        return store

    def _num_blocks(self) -> int:
        a = self.config.args
        if a.num_gpu_blocks_override is not None:
            return a.num_gpu_blocks_override
        if a.kv_cache_memory_bytes is not None:
            budget = a.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            budget = self._profile_gpu_budget()
        else:
            budget = CPU_DEFAULT_KV_BYTES
        num = int(budget // self.block_bytes)
        if num < 1:
            raise ValueError(f"KV cache budget of {budget} bytes holds no block of {self.block_bytes} bytes")
        return num

    @torch.inference_mode()
    def _profile_gpu_budget(self) -> int:
        """gpu_memory_utilization × total, minus what the weights, a full-size step and others already use."""
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        n = self.config.max_num_batched_tokens
        dummy = torch.zeros((1, self.block_size, self.num_kv_heads,
                             self.config.model_config.head_dim), dtype=self.config.kv_cache_dtype, device=self.device)
        for layer in self.model.local_layers:
            layer.self_attn.attn.k_cache = layer.self_attn.attn.v_cache = dummy
        seqs = min(self.config.max_num_seqs, n)
        lens = [n // seqs + (1 if i < n % seqs else 0) for i in range(seqs)]
        starts = [0]
        for length in lens:
            starts.append(starts[-1] + length)
        md = AttentionMetadata(
            slot_mapping=torch.full((n,), -1, dtype=torch.long, device=self.device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=self.device),
            block_tables=torch.zeros((seqs, 1), dtype=torch.int32, device=self.device),
            num_decodes=0, max_query_len=max(lens), max_seq_len=max(lens), block_size=self.block_size,
            query_start_loc_cpu=starts, seq_lens_cpu=lens)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        with forward_context(md, self.attention_fn):
            self._local_forward(ids, torch.zeros_like(ids), logits_rows=self.config.max_num_seqs)
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        others = (total - free) - torch.cuda.memory_reserved()  # other processes, CUDA context
        peak = torch.cuda.max_memory_allocated()
        budget = int(total * self.config.args.gpu_memory_utilization) - peak - others - (256 << 20)
        torch.cuda.empty_cache()
        logger.info("KV cache budget %.2f GiB (peak step %.2f GiB)", budget / 2**30, peak / 2**30)
        return budget

    def prepare(self, step: StepInput, sampled: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flat step tensors for the step's scheduled sequences (decodes first), gathered from their rows of the
        persistent batch (RunnerState); also the rows whose logits are needed. `sampled`: the tokens the step before
        sampled, on the device, for the step's pending tokens (async scheduling)."""
        bs, st = self.block_size, self.state
        rows = st.apply(step)
        nd, num_seqs = step.num_decodes, len(rows)
        counts = np.asarray(step.num_new_tokens, dtype=np.int64)
        computed = np.asarray(step.num_computed_tokens, dtype=np.int64)
        seq_lens = computed + counts
        starts = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(counts, out=starts[1:])
        # decodes, one token each: its last token (or 0 where it is pending: filled in on the device below)
        d_rows, d_pos = rows[:nd], computed[:nd]
        ids = [np.where(d_pos < st.num_tokens[d_rows], st.last_token[d_rows], 0)]
        positions = [d_pos]
        slots = [st.block_tables[d_rows, d_pos // bs] * bs + d_pos % bs]
        for i in range(nd, num_seqs):  # prompt chunks
            c, n, row = int(computed[i]), int(counts[i]), int(rows[i])
            tokens = st.seqs[step.seq_ids[i]].token_ids[c:c + n]
            if len(tokens) < n:  # its last token is pending: filled in on the device below
                tokens = tokens + [0] * (n - len(tokens))
            pos = np.arange(c, c + n, dtype=np.int64)
            ids.append(np.asarray(tokens, dtype=np.int64))
            positions.append(pos)
            slots.append(st.block_tables[row, pos // bs] * bs + pos % bs)
        max_blocks = max(1, int(st.num_blocks[rows].max()))
        tables = st.block_tables[rows, :max_blocks]
        ends = starts[1:] - 1
        dst = ends[step.pending_rows] if step.pending_rows else ()
        # two copies to the device (through pinned memory on CUDA: the host does not wait), each array one after the
        # other, every one starting 16-byte aligned (as Triton's kernels are specialized)
        (ids_t, positions_t, slot_mapping, dst_t, src_t) = _packed_to_device(
            (np.concatenate(ids), np.concatenate(positions), np.concatenate(slots), dst, step.pending_src),
            torch.long, self.device)
        query_start_loc, seq_lens_t, block_tables = _packed_to_device((starts, seq_lens, tables.ravel()), torch.int32,
                                                                      self.device)
        starts_cpu, lens_cpu = starts.tolist(), seq_lens.tolist()
        md = AttentionMetadata(
            slot_mapping=slot_mapping, query_start_loc=query_start_loc, seq_lens=seq_lens_t,
            block_tables=block_tables.view(num_seqs, max_blocks), num_decodes=nd,
            max_query_len=int(counts.max()), max_seq_len=max(lens_cpu), block_size=bs,
            query_start_loc_cpu=starts_cpu, seq_lens_cpu=lens_cpu)
        if step.pending_rows:
            ids_t[dst_t] = sampled[src_t]  # type: ignore[index]
        return ids_t, positions_t, md, ends[np.asarray(step.samples, dtype=bool)].tolist()

    def _local_forward(self, ids: torch.Tensor, positions: torch.Tensor, logits_rows: int) -> None:
        """This stage's part of a step with made-up inputs (warm-up, memory profile): nothing is sent."""
        mc = self.config.model_config
        intermediate = None
        if not self.pp.is_first:
            x = torch.zeros((ids.shape[0], mc.hidden_size), dtype=self.config.dtype, device=self.device)
            intermediate = (x, x.clone())
        out = self.model(ids, positions, intermediate)
        if self.pp.is_last and not self.model.pooling:
            self.model.compute_logits(out[:logits_rows])

    def execute(self, step: StepInput) -> torch.Tensor | None:
        """Run one step; returns float32 logits for every sequence whose tokens are now all computed, on global
        rank 0; None on the other ranks."""
        return self.finish(self.start(step))

    @torch.inference_mode()
    def start(self, step: StepInput, sampled: torch.Tensor | None = None) -> tuple[torch.Tensor | None, int]:
        """This rank's part of a step: (its logits where it has them, the number of logits rows). With pipeline
        stages rank 0 only runs the first stage here and takes the logits later (finish), so that it can start the
        next batch while the other stages work on this one; the last stage sends them without waiting."""
        hidden, rows = self._forward(step, sampled)
        logits = None
        if hidden is not None:  # the last stage
            if not rows:
                logits = hidden.new_empty((0, self.config.model_config.vocab_size), dtype=torch.float32)
            else:
                if len(rows) < hidden.shape[0]:
                    hidden = hidden[torch.tensor(rows, device=self.device)]
                logits = self.model.compute_logits(hidden)
            if self.pp.world_size > 1 and get_world_group().rank == self._last_stage_first_rank:
                self.pp.send([logits], dst=0)
        return logits, len(rows)

    def finish(self, started: tuple[torch.Tensor | None, int]) -> torch.Tensor | None:
        """The logits of a started step on rank 0 (received from the last stage, in the order steps started)."""
        logits, n = started
        if self.pp.world_size == 1:
            return logits
        if get_world_group().rank != 0:
            return None
        shape = (n, self.config.model_config.vocab_size)
        return self.pp.recv([shape], torch.float32, self.device, src=self._last_stage_first_rank)[0]

    @torch.inference_mode()
    def execute_hidden(self, step: StepInput) -> torch.Tensor | None:
        """Run one step of the pooling runner; returns the final (normed) hidden states of every scheduled token,
        [num_tokens, hidden_size] in the model's dtype, flat in the scheduled order (each sequence's new tokens
        one after another), on global rank 0; None on the other ranks."""
        hidden, _ = self._forward(step)
        if self.pp.world_size == 1:
            return hidden
        rank = get_world_group().rank
        if rank == self._last_stage_first_rank:
            self.pp.send([hidden], dst=0)  # type: ignore[list-item]
        elif rank == 0:
            shape = (sum(step.num_new_tokens), self.config.model_config.hidden_size)
            return self.pp.recv([shape], self.config.dtype, self.device, src=self._last_stage_first_rank)[0]
        return None

    @property
    def _last_stage_first_rank(self) -> int:
        return (self.pp.world_size - 1) * get_tp_group().world_size

    def _forward(self, step: StepInput, sampled: torch.Tensor | None = None) -> tuple[torch.Tensor | None, list[int]]:
        """This stage's part of one step: (the last stage's final hidden states of every scheduled token, else None;
        the rows whose logits are needed). Other stages receive the previous stage's hidden states and send theirs
        on."""
        if step.offload_ops:  # before the forward overwrites (SAVE) or reads (LOAD) those blocks
            self.offload.apply(step.offload_ops)  # type: ignore[union-attr]
        input_ids, positions, md, rows = self.prepare(step, sampled)
        intermediate = None
        if not self.pp.is_first:
            shape = (input_ids.shape[0], self.config.model_config.hidden_size)
            intermediate = tuple(self.pp.recv([shape, shape], self.config.dtype, self.device))
        bucket = self.graphs.bucket(md, input_ids.shape[0]) if self.graphs is not None else None
        if bucket is not None:
            out, rows = self.graphs.run(bucket, input_ids, positions, md, rows, intermediate)  # type: ignore[union-attr]
            if not self.pp.is_last:  # copies: the next replay overwrites the graph's buffers while they may travel
                out = tuple(t.clone() for t in out)
        else:
            with forward_context(md, self.attention_fn):
                out = self.model(input_ids, positions, intermediate)
        if self.pp.is_last:
            return out, rows
        self.pp.send(list(out))
        return None, rows


_ALIGN = 4  # elements: 16 bytes of int32, 32 of int64


def _packed_to_device(arrays: tuple, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """The 1-D arrays (numpy or lists of ints) on the device in one copy: one after the other in one host buffer
    (pinned on CUDA, so that the host does not wait for the copy), each starting at a multiple of _ALIGN elements;
    the views holding each."""
    at, total = [], 0
    for a in arrays:
        at.append(total)
        total += -(-len(a) // _ALIGN) * _ALIGN
    host = torch.empty(max(total, 1), dtype=dtype, pin_memory=device.type == "cuda")
    flat = host.numpy()
    for a, i in zip(arrays, at):
        flat[i:i + len(a)] = a
    packed = host.to(device, non_blocking=True) if device.type == "cuda" else host
    return [packed[i:i + len(a)] for a, i in zip(arrays, at)]
