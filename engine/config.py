"""EngineArgs (vLLM's names) and the resolved EngineConfig the engine runs with."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from kvgate.engine.models.model_config import ModelConfig
from kvgate.engine.pooling_params import PoolerConfig, has_sentence_transformers_pooling

_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


@dataclass
class EngineArgs:
    model: str | None = None  # local HF dir, .gguf file, or None / "SmolLM2-135M-Instruct" for the default
    tokenizer: str | None = None
    load_format: str = "auto"
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    seed: int = 0
    device: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None  # the KV budget on CPU (default 1 GiB) or an explicit GPU budget
    num_gpu_blocks_override: int | None = None
    kv_cache_dtype: str = "auto"
    max_num_seqs: int = 256
    max_batch_size: int | None = None  # alias of max_num_seqs
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    enable_preemption: bool = True
    scheduler_delay: float = 0.0  # seconds a new prefill may be held to batch it with others
    priority_aging_rate: float = 2.0  # priority points a waiting request gains per second
    max_logprobs: int = 20
    attention_backend: str | None = None  # "torch" on CPU; a registered name
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enforce_eager: bool = False
    skip_tokenizer_init: bool = False
    engine_core_process: bool | None = None  # async engine: the engine loop in its own process (None: on CUDA)
    served_model_name: str | None = None
    runner: str = "auto"  # "generate" | "pooling" (embeddings); auto: pooling for *Model / sentence-transformers dirs
    pooler_config: dict | None = None  # {"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": bool}

    def create_engine_config(self) -> "EngineConfig":
        return EngineConfig.from_args(self)


@dataclass
class EngineConfig:
    args: EngineArgs
    model_path: str
    load_format: str
    model_config: ModelConfig
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    device: torch.device
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    attention_backend: str
    served_model_name: str
    runner: str = "generate"
    pooler_config: PoolerConfig | None = None  # set when runner == "pooling"
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_args(cls, a: EngineArgs) -> "EngineConfig":
        def bad(msg: str) -> None:
            raise ValueError(msg)

        if a.tensor_parallel_size != 1 or a.pipeline_parallel_size != 1:
            raise NotImplementedError("tensor_parallel_size/pipeline_parallel_size > 1 are not supported yet; use 1")
        if a.block_size not in (16, 32, 64):
            bad(f"block_size must be 16, 32 or 64, got {a.block_size}")
        if a.load_format not in LOAD_FORMATS:
            bad(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {a.load_format!r}")
        if not 0.0 < a.gpu_memory_utilization <= 1.0:
            bad(f"gpu_memory_utilization must be in (0, 1], got {a.gpu_memory_utilization}")
        if a.scheduler_delay < 0:
            bad(f"scheduler_delay must be >= 0 seconds, got {a.scheduler_delay}")
        max_num_seqs = a.max_batch_size if a.max_batch_size is not None else a.max_num_seqs
        if max_num_seqs < 1:
            bad(f"max_num_seqs (max_batch_size) must be >= 1, got {max_num_seqs}")
        model_path, load_format = resolve_model(a.model, a.load_format)
        if load_format == "gguf":
            from kvgate.engine.models.gguf import read_gguf_config

            model_config = ModelConfig.from_hf_dict(read_gguf_config(model_path))
        else:
            model_config = ModelConfig.from_dir(model_path)
        runner = a.runner
        if runner == "auto":  # a checkpoint without an LM head, or a sentence-transformers one, is an embedding model
            pooling = model_config.architecture.endswith("Model") or (
                os.path.isdir(model_path) and has_sentence_transformers_pooling(model_path))
            runner = "pooling" if pooling else "generate"
        elif runner not in ("generate", "pooling"):
            bad(f"runner must be one of auto, generate, pooling; got {runner!r}")
        pooler = PoolerConfig.from_model(model_path, a.pooler_config) if runner == "pooling" else None
        device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device)
        if a.dtype == "auto":
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        elif a.dtype in _DTYPES:
            dtype = _DTYPES[a.dtype]
        else:
            raise ValueError(f"dtype must be auto, {', '.join(_DTYPES)}; got {a.dtype!r}")
        if a.kv_cache_dtype == "auto":
            kv_dtype = dtype
        elif a.kv_cache_dtype in _DTYPES:
            kv_dtype = _DTYPES[a.kv_cache_dtype]
        else:
            raise ValueError(f"kv_cache_dtype must be auto or one of {', '.join(_DTYPES)}; got {a.kv_cache_dtype!r}")
        limit = model_config.max_position_embeddings
        if model_config.sliding_window:
            limit = min(limit, model_config.sliding_window)  # full attention == sliding attention up to the window
        max_model_len = a.max_model_len or limit
        if not 1 < max_model_len <= limit:
            bad(f"max_model_len must be in [2, {limit}] for this model, got {max_model_len}")
        if a.max_num_batched_tokens is not None:
            budget = a.max_num_batched_tokens
        elif a.enable_chunked_prefill:  # vLLM's online defaults: a burst of prompts is prefilled in fewer steps on GPU
            budget = max(8192 if device.type == "cuda" else 2048, max_num_seqs)
        else:
            budget = max(max_model_len, max_num_seqs)
        if not a.enable_chunked_prefill and budget < max_model_len:
            bad(f"without chunked prefill max_num_batched_tokens ({budget}) must be >= max_model_len ({max_model_len})")
        if budget < 1:
            bad(f"max_num_batched_tokens must be >= 1, got {budget}")
        backend = a.attention_backend or ("triton" if device.type == "cuda" and _has_triton_backend() else "torch")
        name = a.served_model_name or _default_name(a.model, model_path)
        return cls(args=a, model_path=model_path, load_format=load_format, model_config=model_config, dtype=dtype,
                   kv_cache_dtype=kv_dtype, device=device, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                   max_num_batched_tokens=budget, attention_backend=backend, served_model_name=name,
                   runner=runner, pooler_config=pooler)


def _has_triton_backend() -> bool:
    from kvgate.kernels.registry import registered_kernels

    return "triton" in registered_kernels()


def _default_name(model: str | None, path: str) -> str:
    from kvgate.engine.models.gguf import DEFAULT_MODEL_NAME

    if model in (None, DEFAULT_MODEL_NAME):
        return DEFAULT_MODEL_NAME
    base = os.path.basename(os.path.normpath(path))
    return base[:-5] if base.endswith(".gguf") else base


def resolve_model(model: str | None, load_format: str) -> tuple[str, str]:
    """(local path, load format) for a model argument; a clear FileNotFoundError for anything else."""
    from kvgate.engine.models.gguf import DEFAULT_MODEL_NAME, default_model_path

    if model in (None, DEFAULT_MODEL_NAME):
        path = default_model_path()
        return path, "safetensors" if load_format == "auto" else load_format
    path = os.path.expanduser(model)
    if os.path.isfile(path) and (path.endswith(".gguf") or load_format == "gguf"):
        return path, "gguf"
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        return path, "safetensors" if load_format in ("auto", "gguf") else load_format
    raise FileNotFoundError(
        f"model not found: {model!r} (expected a local Hugging Face directory with config.json, a .gguf file, "
        f"or {DEFAULT_MODEL_NAME!r} for the default model; no model hub is reached)")
