"""Torch reference twins of the attention kernels; also the "torch" attention backend (the CPU path).

Cache layout, per layer: k_cache / v_cache of shape [num_blocks, block_size, num_kv_heads, head_dim].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvgate.kernels.metadata import AttentionMetadata


def store_plan(slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the slots to write, the rows of k/v that have one: None for all); slots < 0 are padding."""
    keep = slot_mapping >= 0
    if bool(keep.all()):
        return slot_mapping, None
    rows = keep.nonzero().squeeze(1)
    return slot_mapping[rows], rows


def store_kvcache_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, plan: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> None:
    """Write k/v [num_tokens, kv_heads, head_dim] into their slots; slots < 0 are padding and skipped. `plan`:
    store_plan(slot_mapping), where the caller made it once for all layers."""
    num_blocks, block_size = k_cache.shape[:2]
    slots, rows = store_plan(slot_mapping) if plan is None else plan
    if rows is not None:
        k, v = k[rows], v[rows]
    k_cache.view(num_blocks * block_size, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(num_blocks * block_size, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached tokens of one sequence: [length, kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    return cache.index_select(0, block_table[:num_blocks].long()).flatten(0, 1)[:length]


def decode_plan(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, max_len: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """What a decode batch gathers, the same in every layer: the flat block ids ([seqs * blocks], each row as long
    as the longest sequence's) and the keys' mask [seqs, 1, 1, blocks * block_size] (False: past the sequence)."""
    table = block_tables[:, : (max_len + block_size - 1) // block_size].long()
    valid = torch.arange(table.shape[1] * block_size, device=table.device)[None, :] < seq_lens[:, None]
    return table.reshape(-1), valid[:, None, None, :]


def paged_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, max_seq_len: int | None = None,
                     plan: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One query token per sequence. q: [num_seqs, heads, head_dim] -> [num_seqs, heads, head_dim]. `plan`:
    decode_plan(...), where the caller made it once for all layers."""
    if plan is None:
        max_len = int(seq_lens.max()) if max_seq_len is None else max_seq_len
        plan = decode_plan(block_tables, seq_lens, k_cache.shape[1], max_len)
    blocks, valid = plan
    num_seqs, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    shape = (num_seqs, -1, kv_heads, head_dim)
    # index_select, not advanced indexing: several times faster on CPU
    k = k_cache.index_select(0, blocks).view(shape).transpose(1, 2)  # [seqs, kv_heads, len, head_dim]
    v = v_cache.index_select(0, blocks).view(shape).transpose(1, 2)
    # the query heads that share a KV head attend as one group of queries ([seqs, kv_heads, group, head_dim]), not
    # through enable_gqa: each KV head is then read once, not once per query head (on CPU in bfloat16, ~5x faster)
    grouped = q.view(num_seqs, kv_heads, num_heads // kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped, k.to(q.dtype), v.to(q.dtype), attn_mask=valid, scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)


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
    nd = md.num_decodes
    plans = md.scratch.get("torch")
    if plans is None:  # the first layer of the step
        decode = None
        if nd:
            max_len = max(md.seq_lens_cpu[:nd]) if md.seq_lens_cpu else int(md.seq_lens[:nd].max())
            decode = decode_plan(md.block_tables[:nd], md.seq_lens[:nd], k_cache.shape[1], max_len)
        plans = md.scratch["torch"] = (store_plan(md.slot_mapping), decode)
    store_kvcache_ref(k, v, k_cache, v_cache, md.slot_mapping, plans[0])
    out = torch.empty_like(q)
    if nd:
        out[:nd] = paged_decode_ref(q[:nd], k_cache, v_cache, md.block_tables[:nd], md.seq_lens[:nd], scale,
                                    plan=plans[1])
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
