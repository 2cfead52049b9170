"""Prometheus text exposition with vLLM's metric names (label model_name), plus kvgate's own.

Everything is read from each engine's EngineStats snapshot, which the engine thread replaces after every step:
the HTTP event loop never touches the scheduler or the block manager while a step mutates them."""
from __future__ import annotations

import json
from dataclasses import fields
from typing import Any

from kvgate.engine.stats import (E2E_REQUEST_LATENCY, INTER_TOKEN_LATENCY, ITERATION_TOKENS, REQUEST_QUEUE_TIME,
                                 TIME_TO_FIRST_TOKEN, EngineStats)

GAUGES = {
    "vllm:num_requests_running": ("Requests whose sequences are in the running batch.", "num_requests_running"),
    "vllm:num_requests_waiting": ("Requests waiting to be scheduled.", "num_requests_waiting"),
    "vllm:kv_cache_usage_perc": ("Share of KV-cache blocks in use (0-1).", "kv_cache_usage_perc"),
    "kvgate:kv_cache_free_blocks": ("Free KV-cache blocks (cached-free included).", "num_free_blocks"),
    "kvgate:kv_offload_cpu_blocks": ("KV blocks held in the CPU offload tier.", "offload_blocks"),
    "kvgate:kv_offload_cpu_capacity_blocks": ("KV blocks the CPU offload tier can hold (0: off).",
                                              "offload_capacity_blocks"),
    "kvgate:kv_offload_disk_blocks": ("KV blocks held in the disk offload tier.", "offload_disk_blocks"),
    "kvgate:kv_offload_disk_capacity_blocks": ("KV blocks the disk offload tier can hold (0: off).",
                                               "offload_disk_capacity_blocks"),
}
COUNTERS = {
    "vllm:prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
    "vllm:prefix_cache_hits": ("Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
    "vllm:num_preemptions": ("Sequences preempted (recompute).", "num_preemptions"),
    "vllm:prompt_tokens": ("Prompt tokens received.", "prompt_tokens"),
    "vllm:generation_tokens": ("Tokens generated.", "generation_tokens"),
    "kvgate:engine_steps": ("Engine steps run.", "num_steps"),
    "kvgate:engine_loop_busy_seconds": ("Seconds the engine loop spent in steps (scheduling, the forward pass and "
                                        "the wait for it, sampling, detokenizing, outputs).", "loop_busy_seconds"),
    "kvgate:engine_loop_emit_seconds": ("Seconds the engine loop spent handing outputs over (with an engine core "
                                        "process: pickling them into its pipe).", "loop_emit_seconds"),
    "kvgate:engine_loop_idle_seconds": ("Seconds the engine loop spent waiting for commands, or running them "
                                        "(adding requests, aborts).", "loop_idle_seconds"),
    "kvgate:kv_offload_cpu_queries": ("Prompt tokens looked up in the CPU offload tier (missed on the device).",
                                      "offload_queries"),
    "kvgate:kv_offload_cpu_hits": ("Prompt tokens found in the CPU offload tier and loaded back.", "offload_hits"),
    "kvgate:kv_offload_cpu_saved_bytes": ("Bytes of KV blocks copied into the CPU offload tier.",
                                          "offload_saved_bytes"),
    "kvgate:kv_offload_cpu_loaded_bytes": ("Bytes of KV blocks copied back from the CPU offload tier.",
                                           "offload_loaded_bytes"),
    "kvgate:kv_offload_disk_queries": ("Prompt tokens looked up in the disk offload tier (missed on the device and "
                                       "in CPU memory).", "offload_disk_queries"),
    "kvgate:kv_offload_disk_hits": ("Prompt tokens found in the disk offload tier and read back.", "offload_disk_hits"),
    "kvgate:kv_offload_disk_saved_bytes": ("Bytes of KV blocks written to the disk offload tier.",
                                           "offload_disk_saved_bytes"),
    "kvgate:kv_offload_disk_loaded_bytes": ("Bytes of KV blocks read back intact from the disk offload tier.",
                                            "offload_disk_loaded_bytes"),
}
HISTOGRAMS = {
    TIME_TO_FIRST_TOKEN: "Histogram of time to first token in seconds (arrival to the first token).",
    INTER_TOKEN_LATENCY: "Histogram of inter-token latency in seconds (between a request's successive steps).",
    E2E_REQUEST_LATENCY: "Histogram of e2e request latency in seconds (arrival to finish).",
    REQUEST_QUEUE_TIME: "Histogram of time spent waiting before a request is first scheduled, in seconds.",
    ITERATION_TOKENS: "Histogram of the number of tokens per engine step (prompt and decode).",
}


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(v: float) -> str:
    return "+Inf" if v == float("inf") else repr(float(v))


def config_labels(config: Any) -> dict[str, str]:
    """An engine's arguments as that engine runs with them: every EngineArgs field, with what the engine resolved
    in place of defaults ("auto" dtype, the model's max_model_len, the default token budget, ...)."""
    a = config.args
    values: dict[str, Any] = {f.name: getattr(a, f.name) for f in fields(a)}
    values.update(model=config.model_path, load_format=config.load_format, dtype=_dtype(config.dtype),
                  kv_cache_dtype=_dtype(config.kv_cache_dtype), device=str(config.device),
                  max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs, max_batch_size=None,
                  max_num_batched_tokens=config.max_num_batched_tokens, attention_backend=config.attention_backend,
                  served_model_name=config.served_model_name, runner=config.runner)
    return {k: json.dumps(v) if isinstance(v, dict) else "" if v is None else str(v) for k, v in values.items()}


def _dtype(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def render_metrics(servings: dict[str, Any], now: float) -> str:
    snaps: list[tuple[str, EngineStats]] = [(_label(name), s.engine.stats) for name, s in servings.items()
                                            if s.engine.is_ready and s.engine.stats is not None]
    lines: list[str] = []
    for name, (help_text, attr) in GAUGES.items():
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
        lines += [f'{name}{{model_name="{m}"}} {_number(getattr(st, attr))}' for m, st in snaps]
    for name, (help_text, attr) in COUNTERS.items():
        lines += [f"# HELP {name}_total {help_text}", f"# TYPE {name}_total counter"]
        lines += [f'{name}_total{{model_name="{m}"}} {_number(getattr(st, attr))}' for m, st in snaps]
    name = "vllm:request_success_total"
    lines += [f"# HELP {name} Count of finished requests, by finished_reason (stop, length, abort).",
              f"# TYPE {name} counter"]
    for m, st in snaps:
        lines += [f'{name}{{finished_reason="{_label(r)}",model_name="{m}"}} {_number(n)}'
                  for r, n in st.request_success.items()]
    for name, help_text in HISTOGRAMS.items():
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        for m, st in snaps:
            h = st.histograms[name]
            lines += [f'{name}_bucket{{le="{_number(le)}",model_name="{m}"}} {_number(n)}' for le, n in h.cumulative()]
            lines += [f'{name}_sum{{model_name="{m}"}} {_number(h.sum)}',
                      f'{name}_count{{model_name="{m}"}} {_number(h.count)}']
    name = "kvgate:engine_config_info"
    lines += [f"# HELP {name} The arguments each engine runs with (labels; the value is always 1).",
              f"# TYPE {name} gauge"]
    for m, s in servings.items():
        if s.engine.is_ready and s.engine.config is not None:
            labels = ",".join(f'{k}="{_label(v)}"' for k, v in sorted(config_labels(s.engine.config).items()))
            lines.append(f'{name}{{{labels},model_name="{_label(m)}"}} 1')
    name = "kvgate:engine_core_restarts"
    lines += [f"# HELP {name}_total Engine core processes that died and were restarted "
              "(on_engine_core_death restart).", f"# TYPE {name}_total counter"]
    lines += [f'{name}_total{{model_name="{_label(m)}"}} {_number(s.engine.num_restarts)}'
              for m, s in servings.items()]
    return "\n".join(lines) + "\n"
