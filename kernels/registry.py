"""The attention-backend registry: the engine option `attention_backend` names one of these.

A backend is a callable `fn(q, k, v, k_cache, v_cache, metadata, scale) -> out` that stores the new K/V in
the paged cache and returns the attention output (see kernels/torch_ref.py for the reference one).
The built-in "triton" backend is registered lazily: importing this module does not import triton, and the
name is listed only where triton can be imported.
"""
from __future__ import annotations

import importlib
import os
from typing import Callable

import torch

AttentionFn = Callable[..., torch.Tensor]


class _LazyBackend:
    """A backend imported on first use: `module.attr`, available only where `requires` can be imported."""

    def __init__(self, module: str, attr: str, requires: str) -> None:
        self.module, self.attr, self.requires = module, attr, requires
        self._available: bool | None = None

    def available(self) -> bool:
        if self._available is None:
            try:
                importlib.import_module(self.requires)
                self._available = True
            except Exception:  # not installed, or broken (no GPU driver is needed to import triton)
                self._available = False
        return self._available

    def load(self) -> AttentionFn:
        return getattr(importlib.import_module(self.module), self.attr)


_REGISTRY: dict[str, AttentionFn | str | _LazyBackend] = {}


def register_kernel(name: str, fn_or_path: AttentionFn | str | os.PathLike) -> None:
    """Register an attention backend by name: a Python callable, or the path of a compiled extension
    (loaded with torch.ops.load_library) that defines the op `torch.ops.kvgate.<name>`."""
    if not name or not isinstance(name, str):
        raise ValueError("a kernel needs a non-empty string name")
    if callable(fn_or_path):
        _REGISTRY[name] = fn_or_path
        return
    path = os.fspath(fn_or_path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"kernel library for {name!r} not found: {path}")
    _REGISTRY[name] = path


def registered_kernels() -> list[str]:
    return sorted(n for n, e in _REGISTRY.items() if not isinstance(e, _LazyBackend) or e.available())


def get_attention_backend(name: str) -> AttentionFn:
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention_backend {name!r}; registered: {', '.join(registered_kernels())}")
    entry = _REGISTRY[name]
    if isinstance(entry, _LazyBackend):
        if not entry.available():
            raise ValueError(f"attention_backend {name!r} needs the {entry.requires!r} package, which cannot be "
                             f"imported here; registered: {', '.join(registered_kernels())}")
        entry = _REGISTRY[name] = entry.load()
    elif isinstance(entry, str):  # a compiled extension: load it once, then resolve its op
        torch.ops.load_library(entry)
        try:
            entry = getattr(torch.ops.kvgate, name)
        except (AttributeError, RuntimeError) as e:
            raise ValueError(f"library {entry} does not define the op torch.ops.kvgate.{name}") from e
        _REGISTRY[name] = entry
    return entry


def _register_builtins() -> None:
    from kvgate.kernels.torch_ref import torch_attention_backend

    register_kernel("torch", torch_attention_backend)
    _REGISTRY["triton"] = _LazyBackend("kvgate.kernels.triton_attention", "triton_attention_backend", "triton")


_register_builtins()
