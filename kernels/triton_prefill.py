"""Triton paged prefill/extend attention for a varlen batch (twin: paged_prefill_ref).

Sequence i has q_len = query_start_loc[i+1] - query_start_loc[i] new tokens at positions
[seq_len - q_len, seq_len). Each new token attends to the ctx_len = seq_len - q_len cached tokens, read
through the block table (a prefix-cache hit or the earlier chunks of a chunked prefill), and causally to the
new tokens up to itself, read from this step's k/v [num_tokens, kv_heads, head_dim] (contiguous rows, and a
plain prefill never touches the cache).

Grid (num_heads, rows // BLOCK_M + num_seqs): one program per tile of BLOCK_M new tokens of one sequence and one
query head. The tiles are numbered over the whole batch: sequence i owns the numbers from
query_start_loc[i] // BLOCK_M + i on (at least one more than its tiles; the spare ones exit at once), and a program
finds its sequence by counting the sequences whose numbers start at or below its own (one vector load for up to
SEQ_CHUNK sequences). So the grid grows with the step's tokens, not with its sequence count times its longest
prompt: a CUDA graph's grid, sized for the most sequences and tokens a bucket holds, launches few programs that have
nothing to do. Within a sequence the last tile (the most keys) has the lowest number, and the GPU starts programs
in grid order: a sequence's long programs start first and its short ones fill the end (no long tail); a GQA
group's heads run side by side on the same keys.
A program's keys come in three phases: A the cached prefix (whole tiles without masks, then a masked tail), B the new
tokens before the tile (whole tiles, no masks, since BLOCK_M is a multiple of BLOCK_N), C the diagonal with the
causal mask.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvgate.kernels.triton_decode import attend_tile, cache_slots, dot_precision, row_sum, use_upcast

SEQ_CHUNK = 64  # sequence starts a program reads at once to find its sequence
SMALL_STEP_TOKENS = 4096  # rows (q's) up to which a step takes the smaller prefill tiles (prefill_config)


def prefill_config(head_dim: int, dtype: torch.dtype, num_tokens: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for a step of num_tokens rows (q's, decode rows included). From
    sm_90 register counts (ptxas -v, no spills) and `benchmarks/kernels.py --sweep-prefill` on H100s: up to
    SMALL_STEP_TOKENS rows, 64-row tiles (twice the programs, so a short prompt's causal triangle spreads over the
    SMs: 181.7 against 160.4 TFLOP/s at 1,024 tokens, 338.5 / 324.5 at 2,048; an earlier run 388.2 / 383.6 at
    4,096), 128-row tiles above. fp32 (ieee tl.dot on FMAs, not a speed target) needs more registers: smaller tiles
    (still some spills at head_dim >= 128)."""
    if dtype == torch.float32:
        return (64, 32, 8, 2) if head_dim <= 64 else (32, 16, 4, 2)
    if head_dim <= 128:
        return (64, 64, 4, 3) if num_tokens <= SMALL_STEP_TOKENS else (128, 64, 8, 3)
    return 64, 32, 8, 2


