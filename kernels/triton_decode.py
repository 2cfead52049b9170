"""Triton paged decode attention, split-K in the style of PagedAttention V2 (twin: paged_decode_ref).

Grid (num_seqs, num_kv_heads, num_partitions). Each program serves all query heads of one KV head (the GQA
group, padded to GROUP_PAD >= 16 rows so that tl.dot can be used): one load of a K/V tile serves the whole
group. It walks the tokens of its partition [part * partition_size, (part + 1) * partition_size) in tiles of
TILE_N tokens (whole tiles without masks, then a masked tail), each token's K/V row found through the block
table, and keeps a running max / sum / output in
fp32 (online softmax, base 2). With one partition the program normalises and writes the output directly;
otherwise it writes a normalised partial output plus its max and sum, and `_reduce_kernel` merges the
partitions of each (sequence, head) by log-sum-exp.

`cache_slots` (where a tile's tokens live in the paged cache) and `attend_tile` (one K/V tile, one
online-softmax update) are shared with the prefill kernel.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

# Knobs for the partitioning rule: split sequences only when the batch gives fewer than SPLIT_BELOW programs
# per SM; then aim for PROGRAMS_PER_SM programs per SM, but never cut a sequence into partitions shorter than
# MIN_PARTITION_TOKENS or into more than MAX_PARTITIONS pieces. Set from a sweep on the H200
# (benchmarks/kernels.py --sweep): at batch 1-4 the fastest partition sizes gave ~4 programs per SM, while
# splitting a batch that already gives 4 per SM (64 sequences x 8 KV heads) made it slower.
SPLIT_BELOW = 2
PROGRAMS_PER_SM = 4
MIN_PARTITION_TOKENS = 128
MAX_PARTITIONS = 64
FALLBACK_NUM_SMS = 132  # not on CUDA (the interpreter): pretend to be an H200
DECODE_TILE_N = 64  # tokens per K/V tile
DECODE_NUM_WARPS = 4
DECODE_NUM_STAGES = 2  # sm_90 build: 96 registers, K/V tiles double-buffered through cp.async


# Only builtins of triton.language below: its standard-library functions (tl.max, tl.sum, tl.zeros, tl.cdiv)
# are themselves @triton.jit functions, fixed as compiled or interpreted when triton is first imported, and
# transformers imports triton before a test can set TRITON_INTERPRET=1; the interpreter patches builtins at
# call time and runs tl.reduce with these two standard combine functions in numpy.
@triton.jit
def row_max(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_max)


@triton.jit
def row_sum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def cache_slots(table_ptr, pos, n_mask, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """(physical block [N] int64, index within the block [N]) of the tokens at positions `pos` of one
    sequence whose block-table row starts at table_ptr."""
    if MASKED:
        blk = tl.load(table_ptr + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    else:
        blk = tl.load(table_ptr + pos // BLOCK_SIZE).to(tl.int64)
    return blk, pos % BLOCK_SIZE


@triton.jit
def attend_tile(q, m_i, l_i, acc, k_ptr, v_ptr, k_rows, v_rows, n_mask, q_idx, k_idx, offs_d,
                HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    """One online-softmax step: the rows of q [M, D_PAD] (pre-scaled by scale*log2(e)) attend to the N keys
    and values whose head_dim vectors start at k_ptr + k_rows / v_ptr + v_rows; updates the running max
    m_i [M], sum l_i [M] and unnormalised output acc [M, D_PAD]. MASKED: keys with n_mask False are
    ignored and, CAUSAL, so are keys with k_idx > a row's q_idx; otherwise every row attends every key."""
    d_mask = offs_d < HEAD_DIM
    if MASKED:
        kv_mask = n_mask[:, None] & d_mask[None, :]
    else:
        kv_mask = d_mask[None, :]
    k = tl.load(k_ptr + k_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + v_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if MASKED:
        if CAUSAL:
            s = tl.where(n_mask[None, :] & (k_idx[None, :] <= q_idx[:, None]), s, float("-inf"))
        else:
            s = tl.where(n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, row_max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + row_sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# Values that change from step to step are not specialized on (Triton would otherwise compile a variant for each
# divisibility-by-16 / alignment class it meets: a stall of ~1 s per variant on live traffic). The index
# pointers may be slices of a larger batch's metadata (decodes first), so their alignment varies too.
_STEP_VALUES = ["partition_size", "stride_bt"]
_INDEX_POINTERS = ["block_tables_ptr", "seq_lens_ptr"]


@triton.jit(do_not_specialize=_STEP_VALUES, do_not_specialize_on_alignment=_INDEX_POINTERS)
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
    qk_scale, partition_size,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr, TILE_N: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = part * partition_size
    if start >= seq_len:  # a partition past this sequence's end (the reduce kernel ignores it)
        return
    end = tl.minimum(start + partition_size, seq_len)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, TILE_N)
    heads = kvh * GROUP + offs_g
    row_mask = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
    seq64 = seq.to(tl.int64)
    q = tl.load(q_ptr + seq64 * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=row_mask, other=0.0)
    q = q.to(tl.float32) * qk_scale
    if not UPCAST:
        q = q.to(k_cache_ptr.dtype.element_ty)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.full([GROUP_PAD], 0.0, tl.float32)
    acc = tl.full([GROUP_PAD, D_PAD], 0.0, tl.float32)
    table_ptr = block_tables_ptr + seq64 * stride_bt
    full_end = start + (end - start) // TILE_N * TILE_N
    for n0 in range(start, full_end, TILE_N):  # whole tiles: no masks
        pos = n0 + offs_n
        blk, within = cache_slots(table_ptr, pos, pos < end, BLOCK_SIZE, False)
        m_i, l_i, acc = attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr,
                                    blk * stride_kb + within * stride_ks + kvh * stride_kh,
                                    blk * stride_vb + within * stride_vs + kvh * stride_vh,
                                    pos < end, offs_g, pos, offs_d, HEAD_DIM, False, False, UPCAST, DOT_PRECISION)
    for n0 in range(full_end, end, TILE_N):  # the tail (at most one tile)
        pos = n0 + offs_n
        blk, within = cache_slots(table_ptr, pos, pos < end, BLOCK_SIZE, True)
        m_i, l_i, acc = attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr,
                                    blk * stride_kb + within * stride_ks + kvh * stride_kh,
                                    blk * stride_vb + within * stride_vs + kvh * stride_vh,
                                    pos < end, offs_g, pos, offs_d, HEAD_DIM, True, False, UPCAST, DOT_PRECISION)
    out = acc / l_i[:, None]
    if SPLIT:
        num_heads = tl.num_programs(1) * GROUP
        num_parts = tl.num_programs(2)
        idx = (seq64 * num_heads + heads) * num_parts + part  # [GROUP_PAD]
        g_mask = offs_g < GROUP
        tl.store(part_max_ptr + idx, m_i, mask=g_mask)
        tl.store(part_sum_ptr + idx, l_i, mask=g_mask)
        tl.store(part_out_ptr + idx[:, None] * D_PAD + offs_d[None, :], out, mask=row_mask)
    else:
        tl.store(out_ptr + seq64 * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit(do_not_specialize=["partition_size", "num_parts"], do_not_specialize_on_alignment=["seq_lens_ptr"])
def _reduce_kernel(
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, seq_lens_ptr, partition_size, num_parts, stride_ot,
    stride_oh, PARTS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    used = (seq_len + partition_size - 1) // partition_size
    offs_p = tl.arange(0, PARTS_PAD)
    offs_d = tl.arange(0, D_PAD)
    p_mask = offs_p < used
    idx = (seq * num_heads + head) * num_parts + offs_p
    part_max = tl.load(part_max_ptr + idx, mask=p_mask, other=float("-inf"))
    part_sum = tl.load(part_sum_ptr + idx, mask=p_mask, other=0.0)
    weight = part_sum * tl.exp2(part_max - row_max(part_max, 0))  # 0 for unused partitions
    part_out = tl.load(part_out_ptr + idx[:, None] * D_PAD + offs_d[None, :], mask=p_mask[:, None], other=0.0)
    out = row_sum(part_out * weight[:, None], 0) / row_sum(weight, 0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return FALLBACK_NUM_SMS


def decode_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(TILE_N, num_warps, num_stages). fp32 tl.dot runs on FMAs (ieee) and needs more registers: smaller
    tiles for large heads (sm_90 builds spill otherwise)."""
    if dtype == torch.float32 and head_dim > 128:
        return min(32, DECODE_TILE_N), 8, DECODE_NUM_STAGES
    return DECODE_TILE_N, DECODE_NUM_WARPS, DECODE_NUM_STAGES


def choose_partitions(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device,
                      tile_n: int | None = None) -> tuple[int, int]:
    """(num_partitions, partition_size): split a sequence only when num_seqs * num_kv_heads programs leave
    the GPU under-filled and the context is long enough; partitions are equal, a multiple of tile_n, and
    cover max_seq_len."""
    max_seq_len = max(max_seq_len, 1)
    tile_n = tile_n or DECODE_TILE_N
    programs = num_seqs * num_kv_heads
    target = PROGRAMS_PER_SM * _num_sms(device)
    parts = 1
    if programs < SPLIT_BELOW * _num_sms(device):
        parts = min(triton.cdiv(target, programs), max_seq_len // MIN_PARTITION_TOKENS, MAX_PARTITIONS)
        parts = max(parts, 1)
    size = triton.cdiv(triton.cdiv(max_seq_len, parts), tile_n) * tile_n
    return triton.cdiv(max_seq_len, size), size


def graph_partition_size(num_seqs: int, num_kv_heads: int, max_model_len: int, device: torch.device) -> int:
    """A partition size that serves every context up to max_model_len without host lengths (CUDA graphs):
    one partition when num_seqs * num_kv_heads programs fill the GPU, else the smallest size that keeps the
    partitions of a max_model_len context at most MAX_PARTITIONS (and at least 2 * MIN_PARTITION_TOKENS)."""
    tile = DECODE_TILE_N
    if num_seqs * num_kv_heads >= SPLIT_BELOW * _num_sms(device):
        return triton.cdiv(max_model_len, tile) * tile
    size = max(2 * MIN_PARTITION_TOKENS, triton.cdiv(max_model_len, MAX_PARTITIONS))
    return triton.cdiv(size, tile) * tile


def parts_pad(num_parts: int) -> int:
    """The reduce kernel's partition tile: one size for every count up to MAX_PARTITIONS, so that a server does
    not compile a new variant (about a second each on the GPU) whenever a step's partition count changes."""
    return triton.next_power_of_2(max(num_parts, MAX_PARTITIONS))


def interpreted() -> bool:
    """True where these kernels run in Triton's interpreter (TRITON_INTERPRET=1 when this module was imported)."""
    return type(_decode_kernel).__name__ == "InterpretedFunction"


def use_upcast(dtype: torch.dtype) -> bool:
    """bf16 tensor-core math under the interpreter is wrong in triton 3.6 (it multiplies the raw uint16
    bits), so there bf16 K/V are converted to fp32 before tl.dot; on the GPU they go to tl.dot as they are."""
    return dtype == torch.bfloat16 and interpreted()


def dot_precision(dtype: torch.dtype, upcast: bool) -> str:
    return "ieee" if dtype == torch.float32 or upcast else "tf32"  # "tf32" only names the (unused) default


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, max_seq_len: int | None = None,
                 out: torch.Tensor | None = None, partition_size: int | None = None) -> torch.Tensor:
    """One query token per sequence. q: [num_seqs, heads, head_dim] -> [num_seqs, heads, head_dim].

    max_seq_len: an upper bound of seq_lens (read from the device when None). partition_size: force split-K
    with partitions of this many tokens (a multiple of 16); by default `choose_partitions` decides."""
    num_seqs, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    tile_n, num_warps, num_stages = decode_config(head_dim, k_cache.dtype)
    if partition_size is None:
        num_parts, partition_size = choose_partitions(num_seqs, num_kv_heads, max_seq_len, q.device, tile_n)
    else:
        if partition_size % 16:
            raise ValueError(f"partition_size must be a multiple of 16, got {partition_size}")
        num_parts = triton.cdiv(max(max_seq_len, 1), partition_size)
        tile_n = math.gcd(partition_size, tile_n)
    group = num_heads // num_kv_heads
    d_pad = max(16, triton.next_power_of_2(head_dim))
    upcast = use_upcast(k_cache.dtype)
    split = num_parts > 1
    if split:
        part_max = torch.empty((num_seqs, num_heads, num_parts), dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
        part_out = torch.empty((num_seqs, num_heads, num_parts, d_pad), dtype=torch.float32, device=q.device)
    else:
        part_max = part_sum = part_out = out  # unused
    _decode_kernel[(num_seqs, num_kv_heads, num_parts)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_max, part_sum,
        scale * math.log2(math.e), partition_size,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        D_PAD=d_pad, TILE_N=tile_n, SPLIT=split, UPCAST=upcast, DOT_PRECISION=dot_precision(k_cache.dtype, upcast),
        num_warps=num_warps, num_stages=num_stages,
    )
    if split:
        _reduce_kernel[(num_seqs, num_heads)](
            out, part_out, part_max, part_sum, seq_lens, partition_size, num_parts, out.stride(0), out.stride(1),
            PARTS_PAD=parts_pad(num_parts), HEAD_DIM=head_dim, D_PAD=d_pad,
            num_warps=4,
        )
    return out
