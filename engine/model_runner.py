"""ModelRunner: owns the model and the paged KV cache; turns a scheduled batch into step tensors and logits."""
from __future__ import annotations

import functools
import logging
import os
import time

import torch
from torch import nn

from kvgate.engine.config import EngineConfig
from kvgate.engine.cuda_graph import DecodeGraphs
from kvgate.engine.forward_context import forward_context
from kvgate.engine.models.layers import use_fused_ops
from kvgate.engine.models.loader import get_model
from kvgate.engine.sequence import Sequence
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
        if can_pack(self.device, config.dtype):  # CPU: oneDNN pre-packed matmuls
            if self.model.lm_head is None and not self.model.pooling:
                self.model.lm_head = nn.Linear(mc.hidden_size, mc.vocab_size, bias=False)
                self.model.lm_head.weight = self.model.embed_tokens.weight
            pack_linears(self.model)
        self.num_blocks = self._num_blocks()
        shape = (mc.num_hidden_layers, 2, self.num_blocks, self.block_size, mc.num_key_value_heads, mc.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=config.kv_cache_dtype, device=self.device)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.attn.k_cache = self.kv_cache[i, 0]
            layer.self_attn.attn.v_cache = self.kv_cache[i, 1]
        # The fused RMSNorm / rotary / SiLU-and-mul kernels (kernels/triton_fused.py), KVGATE_FUSED_OPS:
        # "eager" (default): in eager steps (prompts, mixed steps), where they halve the GPU time of a 6,400-token
        # step; the decode graphs are captured with the torch ops (with the fused ops in the graphs too, "all",
        # the throughput benchmark ran slower: benchmarks/RESULTS.md). "none": never.
        fused = os.environ.get("KVGATE_FUSED_OPS", "eager")
        if fused not in ("eager", "all", "none"):
            raise ValueError(f"KVGATE_FUSED_OPS must be eager, all or none, got {fused!r}")
        triton_gpu = self.device.type == "cuda" and config.attention_backend == "triton"
        if triton_gpu and fused == "all":
            use_fused_ops(self.model)
        self.graphs: DecodeGraphs | None = None
        if triton_gpu and not config.args.enforce_eager and config.runner == "generate":  # pooling: prefill only
            from kvgate.kernels.triton_decode import graph_partition_size

            self.graphs = DecodeGraphs(
                self.model, self.attention_fn, config.max_num_seqs, config.max_model_len, self.block_size,
                mc.hidden_size, config.dtype, self.device,
                functools.partial(graph_partition_size, num_kv_heads=mc.num_key_value_heads,
                                  max_model_len=config.max_model_len, device=self.device))
            self.graphs.capture()
        if triton_gpu and fused == "eager":
            use_fused_ops(self.model)  # after the capture: the graphs keep the torch ops
        if self.device.type == "cuda":
            self.warm_up()

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
                self.model.compute_logits(self.model(ids, ids))
        torch.cuda.synchronize()
        logger.info("warmed up eager steps in %.1fs", time.perf_counter() - t0)

    @property
    def block_bytes(self) -> int:
        mc = self.config.model_config
        elem = torch.empty(0, dtype=self.config.kv_cache_dtype).element_size()
        return 2 * mc.num_hidden_layers * self.block_size * mc.num_key_value_heads * mc.head_dim * elem

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
        dummy = torch.zeros((1, self.block_size, self.config.model_config.num_key_value_heads,
                             self.config.model_config.head_dim), dtype=self.config.kv_cache_dtype, device=self.device)
        for layer in self.model.layers:
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
            hidden = self.model(ids, torch.zeros_like(ids))
            self.model.compute_logits(hidden[: self.config.max_num_seqs])
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        others = (total - free) - torch.cuda.memory_reserved()  # other processes, CUDA context
        peak = torch.cuda.max_memory_allocated()
        budget = int(total * self.config.args.gpu_memory_utilization) - peak - others - (256 << 20)
        torch.cuda.empty_cache()
        logger.info("KV cache budget %.2f GiB (peak step %.2f GiB)", budget / 2**30, peak / 2**30)
        return budget

    def prepare(self, scheduled: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata,
                                                                        list[int]]:
        """Flat step tensors for (seq, new tokens) pairs, decodes first; also the rows whose logits are needed."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts, seq_lens, logits_rows = [0], [], []
        num_decodes = 0
        for seq, n in scheduled:
            c = seq.num_computed_tokens
            if n == 1 and len(seq) - c == 1:
                num_decodes += 1
            input_ids.extend(seq.token_ids[c:c + n])
            positions.extend(range(c, c + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(c, c + n))
            starts.append(starts[-1] + n)
            seq_lens.append(c + n)
            if c + n == len(seq):
                logits_rows.append(starts[-1] - 1)
        max_blocks = max(len(s.block_table) for s, _ in scheduled)
        tables = [s.block_table + [0] * (max_blocks - len(s.block_table)) for s, _ in scheduled]
        dev = self.device

        def t(x: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(x, dtype=dtype, pin_memory=dev.type == "cuda").to(dev, non_blocking=True)

        md = AttentionMetadata(
            slot_mapping=t(slots, torch.long), query_start_loc=t(starts, torch.int32),
            seq_lens=t(seq_lens, torch.int32), block_tables=t(tables, torch.int32), num_decodes=num_decodes,
            max_query_len=max(n for _, n in scheduled), max_seq_len=max(seq_lens), block_size=bs,
            query_start_loc_cpu=starts, seq_lens_cpu=seq_lens)
        return t(input_ids, torch.long), t(positions, torch.long), md, logits_rows

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Sequence, int]]) -> torch.Tensor:
        """Run one step; returns float32 logits for every sequence whose tokens are now all computed."""
        hidden, rows = self._forward(scheduled)
        if not rows:
            return hidden.new_empty((0, self.config.model_config.vocab_size), dtype=torch.float32)
        if len(rows) < hidden.shape[0]:
            hidden = hidden[torch.tensor(rows, device=self.device)]
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def execute_hidden(self, scheduled: list[tuple[Sequence, int]]) -> torch.Tensor:
        """Run one step of the pooling runner; returns the final (normed) hidden states of every scheduled token,
        [num_tokens, hidden_size] in the model's dtype, flat in the scheduled order (each sequence's new tokens
        one after another)."""
        return self._forward(scheduled)[0]

    def _forward(self, scheduled: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, list[int]]:
        """The model over one step: (hidden states of every scheduled token, the rows whose logits are needed)."""
        input_ids, positions, md, rows = self.prepare(scheduled)
        if self.graphs is not None and md.num_decodes == md.num_seqs and self.graphs.can_run(md.num_seqs):
            return self.graphs.run(input_ids, positions, md.slot_mapping, md.seq_lens, md.block_tables), rows
        with forward_context(md, self.attention_fn):
            return self.model(input_ids, positions), rows