# not specialized on values that change per step (block-table width) nor on the alignment of the index pointers,
# which are slices past the step's decodes: see triton_decode._STEP_VALUES
@triton.jit(do_not_specialize=["stride_bt", "num_seqs"],
            do_not_specialize_on_alignment=["block_tables_ptr", "query_start_loc_ptr", "seq_lens_ptr"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr,
    qk_scale, num_seqs,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, stride_bt,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SEQ_CHUNK: tl.constexpr,
):
    head = tl.program_id(0)
    tile = tl.program_id(1)
    seq = tile * 0 - 1  # the last sequence whose first tile number is <= tile: count the sequences that start there
    for c0 in range(0, num_seqs, SEQ_CHUNK):  # (one chunk, one load, for up to SEQ_CHUNK sequences)
        i = c0 + tl.arange(0, SEQ_CHUNK)
        starts = tl.load(query_start_loc_ptr + i, mask=i < num_seqs, other=0) // BLOCK_M + i
        seq += row_sum(((starts <= tile) & (i < num_seqs)).to(tl.int32), 0)
    if seq < 0:
        return  # before the first sequence's tiles (its rows start past row 0)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_end = tl.load(query_start_loc_ptr + seq + 1)
    q_len = q_end - q_start
    tile_start = (q_end // BLOCK_M + seq - tile) * BLOCK_M  # the next sequence's first number - 1 - tile: longest first
    if tile_start < 0 or tile_start >= q_len:
        return  # past the last sequence's tiles, or a spare number of this one
    ctx_len = tl.load(seq_lens_ptr + seq) - q_len  # tokens cached before this step's
    kvh = head // GROUP
    offs_m = tile_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    row_mask = (offs_m < q_len)[:, None] & (offs_d < HEAD_DIM)[None, :]
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=row_mask, other=0.0)
    q = q.to(tl.float32) * qk_scale
    if not UPCAST:
        q = q.to(k_cache_ptr.dtype.element_ty)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, D_PAD], 0.0, tl.float32)
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # A: the cached prefix, whole tiles then the masked tail
    full_end = ctx_len // BLOCK_N * BLOCK_N
    for n0 in range(0, full_end, BLOCK_N):
        pos = n0 + offs_n
        blk, within = cache_slots(table_ptr, pos, pos < ctx_len, BLOCK_SIZE, False)
        m_i, l_i, acc = attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr,
                                    blk * stride_kcb + within * stride_kcs + kvh * stride_kch,
                                    blk * stride_vcb + within * stride_vcs + kvh * stride_vch,
                                    pos < ctx_len, offs_m, pos, offs_d, HEAD_DIM, False, False, UPCAST, DOT_PRECISION)
    for n0 in range(full_end, ctx_len, BLOCK_N):
        pos = n0 + offs_n
        blk, within = cache_slots(table_ptr, pos, pos < ctx_len, BLOCK_SIZE, True)
        m_i, l_i, acc = attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr,
                                    blk * stride_kcb + within * stride_kcs + kvh * stride_kch,
                                    blk * stride_vcb + within * stride_vcs + kvh * stride_vch,
                                    pos < ctx_len, offs_m, pos, offs_d, HEAD_DIM, True, False, UPCAST, DOT_PRECISION)
    # B: this step's tokens before the tile, seen by every row
    for n0 in range(0, tile_start, BLOCK_N):
        j = n0 + offs_n
        new = (q_start + j).to(tl.int64)
        m_i, l_i, acc = attend_tile(q, m_i, l_i, acc, k_ptr, v_ptr, new * stride_kt + kvh * stride_kh,
                                    new * stride_vt + kvh * stride_vh, j < q_len, offs_m, j, offs_d, HEAD_DIM,
                                    False, False, UPCAST, DOT_PRECISION)
    # C: the diagonal, causally masked
    for n0 in range(tile_start, tl.minimum(q_len, tile_start + BLOCK_M), BLOCK_N):
        j = n0 + offs_n
        new = (q_start + j).to(tl.int64)
        m_i, l_i, acc = attend_tile(q, m_i, l_i, acc, k_ptr, v_ptr, new * stride_kt + kvh * stride_kh,
                                    new * stride_vt + kvh * stride_vh, j < q_len, offs_m, j, offs_d, HEAD_DIM,
                                    True, True, UPCAST, DOT_PRECISION)
    out = acc / l_i[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask)


def paged_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                  max_query_len: int, scale: float, out: torch.Tensor | None = None, block_m: int | None = None,
                  block_n: int | None = None) -> torch.Tensor:
    """Varlen prefill/extend over the sequences of seq_lens [num_seqs] (int32, on q's device).

    q [num_tokens, heads, head_dim] and this step's k/v [num_tokens, kv_heads, head_dim]; query_start_loc
    [num_seqs + 1] holds absolute row indices into them, so a slice of a larger batch's metadata can be passed
    as it is; rows that belong to no sequence are left untouched in `out`. max_query_len: an upper bound of
    the sequences' new-token counts. block_m must be a multiple of block_n (both >= 16, powers of 2)."""
    num_seqs = seq_lens.shape[0]
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_seqs == 0 or max_query_len == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k.to(k_cache.dtype)  # one dtype for cached and fresh keys
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v.to(v_cache.dtype)
    v = v if v.stride(-1) == 1 else v.contiguous()
    default_m, default_n, num_warps, num_stages = prefill_config(head_dim, k_cache.dtype, q.shape[0])
    block_m, block_n = block_m or default_m, block_n or default_n
    if block_m % block_n:
        raise ValueError(f"block_m ({block_m}) must be a multiple of block_n ({block_n})")
    upcast = use_upcast(k_cache.dtype)
    grid = (num_heads, q.shape[0] // block_m + num_seqs)  # every tile number a sequence may own (module docstring)
    _prefill_kernel[grid](
        q, k, v, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        scale * math.log2(math.e), num_seqs,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        BLOCK_SIZE=k_cache.shape[1], GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        D_PAD=max(16, triton.next_power_of_2(head_dim)), BLOCK_M=block_m, BLOCK_N=block_n, UPCAST=upcast,
        DOT_PRECISION=dot_precision(k_cache.dtype, upcast), SEQ_CHUNK=SEQ_CHUNK, num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
