"""Temperature sampling in one pass over the logits (the twin: Sampler._sample in engine/sampler.py, which draws
from the same distribution).

Sampling token j with probability softmax(l / T)_j is the same as taking argmax_j (l_j / T + g_j) with g_j
independent Gumbel(0, 1) noise (the Gumbel-max trick): no softmax, no normalisation, one read of each row. The torch
path runs ~8 kernels over the [rows, vocab] logits (a float copy, the division by T, softmax, the noise, its logs,
the division and the argmax: ~0.6 ms of a decode step of 193 sequences over Qwen3's 151,936 tokens on an H200);
this kernel reads them once. A row with temperature 0 takes the plain argmax (the first of equal maxima, as
torch.argmax). Rows with top-k, top-p, min-p or a seed of their own stay on the torch path.

The noise comes from a counter-based hash (lowbias32) of a per-step seed and each element's index: builtins only,
so that Triton's interpreter runs it too (its own tl.rand is a @triton.jit function, which the interpreter cannot
call once triton was imported before TRITON_INTERPRET was set; see triton_decode).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvgate.kernels.triton_decode import row_max


@triton.jit
def _uniform(seed, idx):
    """A uniform float in (0, 1) per element of idx (uint32): lowbias32 of idx mixed with the seed."""
    x = idx ^ (seed.to(tl.uint32) * 0x9E3779B9)
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    return ((x >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)


@triton.jit
def _sample_kernel(logits_ptr, stride_row, inv_temp_ptr, out_ptr, seed, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    inv_t = tl.load(inv_temp_ptr + row)  # 0: greedy
    noise = tl.where(inv_t > 0, 1.0, 0.0)  # the Gumbel noise's weight: 0 for a greedy row
    scale = tl.where(inv_t > 0, inv_t, 1.0)
    best_val = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK], 0, tl.int32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < vocab
        x = tl.load(logits_ptr + row * stride_row + offs, mask=mask, other=float("-inf")).to(tl.float32) * scale
        u = _uniform(seed, (row * vocab + offs).to(tl.uint32))
        g = -tl.log(-tl.log(u))  # Gumbel(0, 1)
        x = tl.where(mask, x + noise * g, x)
        better = x > best_val  # strictly: the first of equal values stays
        best_val = tl.where(better, x, best_val)
        best_idx = tl.where(better, offs, best_idx)
    top = row_max(best_val, 0)
    first = -row_max(tl.where(best_val == top, -best_idx, -vocab), 0)  # the first index holding the maximum
    tl.store(out_ptr + row, first.to(tl.int64))


def sample(logits: torch.Tensor, inv_temperature: torch.Tensor, seed: int, block: int = 1024) -> torch.Tensor:
    """logits [rows, vocab] (last dim contiguous), inv_temperature [rows] float32 (1 / T; 0: greedy) -> token ids
    [rows] int64, drawn from softmax(logits / T) per row. `block`: tokens a program reads at once (a power of 2)."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        _sample_kernel[(rows,)](logits, logits.stride(0), inv_temperature, out, seed, vocab, BLOCK=block, num_warps=4)
    return out
