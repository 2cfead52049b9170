"""The per-step context that attention layers read: metadata and backend, set by the model runner."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from kvgate.kernels.metadata import AttentionMetadata
from kvgate.kernels.registry import AttentionFn


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata
    attention_fn: AttentionFn


_CONTEXT: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError("attention called outside a model step (no forward context set)")
    return _CONTEXT


@contextmanager
def forward_context(metadata: AttentionMetadata, attention_fn: AttentionFn) -> Iterator[None]:
    global _CONTEXT
    prev, _CONTEXT = _CONTEXT, ForwardContext(metadata, attention_fn)
    try:
        yield
    finally:
        _CONTEXT = prev
