"""kvgate's inference engine: paged KV cache, continuous batching, prefix caching, priorities."""
from kvgate.engine.config import EngineArgs, EngineConfig
from kvgate.engine.llm import LLM
from kvgate.engine.llm_engine import LLMEngine
from kvgate.engine.memory_monitor import MemoryMonitor
from kvgate.engine.outputs import CompletionOutput, Logprob, RequestOutput
from kvgate.engine.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["EngineArgs", "EngineConfig", "LLM", "LLMEngine", "MemoryMonitor", "CompletionOutput", "Logprob",
           "RequestOutput", "RequestOutputKind", "SamplingParams"]
