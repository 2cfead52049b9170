"""`kvgate monitor`: its reading of Prometheus text, and the command against a real `kvgate serve` (with the KV
offload tier) while a stream runs, next to a URL where nothing answers."""
from __future__ import annotations

import re
import subprocess
import threading
from pathlib import Path

import httpx

from kvgate.gateway.monitor import parse_metrics, row
from serve_helpers import CLI, free_port, serve


def test_metrics_are_read_per_model_summed_over_other_labels() -> None:
    text = """# HELP vllm:request_success_total Finished requests.
vllm:request_success_total{finished_reason="stop",model_name="a"} 2.0
vllm:request_success_total{finished_reason="length",model_name="a"} 3.0
vllm:num_requests_running{model_name="b \\"x\\""} 4.0
kvgate:router_requests_total{deployment="d"} 9.0
"""
    assert parse_metrics(text) == {"a": {"vllm:request_success_total": 5.0},
                                   'b \\"x\\"': {"vllm:num_requests_running": 4.0}}


def test_rates_come_from_two_readings_and_missing_figures_show_as_dashes() -> None:
    before = {"vllm:generation_tokens_total": 100.0, "vllm:prefix_cache_hits_total": 10.0,
              "vllm:prefix_cache_queries_total": 40.0}
    now = {"vllm:generation_tokens_total": 400.0, "vllm:prefix_cache_hits_total": 40.0,
           "vllm:prefix_cache_queries_total": 80.0, "vllm:kv_cache_usage_perc": 0.25}
    cells = row("m", now, before, 2.0)
    assert cells["gen tok/s"] == "150.0" and cells["prefix hits"] == "75.0%" and cells["prefix hits (all)"] == "50.0%"
    assert cells["KV cache"] == "25.0%" and cells["offload tier"] == "-" and cells["tier hits"] == "-"
    assert row("m", now, None, 0.0)["gen tok/s"] == "-"  # one reading: no rate yet


def test_monitor_shows_a_live_server_and_an_unreachable_one(tiny_llama: str, tmp_path: Path) -> None:
    port, dead = free_port(), free_port()
    args = [tiny_llama, "--port", str(port), "--served-model-name", "tiny", "--kv-offloading-size", "0.01"]
    with serve(args, tmp_path / "serve.log", port) as (base, _):
        def traffic() -> None:
            httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": [5] * 40, "max_tokens": 300,
                                                       "ignore_eos": True}, timeout=120)

        t = threading.Thread(target=traffic)
        t.start()
        out = subprocess.run([*CLI, "monitor", "--url", base, "--url", f"http://127.0.0.1:{dead}", "--interval", "1",
                              "--iterations", "2"], capture_output=True, text=True, timeout=60)
        t.join()
    assert out.returncode == 0, out.stderr
    last = out.stdout[out.stdout.rindex("kvgate monitor - all"):]
    for header in ("KV cache", "offload tier", "prefix hits", "tier hits", "running", "gen tok/s"):
        assert header in last
    line = next((ln for ln in last.splitlines() if base in ln), None)
    assert line is not None, out.stdout
    cells = [c.strip() for c in line.split("│")[1:-1]]
    assert cells[1] == "tiny" and cells[4].endswith("blocks") and float(cells[-1].replace(",", "")) > 0
    assert re.search(rf"127\.0\.0\.1:{dead} +│ unreachable", last)
