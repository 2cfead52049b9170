"""The per-step context that attention layers read: metadata and backend, set by the model runner.

Thread-local: several engines in one process (two models, replicas) each step on their own thread, and one
engine's step must never see another's metadata.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from kvgate.kernels.metadata import AttentionMetadata
from kvgate.kernels.registry import AttentionFn


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata
    attention_fn: AttentionFn


_LOCAL = threading.local()


def get_forward_context() -> ForwardContext:
    ctx = getattr(_LOCAL, "context", None)
    if ctx is None:
        raise RuntimeError("attention called outside a model step (no forward context set)")
    return ctx


@contextmanager
def forward_context(metadata: AttentionMetadata, attention_fn: AttentionFn) -> Iterator[None]:
    prev = getattr(_LOCAL, "context", None)
    _LOCAL.context = ForwardContext(metadata, attention_fn)
    try:
        yield
    finally:
        _LOCAL.context = prev
