"""`kvgate monitor`: a live terminal view of one or several servers, read from their /metrics every interval.

  kvgate monitor                                   # http://127.0.0.1:8000, every figure, once a second
  kvgate monitor --url http://10.0.0.5:8000 --url http://10.0.0.6:8000 --metric cache_hit_rate --interval 2

One row per server and model: memory_usage (KV-cache use, free blocks, the CPU offload tier's blocks),
cache_hit_rate (prefix-cache and offload-tier hit rates over the last interval, and since start), throughput
(requests running and waiting, prompt and generated tokens per second over the last interval). It reads vLLM's
metric names, so it shows a vLLM server too (kvgate's own figures as "-")."""
from __future__ import annotations

import argparse
import re
import time
from dataclasses import dataclass, field
from typing import Any

METRICS = ("memory_usage", "cache_hit_rate", "throughput", "all")
COLUMNS = {
    "memory_usage": ("KV cache", "free blocks", "offload tier"),
    "cache_hit_rate": ("prefix hits", "prefix hits (all)", "tier hits", "tier hits (all)"),
    "throughput": ("running", "waiting", "prompt tok/s", "gen tok/s"),
}
SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)')


def parse_metrics(text: str) -> dict[str, dict[str, float]]:
    """Prometheus text -> {model_name: {metric: value}}, values summed over every other label."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m is None or line.startswith("#"):
            continue
        name, labels, value = m.groups()
        model = re.search(r'model_name="((?:[^"\\]|\\.)*)"', labels or "")
        if model is None:
            continue
        try:
            v = float(value)
        except ValueError:
            continue
        figures = out.setdefault(model.group(1), {})
        figures[name] = figures.get(name, 0.0) + v
    return out


@dataclass
class Reading:
    time: float
    models: dict[str, dict[str, float]] = field(default_factory=dict)
    error: str | None = None


def read(client: Any, url: str) -> Reading:
    try:
        r = client.get(f"{url.rstrip('/')}/metrics")
        r.raise_for_status()
        return Reading(time.monotonic(), parse_metrics(r.text))
    except Exception as e:  # noqa: BLE001 - shown in the row
        return Reading(time.monotonic(), error=f"unreachable ({type(e).__name__})")


def _ratio(num: float | None, den: float | None) -> str:
    return f"{num / den:.1%}" if num is not None and den else "-"


def _delta(name: str, now: dict[str, float], before: dict[str, float] | None) -> float | None:
    if before is None or name not in now or name not in before:
        return None
    return now[name] - before[name]


def row(model: str, now: dict[str, float], before: dict[str, float] | None, seconds: float) -> dict[str, str]:
    """Every column's text for one model, from two readings `seconds` apart (before None: the first reading)."""
    g = now.get
    usage = g("vllm:kv_cache_usage_perc", g("vllm:gpu_cache_usage_perc"))
    capacity = g("kvgate:kv_offload_cpu_capacity_blocks")
    tier = "-" if capacity is None else "off" if not capacity else \
        f"{g('kvgate:kv_offload_cpu_blocks', 0):.0f}/{capacity:.0f} blocks"
    free = g("kvgate:kv_cache_free_blocks")

    def rate(name: str) -> str:
        d = _delta(name, now, before)
        return "-" if d is None or seconds <= 0 else f"{d / seconds:,.1f}"

    hits, queries = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
    t_hits, t_queries = "kvgate:kv_offload_cpu_hits_total", "kvgate:kv_offload_cpu_queries_total"
    return {
        "KV cache": "-" if usage is None else f"{usage:.1%}",
        "free blocks": "-" if free is None else f"{free:,.0f}",
        "offload tier": tier,
        "prefix hits": _ratio(_delta(hits, now, before), _delta(queries, now, before)),
        "prefix hits (all)": _ratio(g(hits), g(queries)),
        "tier hits": _ratio(_delta(t_hits, now, before), _delta(t_queries, now, before)),
        "tier hits (all)": _ratio(g(t_hits), g(t_queries)),
        "running": f"{g('vllm:num_requests_running', 0):.0f}",
        "waiting": f"{g('vllm:num_requests_waiting', 0):.0f}",
        "prompt tok/s": rate("vllm:prompt_tokens_total"),
        "gen tok/s": rate("vllm:generation_tokens_total"),
    }


def table(urls: list[str], readings: dict[str, Reading], previous: dict[str, Reading], metric: str) -> Any:
    from rich.table import Table

    columns = [c for k, cols in COLUMNS.items() if metric in (k, "all") for c in cols]
    t = Table(title=f"kvgate monitor - {metric} - {time.strftime('%H:%M:%S')}")
    t.add_column("server", no_wrap=True, min_width=max(len(u) for u in urls))
    t.add_column("model", no_wrap=True)
    for c in columns:
        t.add_column(c, justify="right")
    for url in urls:
        now, before = readings[url], previous.get(url)
        if now.error is not None:
            t.add_row(url, now.error, *[""] * len(columns))
            continue
        if not now.models:
            t.add_row(url, "(no model metrics)", *[""] * len(columns))
        for model, figures in sorted(now.models.items()):
            prior = before.models.get(model) if before is not None and before.error is None else None
            cells = row(model, figures, prior, now.time - before.time if before is not None else 0.0)
            t.add_row(url, model, *[cells[c] for c in columns])
    return t


def cmd_monitor(args: argparse.Namespace) -> int:
    import httpx
    from rich.console import Console
    from rich.live import Live

    urls = args.url or ["http://127.0.0.1:8000"]
    console = Console()
    live = console.is_terminal and not args.iterations
    if not console.is_terminal:  # a log or a pipe: wide enough for every column
        console = Console(width=200)
    previous: dict[str, Reading] = {}
    with httpx.Client(timeout=max(1.0, args.interval)) as client:
        readings = {u: read(client, u) for u in urls}
        view = Live(table(urls, readings, previous, args.metric), console=console, auto_refresh=False) \
            if live else None
        if view is None:
            console.print(table(urls, readings, previous, args.metric))
        else:
            view.start()
        try:
            done = 1
            while not args.iterations or done < args.iterations:
                time.sleep(args.interval)
                previous, readings = readings, {u: read(client, u) for u in urls}
                done += 1
                t = table(urls, readings, previous, args.metric)
                if view is None:
                    console.print(t)
                else:
                    view.update(t, refresh=True)
        except KeyboardInterrupt:
            pass
        finally:
            if view is not None:
                view.stop()
    return 0


def register(sub: Any) -> None:
    m = sub.add_parser("monitor", help="a live terminal view of servers' KV memory, cache hit rates and throughput "
                                       "(from /metrics)")
    m.add_argument("--url", action="append", help="a server's base URL (repeatable; default http://127.0.0.1:8000)")
    m.add_argument("--metric", choices=METRICS, default="all", help="which figures (default: all)")
    m.add_argument("--interval", type=_positive, default=1.0, help="seconds between readings (default: 1)")
    m.add_argument("--iterations", type=int, default=0, help="readings to print, then exit (default: until Ctrl-C); "
                                                             "printed one table each when not on a terminal")
    m.set_defaults(func=cmd_monitor)


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value
