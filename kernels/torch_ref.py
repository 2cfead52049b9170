"""Torch reference twins of the attention kernels; also the "torch" attention backend (the CPU path).

Cache layout, per layer: k_cache / v_cache of shape [num_blocks, block_size, num_kv_heads, head_dim].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvgate.kernels.metadata import AttentionMetadata


def store_kvcache_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write k/v [num_tokens, kv_heads, head_dim] into their slots; slots < 0 are padding and skipped."""
    num_blocks, block_size = k_cache.shape[:2]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_cache.view(num_blocks * block_size, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(num_blocks * block_size, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached tokens of one sequence: [length, kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    return cache.index_select(0, block_table[:num_blocks].long()).flatten(0, 1)[:length]


def paged_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, max_seq_len: int | None = None) -> torch.Tensor:
    """One query token per sequence. q: [num_seqs, heads, head_dim] -> [num_seqs, heads, head_dim]."""
    block_size = k_cache.shape[1]
    max_len = int(seq_lens.max()) if max_seq_len is None else max_seq_len
    table = block_tables[:, : (max_len + block_size - 1) // block_size].long()
    shape = (table.shape[0], table.shape[1] * block_size, *k_cache.shape[2:])
    # index_select, not advanced indexing: several times faster on CPU
    k = k_cache.index_select(0, table.reshape(-1)).view(shape).transpose(1, 2)  # [seqs, kv_heads, len, head_dim]
    v = v_cache.index_select(0, table.reshape(-1)).view(shape).transpose(1, 2)
    valid = torch.arange(k.shape[2], device=q.device)[None, :] < seq_lens[:, None]
    out = F.scaled_dot_product_attention(q[:, :, None, :], k.to(q.dtype), v.to(q.dtype),
                                         attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=True)
    return out[:, :, 0, :]


def paged_prefill_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      query_start_loc: list[int], seq_lens: list[int], scale: float) -> torch.Tensor:
    """Varlen prefill/extend: each sequence's new tokens attend causally to themselves and fully to their
    cached prefix. q: [num_tokens, heads, head_dim] (the K/V of these tokens are already in the cache)."""
    out = torch.empty_like(q)
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        k = gather_kv(k_cache, block_tables[i], seq_len)
        v = gather_kv(v_cache, block_tables[i], seq_len)
        out[start:end] = _causal_attention(q[start:end], k, v, scale)
    return out


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [q_len, h, d], k/v: [kv_len, kvh, d] with the queries at the last q_len positions."""
    q_len, kv_len = q.shape[0], k.shape[0]
    # 4-D (a batch of one): with 3-D inputs torch takes its math path on the CPU, ~3-4x slower than its flash kernel
    qt, kt, vt = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if q_len == kv_len:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
    else:
        rows = torch.arange(q_len, device=q.device)[:, None] + (kv_len - q_len)
        mask = torch.arange(kv_len, device=q.device)[None, :] <= rows
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def torch_attention_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, md: AttentionMetadata, scale: float) -> torch.Tensor:
    """Store the new K/V, then attend. q: [T, h, d], k/v: [T, kvh, d] -> [T, h, d]."""
    store_kvcache_ref(k, v, k_cache, v_cache, md.slot_mapping)
    nd = md.num_decodes
    out = torch.empty_like(q)
    if nd:
        max_len = max(md.seq_lens_cpu[:nd]) if md.seq_lens_cpu else None
        out[:nd] = paged_decode_ref(q[:nd], k_cache, v_cache, md.block_tables[:nd], md.seq_lens[:nd], scale, max_len)
    if nd < md.num_seqs:
        qsl = md.query_start_loc_cpu or md.query_start_loc.tolist()
        lens = md.seq_lens_cpu or md.seq_lens.tolist()
        for i in range(nd, md.num_seqs):
            start, end, seq_len = qsl[i], qsl[i + 1], lens[i]
            if end - start == seq_len:  # nothing cached before: attend over the fresh K/V directly
                ks, vs = k[start:end], v[start:end]
            else:
                ks = gather_kv(k_cache, md.block_tables[i], seq_len)
                vs = gather_kv(v_cache, md.block_tables[i], seq_len)
            out[start:end] = _causal_attention(q[start:end], ks, vs, scale)
    return out
