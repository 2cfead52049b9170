"""EngineConfig: what the engine runs with, resolved from EngineArgs (engine/arg_utils.py) and the model."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from kvgate.engine.arg_utils import ArgError, EngineArgs
from kvgate.engine.generation_config import load_generation_defaults
from kvgate.engine.models.model_config import ModelConfig
from kvgate.engine.pooling_params import PoolerConfig, has_sentence_transformers_pooling

_TORCH_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
                 "float16": torch.float16, "half": torch.float16}
__all__ = ["EngineArgs", "EngineConfig", "resolve_model", "check_engine_args"]


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
    async_scheduling: bool = False  # resolved: the argument, else on for a generate runner on one CUDA device

    default_sampling_params: dict[str, Any] = field(default_factory=dict)  # from generation_config
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_args(cls, a: EngineArgs, convert_default_model: bool = True) -> "EngineConfig":
        """Check every argument (ArgError names the one at fault and its limit), then resolve them against the
        model's config (read, its weights not). convert_default_model=False: read the default model's config
        from its GGUF when it is not converted yet (a check before anything loads)."""
        a.check()
        model_path, load_format = resolve_model(a.model, a.load_format, convert_default_model)
        if load_format == "gguf":
            from kvgate.engine.models.gguf import read_gguf_config

            model_config = ModelConfig.from_hf_dict(read_gguf_config(model_path))
        else:
            model_config = ModelConfig.from_dir(model_path)
        runner = a.runner
        if runner == "auto":  # a checkpoint without an LM head, or a sentence-transformers one, is an embedding model
            pooling = not model_config.has_lm_head or (
                os.path.isdir(model_path) and has_sentence_transformers_pooling(model_path))
            runner = "pooling" if pooling else "generate"
        if runner == "generate" and not model_config.has_lm_head:
            raise ArgError("runner", f"generate needs an LM head, and {model_config.architecture} has none (an "
                                     f"embedding model): use runner pooling")
        pooler = PoolerConfig.from_model(model_path, a.pooler_config) if runner == "pooling" else None
        device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device)
        dtype = (torch.bfloat16 if device.type == "cuda" else torch.float32) if a.dtype == "auto" \
            else _TORCH_DTYPES[a.dtype]
        kv_dtype = dtype if a.kv_cache_dtype == "auto" else _TORCH_DTYPES[a.kv_cache_dtype]
        limit = model_config.max_position_embeddings
        if model_config.sliding_window:
            limit = min(limit, model_config.sliding_window)  # full attention == sliding attention up to the window
        max_model_len = a.max_model_len or limit
        if max_model_len > limit:
            raise ArgError("max_model_len", f"must be in [2, {limit}] for this model, got {max_model_len}")
        max_num_seqs = a.num_seqs
        if a.max_num_batched_tokens is not None:
            budget = a.max_num_batched_tokens
        elif a.enable_chunked_prefill:  # vLLM's online defaults: a burst of prompts is prefilled in fewer steps on GPU
            budget = max(8192 if device.type == "cuda" else 2048, max_num_seqs)
        else:
            budget = max(max_model_len, max_num_seqs)
        if not a.enable_chunked_prefill and budget < max_model_len:
            raise ArgError("max_num_batched_tokens", f"must be >= max_model_len ({max_model_len}) without chunked "
                                                     f"prefill, got {budget}")
        backend = a.attention_backend or ("triton" if device.type == "cuda" and _has_triton_backend() else "torch")
        if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ArgError("attention_backend", f"triton needs a CUDA device, and this engine runs on {device}: "
                                                "use torch")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ArgError("device", f"is {a.device}, but torch sees no CUDA device here")
        _check_tensor_parallel(a, model_config, device)
        _check_offloading(a, model_config, kv_dtype)
        name = a.served_model_name or _default_name(a.model, model_path)
        defaults = load_generation_defaults(a.generation_config, model_path) if runner == "generate" else {}
        one_rank = a.tensor_parallel_size * a.pipeline_parallel_size == 1
        overlap = a.async_scheduling if a.async_scheduling is not None else device.type == "cuda" and one_rank
        return cls(args=a, model_path=model_path, load_format=load_format, model_config=model_config, dtype=dtype,
                   kv_cache_dtype=kv_dtype, device=device, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                   max_num_batched_tokens=budget, attention_backend=backend, served_model_name=name,
                   runner=runner, pooler_config=pooler, default_sampling_params=defaults,
                   async_scheduling=runner == "generate" and overlap)


def check_engine_args(a: EngineArgs) -> None:
    """Everything EngineConfig.from_args refuses, found without loading or converting anything."""
    EngineConfig.from_args(a, convert_default_model=False)


def _check_tensor_parallel(a: EngineArgs, mc: ModelConfig, device: torch.device) -> None:
    """The model's heads and MLP must split evenly over tensor_parallel_size ranks (KV heads may also be
    replicated: TP a multiple of them), every pipeline stage needs a layer, and on CUDA each rank a GPU."""
    tp, pp = a.tensor_parallel_size, a.pipeline_parallel_size
    if pp > mc.num_hidden_layers:
        raise ArgError("pipeline_parallel_size", f"must be at most the {mc.num_hidden_layers} layers of "
                                                 f"{mc.architecture}, got {pp}")
    if pp > 1:  # KVGATE_PP_LAYER_PARTITION, if set, must fit this model and pp: refused here, before any rank starts
        from kvgate.engine.models.llama import stage_layers

        try:
            stage_layers(mc.num_hidden_layers, pp, 0)
        except ValueError as e:
            raise ArgError("pipeline_parallel_size", f"{pp}, KVGATE_PP_LAYER_PARTITION: {e}") from None
    if tp * pp == 1:
        return
    problems = []
    if mc.num_attention_heads % tp:
        problems.append(f"the {mc.num_attention_heads} attention heads")
    if mc.num_key_value_heads % tp and tp % mc.num_key_value_heads:
        problems.append(f"the {mc.num_key_value_heads} KV heads (or be a multiple of them)")
    if mc.intermediate_size % tp:
        problems.append(f"the MLP width {mc.intermediate_size}")
    if problems:
        raise ArgError("tensor_parallel_size", f"must divide {', '.join(problems)} of {mc.architecture}, got {tp}")
    if device.type == "cuda" and a.executor_backend == "mp":
        have = torch.cuda.device_count() - (device.index or 0)
        if tp * pp > have:
            raise ArgError("tensor_parallel_size", f"x pipeline_parallel_size needs {tp * pp} GPUs from {device} on, "
                                                   f"and this host has {have}")


def _check_offloading(a: EngineArgs, mc: ModelConfig, kv_dtype: torch.dtype) -> None:
    """The offload tier must hold at least one KV block of this model (of every rank: KV heads replicated past
    tensor_parallel_size count again)."""
    if a.kv_offloading_disk_size > 0 and a.kv_offloading_disk_dir is None:
        raise ArgError("kv_offloading_disk_size", "needs kv_offloading_disk_dir (where the disk tier's files go)")
    if a.kv_offloading_disk_dir is not None and a.kv_offloading_size <= 0:
        raise ArgError("kv_offloading_disk_dir", "needs kv_offloading_size > 0: the disk tier sits below the CPU "
                                                 "tier, whose evicted blocks it takes")
    if a.kv_offloading_size <= 0 or not a.enable_prefix_caching:
        return
    heads = max(mc.num_key_value_heads, a.tensor_parallel_size)
    elem = torch.empty(0, dtype=kv_dtype).element_size()
    block = 2 * mc.num_hidden_layers * a.block_size * heads * mc.head_dim * elem
    tiers = ["kv_offloading_size"] + (["kv_offloading_disk_size"] if a.kv_offloading_disk_dir is not None else [])
    for name in tiers:
        if getattr(a, name) * (1 << 30) < block:
            raise ArgError(name, f"must hold at least one KV block of {mc.architecture} ({block} bytes with "
                                 f"block_size {a.block_size}), got {getattr(a, name)} GiB")
    if a.kv_offloading_disk_dir is not None:
        _check_disk_dir(a.kv_offloading_disk_dir)


def _check_disk_dir(path: str) -> None:
    """The disk tier's directory must be a directory this process can write (made if missing)."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ArgError("kv_offloading_disk_dir", f"must be a directory that can be made or written, got {path!r} "
                                                 f"({e.strerror})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ArgError("kv_offloading_disk_dir", f"must be a directory this process can write, got {path!r}")


def _has_triton_backend() -> bool:
    from kvgate.kernels.registry import registered_kernels

    return "triton" in registered_kernels()


def _default_name(model: str | None, path: str) -> str:
    from kvgate.engine.models.gguf import DEFAULT_MODEL_NAME

    if model in (None, DEFAULT_MODEL_NAME):
        return DEFAULT_MODEL_NAME
    base = os.path.basename(os.path.normpath(path))
    return base[:-5] if base.endswith(".gguf") else base


def resolve_model(model: str | None, load_format: str, convert_default_model: bool = True) -> tuple[str, str]:
    """(local path, load format) for a model argument; a clear FileNotFoundError for anything else. The default
    model is converted from its GGUF on first use, unless convert_default_model is False: then, until it is
    converted, its GGUF file stands in (the same config)."""
    from kvgate.engine.models.gguf import DEFAULT_MODEL_NAME, default_converted_path, default_gguf_path, \
        default_model_path

    if model in (None, DEFAULT_MODEL_NAME):
        if not convert_default_model and default_converted_path() is None:
            return default_gguf_path(), "gguf"
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
