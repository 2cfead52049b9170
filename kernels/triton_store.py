"""Triton KV-cache store: write this step's keys/values into their paged-cache slots (twin: store_kvcache_ref).

One program per new token copies its [num_kv_heads, head_dim] key and value rows into slot
`slot_mapping[t]` of k_cache / v_cache [num_blocks, block_size, num_kv_heads, head_dim]; a slot < 0 is
padding and the program writes nothing.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kvcache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    KVH_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token: nothing to store
        return
    offs_h = tl.arange(0, KVH_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    block = slot // BLOCK_SIZE
    within = slot % BLOCK_SIZE
    t64 = t.to(tl.int64)
    k = tl.load(k_ptr + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    kc = k_cache_ptr + block * stride_kcb + within * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
    vc = v_cache_ptr + block * stride_vcb + within * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]
    tl.store(kc, k, mask=mask)
    tl.store(vc, v, mask=mask)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Write k/v [num_tokens, kv_heads, head_dim] into their slots; slots < 0 are padding and skipped."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k_cache.shape[2:] != (num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not fit the cache {tuple(k_cache.shape)}")
    # a dtype change is done by torch: the interpreter cannot convert between fp16 and bf16 itself
    k = _last_dim_contiguous(k.to(k_cache.dtype))
    v = _last_dim_contiguous(v.to(v_cache.dtype))
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    _store_kvcache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1], NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        KVH_PAD=triton.next_power_of_2(num_kv_heads), D_PAD=triton.next_power_of_2(head_dim),
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )
