"""The "triton" attention backend (the GPU path): the Triton twin of torch_attention_backend.

It stores the new K/V (kernels/triton_store.py), then runs the split-K paged decode kernel on the first
md.num_decodes sequences (kernels/triton_decode.py) and the varlen paged prefill kernel on the rest
(kernels/triton_prefill.py). Importing this module imports triton; the registry loads it lazily.

CPU tests run these kernels in Triton's interpreter: @triton.jit picks compiled or interpreted when our
modules are imported, so TRITON_INTERPRET=1 must be set before the first import of kvgate.kernels.triton_*
(triton itself may be imported earlier: the kernels use only triton.language builtins, see triton_decode).
"""
from __future__ import annotations


import torch

from kvgate.kernels.metadata import AttentionMetadata
from kvgate.kernels.triton_decode import interpreted, paged_decode
from kvgate.kernels.triton_prefill import paged_prefill
from kvgate.kernels.triton_store import store_kvcache

__all__ = ["interpreted", "paged_decode", "paged_prefill", "store_kvcache", "triton_attention_backend"]


def triton_attention_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, md: AttentionMetadata, scale: float) -> torch.Tensor:
    """Store the new K/V, then attend. q: [T, h, d], k/v: [T, kvh, d] -> [T, h, d]."""
    if q.device.type != "cuda" and not interpreted():
        raise RuntimeError(f"the triton attention backend needs CUDA tensors, got {q.device.type}; on the CPU it runs "
                           "only under TRITON_INTERPRET=1, set before kvgate.kernels.triton_* is first imported")
    store_kvcache(k, v, k_cache, v_cache, md.slot_mapping)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    nd = md.num_decodes
    if nd:
        max_len = max(md.seq_lens_cpu[:nd]) if md.seq_lens_cpu else md.max_seq_len
        paged_decode(q[:nd], k_cache, v_cache, md.block_tables[:nd], md.seq_lens[:nd], scale, max_len, out=out[:nd],
                     partition_size=md.decode_partition_size)
    if nd < md.num_seqs:
        paged_prefill(q, k, v, k_cache, v_cache, md.block_tables[nd:], md.query_start_loc[nd:], md.seq_lens[nd:],
                      md.max_query_len, scale, out=out)
    return out
