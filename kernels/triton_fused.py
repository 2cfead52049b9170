"""Fused Triton kernels for the small ops between the matmuls (twins: the torch code in engine/models/layers.py).

An eager decode layer spends more GPU time in a dozen tiny elementwise kernels (casts, powers, means, rotary
halves, concatenations) than in its attention at short contexts; each op below is one kernel instead:
- rms_norm: y = weight * normalize(x) in fp32, optionally adding the residual first (and returning the sum),
  over rows of a [rows, groups, dim] view, so that q/k head norms run on the strided q/k views too;
- rotary: neox-style rotary embedding of q and k in place, cos/sin read at each token's position (fp32),
  with no per-step cos/sin gather;
- qk_norm_rotary: Qwen3's q/k head norms and the rotary embedding of q and k in one kernel, in place (what the two
  rms_norm calls and rotary compute, with the same roundings, in one launch);
- silu_and_mul: silu(gate) * up of a [tokens, 2 * inter] activation.
Everything is computed in fp32 and rounded once at the store. TRITON_INTERPRET=1 must be set before this
module is first imported for the kernels to run on the CPU (tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvgate.kernels.triton_decode import row_sum  # builtins only: see triton_decode's note on the interpreter


@triton.jit(do_not_specialize=["num_rows"])  # a step's token count: no new compile mid-run when it is 1 or 16k
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_xr, stride_xg, stride_rr, stride_or,
                     stride_og, num_rows, groups, dim, eps, HAS_RES: tl.constexpr, ROWS: tl.constexpr,
                     BLOCK: tl.constexpr):
    """ROWS of the flattened [rows * groups, dim] view per program: one program per (row, group) left the q/k head
    norms of a long prompt step (128-wide rows, 100k+ programs of one warp) latency-bound at ~150 us a layer."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row, grp = r // groups, r % groups
    offs = tl.arange(0, BLOCK)
    mask = (r < num_rows)[:, None] & (offs < dim)[None, :]
    x_off = (row * stride_xr + grp * stride_xg)[:, None] + offs[None, :]
    x = tl.load(x_ptr + x_off, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:  # x + residual, rounded to the activation dtype as the unfused code does (groups == 1 here)
        r_off = (row * stride_rr)[:, None] + offs[None, :]
        s = (x + tl.load(res_ptr + r_off, mask=mask, other=0.0).to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + r_off, s, mask=mask)
        x = s.to(tl.float32)
    var = row_sum(x * x, 1) / dim
    y = (x * (1.0 / tl.sqrt(var + eps))[:, None]).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=offs < dim, other=0.0).to(tl.float32)[None, :]
    o_off = (row * stride_or + grp * stride_og)[:, None] + offs[None, :]
    tl.store(out_ptr + o_off, (w * y.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x: [rows, dim] or [rows, groups, dim] (last dim contiguous). With residual [rows, dim]: returns
    (norm(x + residual), x + residual), the sum written into a new tensor."""
    x3 = x if x.dim() == 3 else x[:, None, :]
    rows, groups, dim = x3.shape
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    out = torch.empty((rows, groups, dim), dtype=x.dtype, device=x.device)
    res_out = res = out  # unused without a residual
    if residual is not None:
        if groups != 1 or residual.stride(-1) != 1 or residual.shape != (rows, dim):
            raise ValueError("a residual needs x and residual of the same [rows, dim] shape, last dim contiguous")
        res = residual
        res_out = torch.empty_like(residual)
        if res_out.stride(0) != res.stride(0):
            res = res.contiguous()
    if rows:
        block = triton.next_power_of_2(dim)
        per_program = max(1, min(64, 4096 // block))  # ~4k elements a program: 32 head rows, 4 rows of 1024
        n = rows * groups
        _rms_norm_kernel[(triton.cdiv(n, per_program),)](
            x3, res, weight, out, res_out, x3.stride(0), x3.stride(1), res.stride(0), out.stride(0), out.stride(1),
            n, groups, dim, eps, HAS_RES=residual is not None, ROWS=per_program, BLOCK=block,
            num_warps=4 if per_program * block >= 2048 else 2)
    out = out.view(x.shape)
    return out if residual is None else (out, res_out)


@triton.jit
def _rotary_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, stride_xt, stride_xh, stride_cs, num_heads,
                   HALF: tl.constexpr, HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HALF_PAD)
    d_mask = offs_d < HALF
    mask = (offs_h < num_heads)[:, None] & d_mask[None, :]
    cos = tl.load(cos_ptr + pos * stride_cs + offs_d, mask=d_mask, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cs + offs_d, mask=d_mask, other=0.0)[None, :]
    p1 = x_ptr + t * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(p1 + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, h, d] and k [T, kvh, d] IN PLACE (they may be strided views, e.g. of the qkv projection)
    by the angles of `positions` [T]; cos/sin: [max_pos, d/2] fp32. Returns (q, k)."""
    out = []
    for x in (q, k):
        if x.stride(-1) != 1:
            x = x.contiguous()
        t, heads, d = x.shape
        if t:
            _rotary_kernel[(t,)](x, positions, cos, sin, x.stride(0), x.stride(1), cos.stride(0), heads,
                                 HALF=d // 2, HEADS_PAD=triton.next_power_of_2(heads),
                                 HALF_PAD=triton.next_power_of_2(d // 2), num_warps=4)
        out.append(x)
    return out[0], out[1]


@triton.jit
def _norm_rotate(x_ptr, w_ptr, cos, sin, stride_h, num_heads, eps, HALF: tl.constexpr, HEADS_PAD: tl.constexpr,
                 HALF_PAD: tl.constexpr):
    """RMSNorm (weight w) then rotary of one token's heads starting at x_ptr, in place; as rms_norm then rotary
    compute it: the normed value rounded to x's dtype before it is rotated."""
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HALF_PAD)
    d_mask = offs_d < HALF
    mask = (offs_h < num_heads)[:, None] & d_mask[None, :]
    p1 = x_ptr + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    rs = (1.0 / tl.sqrt((row_sum(x1 * x1, 1) + row_sum(x2 * x2, 1)) / (2 * HALF) + eps))[:, None]
    dt = x_ptr.dtype.element_ty
    w1 = tl.load(w_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    n1 = (w1 * (x1 * rs).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    n2 = (w2 * (x2 * rs).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    tl.store(p1, (n1 * cos - n2 * sin).to(dt), mask=mask)
    tl.store(p1 + HALF, (n2 * cos + n1 * sin).to(dt), mask=mask)


@triton.jit
def _qk_norm_rotary_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, pos_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt,
                           stride_kh, stride_cs, num_heads, num_kv_heads, eps, HALF: tl.constexpr,
                           HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, HALF_PAD)
    d_mask = offs_d < HALF
    cos = tl.load(cos_ptr + pos * stride_cs + offs_d, mask=d_mask, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cs + offs_d, mask=d_mask, other=0.0)[None, :]
    _norm_rotate(q_ptr + t * stride_qt, qw_ptr, cos, sin, stride_qh, num_heads, eps, HALF, HEADS_PAD, HALF_PAD)
    _norm_rotate(k_ptr + t * stride_kt, kw_ptr, cos, sin, stride_kh, num_kv_heads, eps, HALF, KV_HEADS_PAD, HALF_PAD)


def qk_norm_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                   k_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """rotary(positions, rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)) IN PLACE in one launch: q [T, h, d]
    and k [T, kvh, d] (strided views of the qkv projection, say); cos/sin: [max_pos, d/2] fp32. Returns (q, k)."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    t, heads, d = q.shape
    kv_heads = k.shape[1]
    if t:
        _qk_norm_rotary_kernel[(t,)](
            q, k, q_weight, k_weight, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            cos.stride(0), heads, kv_heads, eps, HALF=d // 2, HEADS_PAD=triton.next_power_of_2(heads),
            KV_HEADS_PAD=triton.next_power_of_2(kv_heads), HALF_PAD=triton.next_power_of_2(d // 2), num_warps=4)
    return q, k


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_xt, stride_ot, inter, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + t * stride_xt + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_xt + inter + offs, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + t * stride_ot + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2 * inter] -> silu(x[:, :inter]) * x[:, inter:]."""
    t, two_inter = x.shape
    inter = two_inter // 2
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((t, inter), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(inter))
    if t:
        _silu_and_mul_kernel[(t, triton.cdiv(inter, block))](x, out, x.stride(0), out.stride(0), inter, BLOCK=block,
                                                              num_warps=4)
    return out
