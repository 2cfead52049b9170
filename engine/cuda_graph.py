"""CUDA graphs for decode steps: the model's forward for a batch of one-token sequences, captured once per
batch-size bucket and replayed with the step's inputs copied into static buffers.

An eager decode step launches ~40 small kernels per layer from Python; replaying a graph launches them all
at once, so the GPU no longer waits on the host. Captured for 1, 2, 4, 8, then every 16 up to max_num_seqs;
a step of n sequences replays the smallest bucket >= n, its extra rows padded (slot -1: nothing stored,
context length 1). Attention inside a graph cannot look at host values that change per step, so it reads
lengths from the device and splits every sequence into partitions of a size fixed per bucket
(`graph_partition_size`); partitions past a sequence's end exit at once.

A pipeline stage captures its own layers: a stage after the first takes the previous stage's (hidden, residual) as
inputs, copied into buffers of the graph, and a stage before the last returns its (hidden, residual); the transfers
between stages stay outside the graphs. Under tensor parallelism each rank captures the same batch sizes in the same
order, the layers' all-reduces inside the graphs.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from kvgate.engine.forward_context import forward_context
from kvgate.kernels.metadata import AttentionMetadata

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, attention_fn: Callable, max_num_seqs: int, max_model_len: int,
                 block_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 partition_size: Callable[[int], int], first_stage: bool = True, last_stage: bool = True) -> None:
        self.model, self.attention_fn = model, attention_fn
        self.max_model_len, self.block_size = max_model_len, block_size
        self.sizes = graph_batch_sizes(max_num_seqs)
        n = self.sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((n, max_blocks), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        # the previous stage's (hidden, residual) (None on the first stage); this stage's output: the final hidden
        # states on the last stage, else (hidden, residual)
        self.inputs = None if first_stage else tuple(torch.zeros((n, hidden_size), dtype=dtype, device=device)
                                                    for _ in range(2))
        self.outputs = tuple(torch.zeros((n, hidden_size), dtype=dtype, device=device)
                             for _ in range(1 if last_stage else 2))
        self.partition_size = partition_size
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], query_start_loc=self.query_start_loc[:bs + 1],
            seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs], num_decodes=bs, max_query_len=1,
            max_seq_len=self.max_model_len, block_size=self.block_size,
            decode_partition_size=self.partition_size(bs))

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        for bs in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
            md = self.metadata(bs)
            with forward_context(md, self.attention_fn):
                self._forward(bs)  # warm-up / compile
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                # thread_local: the CUDA calls of other threads (NCCL's watchdog polls its events) must not
                # invalidate this thread's capture
                with torch.cuda.graph(graph, self.pool, capture_error_mode="thread_local"):
                    self._forward(bs)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch 1..%d) in %.1fs", len(self.graphs), self.sizes[-1],
                    time.perf_counter() - t0)

    def _forward(self, bs: int) -> None:
        inputs = None if self.inputs is None else tuple(t[:bs] for t in self.inputs)
        out = self.model(self.input_ids[:bs], self.positions[:bs], inputs)
        for buf, t in zip(self.outputs, out if isinstance(out, tuple) else (out,)):
            buf[:bs] = t

    def can_run(self, num_seqs: int) -> bool:
        return num_seqs <= self.sizes[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            seq_lens: torch.Tensor, block_tables: torch.Tensor,
            intermediate: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Copy one decode step's inputs (n rows, on the device; the previous stage's hidden states on a later
        stage) into the buffers and replay; -> the final hidden states [n, H], or (hidden, residual) before the last
        stage."""
        n = input_ids.shape[0]
        bs = next(b for b in self.sizes if b >= n)
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.slot_mapping[:n] = slot_mapping
        self.seq_lens[:n] = seq_lens
        self.block_tables[:n, : block_tables.shape[1]] = block_tables
        if self.inputs is not None:
            for buf, t in zip(self.inputs, intermediate):  # type: ignore[arg-type]
                buf[:n] = t
        if bs > n:
            self.slot_mapping[n:bs] = -1
            self.seq_lens[n:bs] = 1
        self.graphs[bs].replay()
        if len(self.outputs) == 1:
            return self.outputs[0][:n]
        return tuple(t[:n] for t in self.outputs)
