"""Temperature sampling in one pass over the logits (the twin: Sampler._sample in engine/sampler.py, which draws
from the same distribution).

Sampling token j with probability softmax(l / T)_j is the same as taking argmax_j (l_j / T + g_j) with g_j
independent Gumbel(0, 1) noise (the Gumbel-max trick): no softmax, no normalisation, one read of each row. The torch
path runs ~8 kernels over the [rows, vocab] logits (a float copy, the division by T, softmax, the noise, its logs,
the division and the argmax: ~0.6 ms of a decode step of 193 sequences over Qwen3's 151,936 tokens on an H200);
this kernel reads them once. A row with temperature 0 takes the plain argmax (the first of equal maxima, as
torch.argmax). Rows with top-k, top-p or min-p stay on the torch path.

Guided rows: the kernel also takes the step's grammar bitmask (xgrammar's layout: int32 words, bit j of word w
allows token 32 w + j) and masks each guided row's tokens as it reads them (the twin: xgrammar's
apply_token_bitmask_inplace, then the torch path). That saves a copy of the logits and two passes over them, and the
launch of xgrammar's kernel, on the path every guided step waits for.

The noise comes from a counter-based hash (lowbias32) of a per-row seed and each token's index: builtins only, so
that Triton's interpreter runs it too (its own tl.rand is a @triton.jit function, which the interpreter cannot call
once triton was imported before TRITON_INTERPRET was set; see triton_decode). The sampler derives a seeded
request's row seed from its seed, its sample index and the token's position (`row_seed`), so its draws do not depend
on the batch it shares: one kernel for every row, where a torch generator per row took one call a row.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvgate.kernels.triton_decode import row_max


STEP_SEED_STRIDE = 0x9E3779B1  # a step's seed for row r: its seed + r * this (mod 2**32)
_STRIDE = tl.constexpr(STEP_SEED_STRIDE)  # (a kernel reads only globals made constexpr this way)


@triton.jit
def _uniform(seed, idx):
    """A uniform float in (0, 1) per element of idx (uint32): lowbias32 of idx offset by the seed (two rows' index
    ranges overlap only where their scrambled seeds lie within a vocabulary of each other)."""
    x = idx + seed.to(tl.uint32) * 0x9E3779B9
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    return ((x >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)


@triton.jit(do_not_specialize=["step_seed"])  # a random value each step: one compiled kernel for all of them
def _sample_kernel(logits_ptr, stride_row, inv_temp_ptr, seed_ptr, step_seed, out_ptr, vocab,
                   mask_ptr, mask_stride, mask_rows_ptr, valid_ptr,
                   ROW_SEEDS: tl.constexpr, MASK: tl.constexpr, MASK_ROWS: tl.constexpr, VALID: tl.constexpr,
                   BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    mrow = row
    if MASK_ROWS:
        mrow = tl.load(mask_rows_ptr + row).to(tl.int64)  # < 0: the row is not masked
    inv_t = tl.load(inv_temp_ptr + row)  # 0: greedy
    if ROW_SEEDS:
        seed = tl.load(seed_ptr + row)
    else:
        seed = step_seed + row * _STRIDE
    noise = tl.where(inv_t > 0, 1.0, 0.0)  # the Gumbel noise's weight: 0 for a greedy row
    scale = tl.where(inv_t > 0, inv_t, 1.0)
    best_val = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK], 0, tl.int32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < vocab
        x = tl.load(logits_ptr + row * stride_row + offs, mask=mask, other=float("-inf")).to(tl.float32) * scale
        if MASK:
            if mrow >= 0:
                word = tl.load(mask_ptr + mrow * mask_stride + (offs >> 5), mask=mask, other=0)
                if VALID:
                    word = word & tl.load(valid_ptr + (offs >> 5), mask=mask, other=0)
                x = tl.where(((word >> (offs & 31)) & 1) != 0, x, float("-inf"))
        u = _uniform(seed, offs.to(tl.uint32))
        g = -tl.log(-tl.log(u))  # Gumbel(0, 1)
        x = tl.where(mask, x + noise * g, x)
        better = x > best_val  # strictly: the first of equal values stays
        best_val = tl.where(better, x, best_val)
        best_idx = tl.where(better, offs, best_idx)
    top = row_max(best_val, 0)
    first = -row_max(tl.where(best_val == top, -best_idx, -vocab), 0)  # the first index holding the maximum
    tl.store(out_ptr + row, first.to(tl.int64))


MASK64 = (1 << 64) - 1


def row_seed(seed: int, index: int, position: int) -> int:
    """A seeded request's row seed (32 bits) for the token at `position` of its sample `index`: splitmix64's
    finalizer over the three combined."""
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xD1B54A32D192ED03 + position * 0x8CB92BA72F3D8DD7) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return (x ^ (x >> 31)) & 0xFFFFFFFF


def sample(logits: torch.Tensor, inv_temperature: torch.Tensor, seeds: torch.Tensor | int,
           bitmask: torch.Tensor | None = None, mask_rows: torch.Tensor | None = None,
           valid: torch.Tensor | None = None, block: int = 1024) -> torch.Tensor:
    """logits [rows, vocab] (last dim contiguous), inv_temperature [rows] float32 (1 / T; 0: greedy), seeds: each
    row's noise, an int64 tensor [rows] of 32-bit values, or one step's seed (row r: seeds + r * STEP_SEED_STRIDE)
    -> token ids [rows] int64, drawn from softmax(logits / T) per row. A step's seed counts by its low 31 bits: an
    argument that Triton types by its value must keep one type, or each new one compiles the kernel again mid-run.
    `block`: tokens a program reads at once (a power of 2).

    `bitmask` (int32 [>= rows, ceil(vocab / 32)], last dim contiguous): only the tokens whose bit is set may be
    drawn; logits row r reads bitmask row `mask_rows[r]` (int32 [rows]; < 0: r is not masked), or row r where
    mask_rows is None. `valid` (int32 [ceil(vocab / 32)]) is and-ed into every masked row."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        row_seeds = isinstance(seeds, torch.Tensor)
        masked = bitmask is not None
        _sample_kernel[(rows,)](logits, logits.stride(0), inv_temperature, seeds if row_seeds else out,
                               0 if row_seeds else seeds & 0x7FFFFFFF, out, vocab,  # (an int32 argument always)
                               bitmask if masked else out, bitmask.stride(0) if masked else 0,
                               mask_rows if mask_rows is not None else out, valid if valid is not None else out,
                               ROW_SEEDS=row_seeds, MASK=masked, MASK_ROWS=masked and mask_rows is not None,
                               VALID=masked and valid is not None, BLOCK=block, num_warps=4)
    return out
