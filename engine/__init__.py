"""kvgate's inference engine: paged KV cache, continuous batching, prefix caching, priorities.

The public names load on first use (PEP 562), so that `kvgate --help`, which reads only engine/arg_utils.py,
does not import torch."""
from importlib import import_module
from typing import Any

_WHERE = {"EngineArgs": "arg_utils", "EngineConfig": "config", "LLM": "llm", "LLMEngine": "llm_engine",
          "MemoryMonitor": "memory_monitor", "CompletionOutput": "outputs", "Logprob": "outputs",
          "RequestOutput": "outputs", "RequestOutputKind": "sampling_params", "SamplingParams": "sampling_params",
          "PoolingOutput": "outputs", "PoolingRequestOutput": "outputs", "PoolingParams": "pooling_params"}
__all__ = list(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_WHERE[name]}"), name)
