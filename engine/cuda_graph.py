"""CUDA graphs for steps: the model's forward captured once per bucket and replayed with the step's inputs copied into
static buffers.

An eager step launches ~15 kernels per layer from Python (~40 with torch's small ops); replaying a graph launches
them all at once, so the GPU no longer waits on the host. A bucket (D, T) holds D decode rows, then T rows of prompt
tokens (T = 0: a decode step). Decode steps use buckets of 1, 2, 4, 8, then every 16 up to max_num_seqs. Mixed
steps (decodes next to prompts or prompt chunks, as a server meets with every new request) use buckets of 0, 16,
32, 64, ... (powers of two below max_num_seqs) or max_num_seqs decode rows and 128, 256, ... 8192 prompt tokens (up
to max_num_batched_tokens) of at most MAX_PREFILL_SEQS sequences: a burst of new requests next to running ones, as a
server meets when many clients send at once, replays too. A step that does not fit one (a chunk of a budget above
8192 tokens: GEMM-bound, where launches matter less) runs eagerly. A step replays the smallest bucket that holds it:
its decodes in rows [0, D), its prompt tokens from row D on, the rows between them padding (slot -1: nothing
stored; a padded decode row attends to one token, a padded prompt row to nothing) whose outputs are never read.

Attention inside a graph cannot look at host values that change per step. It reads lengths from the device and
splits every decode into partitions of a size fixed per bucket (`graph_partition_size`); partitions past a
sequence's end exit at once. The prefill kernel's grid covers the bucket's T token rows and MAX_PREFILL_SEQS
sequences (a program per tile of rows, plus one spare per sequence: kernels/triton_prefill.py); absent sequences
have no tokens, and the spare programs exit at once.

A pipeline stage captures its own layers for decode steps: a stage after the first takes the previous stage's
(hidden, residual) as inputs, copied into buffers of the graph, and a stage before the last returns its
(hidden, residual); the transfers between stages stay outside the graphs. Mixed steps are captured only without
pipeline stages. Under tensor parallelism each rank captures the same buckets in the same order, the layers'
all-reduces inside the graphs.

With `capture=False` nothing is captured and a "replay" runs the same forward over the same buffers eagerly: the
padded layouts, checked on a CPU (tests/test_cuda_graph_layout.py).
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from kvgate.engine.forward_context import forward_context
from kvgate.kernels.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

MAX_PREFILL_SEQS = 64  # prompts (or chunks) of a mixed step that a graph serves
PROMPT_TOKENS = (128, 256, 512, 1024, 2048, 4096, 8192)  # the prompt-token sizes of the mixed buckets
MIXED_DECODES = (16, 32, 64, 128, 256, 512)  # and their decode sizes (besides 0 and max_num_seqs)

Bucket = tuple[int, int]  # (decode rows, prompt-token rows)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


def mixed_buckets(max_num_seqs: int, max_num_batched_tokens: int) -> list[Bucket]:
    """The (decode rows, prompt tokens) buckets of mixed steps: a step has at most max_num_batched_tokens tokens."""
    decodes = [0] + [d for d in MIXED_DECODES if d < max_num_seqs] + [max_num_seqs]
    prompts = [t for t in PROMPT_TOKENS if t <= max_num_batched_tokens] or [max_num_batched_tokens]
    return [(d, t) for d in decodes for t in prompts if d < max_num_batched_tokens]


class StepGraphs:
    def __init__(self, model: torch.nn.Module, attention_fn: Callable, max_num_seqs: int, max_model_len: int,
                 block_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 partition_size: Callable[[int], int], first_stage: bool = True, last_stage: bool = True,
                 max_num_batched_tokens: int = 0, capture: bool = True) -> None:
        """max_num_batched_tokens: 0, or mixed steps with pipeline stages: decode steps only."""
        self.model, self.attention_fn = model, attention_fn
        self.max_model_len, self.block_size = max_model_len, block_size
        self.sizes = graph_batch_sizes(max_num_seqs)  # the decode buckets' sizes
        mixed = first_stage and last_stage and max_num_batched_tokens > 0
        self.mixed = mixed_buckets(max_num_seqs, max_num_batched_tokens) if mixed else []
        self.buckets: list[Bucket] = [(b, 0) for b in self.sizes] + self.mixed
        rows = max(d + t for d, t in self.buckets)
        seqs = max(d + (MAX_PREFILL_SEQS if t else 0) for d, t in self.buckets)
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((rows,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(seqs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((seqs, max_blocks), dtype=torch.int32, device=device)
        # a mixed bucket's prompt sequences, from entry D on (a run writes them); decode steps never read it
        self.query_start_loc = torch.zeros(seqs + 1, dtype=torch.int32, device=device)
        # the previous stage's (hidden, residual) (None on the first stage); this stage's output: the final hidden
        # states on the last stage, else (hidden, residual)
        self.inputs = None if first_stage else tuple(torch.zeros((rows, hidden_size), dtype=dtype, device=device)
                                                    for _ in range(2))
        self.outputs = tuple(torch.zeros((rows, hidden_size), dtype=dtype, device=device)
                             for _ in range(1 if last_stage else 2))
        self.partition_size = partition_size
        self.capture_graphs = capture
        self.graphs: dict[Bucket, torch.cuda.CUDAGraph | None] = {}
        self.pool = None

    def metadata(self, bucket: Bucket) -> AttentionMetadata:
        d, t = bucket
        seqs = d + (MAX_PREFILL_SEQS if t else 0)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:d + t], query_start_loc=self.query_start_loc[:seqs + 1],
            seq_lens=self.seq_lens[:seqs], block_tables=self.block_tables[:seqs], num_decodes=d,
            max_query_len=t or 1, max_seq_len=self.max_model_len, block_size=self.block_size,
            decode_partition_size=self.partition_size(d) if d else None)

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        # largest first: smaller graphs reuse its memory pool
        for bucket in sorted(self.buckets, key=lambda b: (b[0] + b[1], b[1]), reverse=True):
            d, t = bucket
            if t:  # no prompt sequence yet: every prefill program exits at once
                self.query_start_loc[d:d + MAX_PREFILL_SEQS + 1] = d
            if not self.capture_graphs:
                self.graphs[bucket] = None
                continue
            with forward_context(self.metadata(bucket), self.attention_fn):
                self._forward(bucket)  # warm-up / compile
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                # thread_local: the CUDA calls of other threads (NCCL's watchdog polls its events) must not
                # invalidate this thread's capture
                with torch.cuda.graph(graph, self.pool, capture_error_mode="thread_local"):
                    self._forward(bucket)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bucket] = graph
        if self.capture_graphs:
            torch.cuda.synchronize()
            logger.info("captured %d CUDA graphs (decode steps of 1..%d sequences, %d mixed buckets) in %.1fs",
                        len(self.graphs), self.sizes[-1], len(self.mixed), time.perf_counter() - t0)

    def _forward(self, bucket: Bucket) -> None:
        rows = bucket[0] + bucket[1]
        inputs = None if self.inputs is None else tuple(t[:rows] for t in self.inputs)
        out = self.model(self.input_ids[:rows], self.positions[:rows], inputs)
        for buf, t in zip(self.outputs, out if isinstance(out, tuple) else (out,)):
            buf[:rows] = t

    def bucket(self, md: AttentionMetadata, num_tokens: int) -> Bucket | None:
        """The smallest bucket that holds the step, or None (run it eagerly)."""
        nd, prompts = md.num_decodes, md.num_seqs - md.num_decodes
        if not prompts:
            return next(((b, 0) for b in self.sizes if b >= nd), None)
        if prompts > MAX_PREFILL_SEQS:
            return None
        return next((b for b in self.mixed if b[0] >= nd and b[1] >= num_tokens - nd), None)  # (mixed is sorted)

    def run(self, bucket: Bucket, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
            rows: list[int], intermediate: tuple[torch.Tensor, torch.Tensor] | None = None
            ) -> tuple[torch.Tensor | tuple[torch.Tensor, ...], list[int]]:
        """Copy one step's inputs (on the device; the previous stage's hidden states on a later stage) into the
        bucket's buffers and replay. Returns (the final hidden states, or (hidden, residual) before the last stage;
        `rows`, the flat step's rows whose logits are wanted, as rows of those): a decode step's outputs are its
        n rows; a mixed step's are the bucket's rows, its prompt tokens from row D on."""
        d, t = bucket
        n, nd = input_ids.shape[0], md.num_decodes
        self._copy_rows(0, slice(0, nd), input_ids, positions, md.slot_mapping)
        self._copy_seqs(0, slice(0, nd), md)
        if d > nd:  # padded decode rows: nothing stored, one token attended
            self.slot_mapping[nd:d] = -1
            self.seq_lens[nd:d] = 1
        if t:
            prompts, tokens = md.num_seqs - nd, n - nd
            self._copy_rows(d, slice(nd, n), input_ids, positions, md.slot_mapping)
            self.slot_mapping[d + tokens:d + t] = -1
            self._copy_seqs(d, slice(nd, md.num_seqs), md)
            self.query_start_loc[d:d + prompts + 1] = md.query_start_loc[nd:] + (d - nd)  # (entry d: d)
            self.query_start_loc[d + prompts + 1:d + MAX_PREFILL_SEQS + 1] = d + tokens  # absent: no tokens
            rows = [r if r < nd else r - nd + d for r in rows]
        if self.inputs is not None:
            for buf, x in zip(self.inputs, intermediate):  # type: ignore[arg-type]
                buf[:n] = x
        graph = self.graphs[bucket]
        if graph is not None:
            graph.replay()
        else:
            with forward_context(self.metadata(bucket), self.attention_fn):
                self._forward(bucket)
        size = d + t if t else n
        if len(self.outputs) == 1:
            return self.outputs[0][:size], rows
        return tuple(x[:size] for x in self.outputs), rows

    def _copy_rows(self, at: int, src: slice, input_ids: torch.Tensor, positions: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
        k = src.stop - src.start
        if k:
            self.input_ids[at:at + k] = input_ids[src]
            self.positions[at:at + k] = positions[src]
            self.slot_mapping[at:at + k] = slot_mapping[src]

    def _copy_seqs(self, at: int, src: slice, md: AttentionMetadata) -> None:
        k = src.stop - src.start
        if k:
            self.seq_lens[at:at + k] = md.seq_lens[src]
            self.block_tables[at:at + k, :md.block_tables.shape[1]] = md.block_tables[src]
