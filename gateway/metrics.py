"""Prometheus text exposition with vLLM's metric names (label model_name), plus kvgate's own."""
from __future__ import annotations

from typing import Any


def _line(name: str, model: str, value: float) -> str:
    return f'{name}{{model_name="{model}"}} {value}'


def render_metrics(servings: dict[str, Any], now: float) -> str:
    gauges = {
        "vllm:num_requests_running": "Requests whose sequences are in the running batch.",
        "vllm:num_requests_waiting": "Requests waiting to be scheduled.",
        "vllm:kv_cache_usage_perc": "Share of KV-cache blocks in use (0-1).",
        "kvgate:kv_cache_free_blocks": "Free KV-cache blocks (cached-free included).",
    }
    counters = {
        "vllm:prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
        "vllm:prefix_cache_hits": "Prompt tokens found in the prefix cache.",
        "vllm:num_preemptions": "Sequences preempted (recompute).",
        "vllm:prompt_tokens": "Prompt tokens received.",
        "vllm:generation_tokens": "Tokens generated.",
        "kvgate:engine_steps": "Engine steps run.",
    }
    values: dict[str, list[tuple[str, float]]] = {n: [] for n in (*gauges, *counters)}
    for name, s in servings.items():
        e = s.engine.engine if s.engine.is_ready else None
        if e is None:
            continue
        bm, sched = e.block_manager, e.scheduler
        used = sum(1 for b in bm.blocks if b.ref_count > 0)
        running = {q.request.request_id for q in sched.running}
        values["vllm:num_requests_running"].append((name, len(running)))
        values["vllm:num_requests_waiting"].append((name, len({q.request.request_id for q in sched.waiting}
                                                               - running)))
        values["vllm:kv_cache_usage_perc"].append((name, used / bm.num_blocks))
        values["kvgate:kv_cache_free_blocks"].append((name, bm.num_free_blocks))
        values["vllm:prefix_cache_queries"].append((name, bm.prefix_cache_queries))
        values["vllm:prefix_cache_hits"].append((name, bm.prefix_cache_hits))
        values["vllm:num_preemptions"].append((name, sched.num_preemptions))
        values["vllm:prompt_tokens"].append((name, e.num_prompt_tokens))
        values["vllm:generation_tokens"].append((name, e.num_generation_tokens))
        values["kvgate:engine_steps"].append((name, e.num_steps))
    lines: list[str] = []
    for name, help_text in gauges.items():
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
        lines += [_line(name, m, v) for m, v in values[name]]
    for name, help_text in counters.items():
        lines += [f"# HELP {name}_total {help_text}", f"# TYPE {name}_total counter"]
        lines += [_line(f"{name}_total", m, v) for m, v in values[name]]
    return "\n".join(lines) + "\n"
