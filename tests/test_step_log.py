"""benchmarks/step_log: `kvgate serve` with the engine core in its own process logs every step, each request's add and
first token there, and each request's submission in the API process; summarize.py reads the logs. Run as the GPU
benchmark runs it (serving_gpu.sh STEP_LOG=1)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import openai

from serve_helpers import free_port, serve

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["The sky is", "Once upon a time there was", "Paris is the capital of"]


def test_the_step_log_counts_every_token_and_request(tmp_path: Path, tiny_llama: str) -> None:
    logs, port = tmp_path / "steps", free_port()
    env = {**os.environ, "KVGATE_STEP_LOG_DIR": str(logs),
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "benchmarks" / "step_log"),
                                                      os.environ.get("PYTHONPATH")) if p)}
    args = [tiny_llama, "--port", str(port), "--served-model-name", "tiny", "--engine-core-process"]
    with serve(args, tmp_path / "serve.log", port, env=env) as (base, _):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        usages = [client.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=0,
                                            extra_body={"ignore_eos": True}).usage for p in PROMPTS]
        rows: dict[str, list[list[float]]] = {}
        deadline = time.time() + 30
        while (len(rows.get("first", [])) < len(PROMPTS) or len(rows.get("submit", [])) < len(PROMPTS)) \
                and time.time() < deadline:  # written once a second
            time.sleep(0.2)
            files = list(logs.glob("steps-*.tsv"))
            rows, kinds = {}, []
            for f in files:
                lines = [line.split("\t") for line in f.read_text().splitlines()]
                kinds.append({kind for kind, *_ in lines})
                for kind, *vals in lines:
                    rows.setdefault(kind, []).append([float(v) for v in vals])
    # the engine core's process steps; the API process submits and runs no step
    assert sorted(kinds, key=len) == [{"submit"}, {"step", "drain", "emit", "add", "first"}]
    assert len(rows["add"]) == len(rows["first"]) == len(rows["submit"]) == len(PROMPTS)
    assert all(0 < r[1] < 30 for r in rows["submit"])  # seconds from the HTTP request's start
    # every token computed once: the prompt, then one decode per output token but the last
    want = sum(u.prompt_tokens + u.completion_tokens - 1 for u in usages)
    assert sum(r[3] for r in rows["step"]) == want
    assert all(r[2] == 0.0 for r in rows["step"])  # no GPU: nothing to wait for
    assert all(0 <= a[1] <= f[1] for a, f in zip(rows["add"], rows["first"]))  # one at a time: add, then its token
    assert rows["drain"] and rows["emit"]
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_log" / "summarize.py"), str(logs)],
                         capture_output=True, text=True, check=True).stdout
    assert f"arrival to the first token (engine TTFT): p50" in out and "| step tokens |" in out, out
    assert "(API process)\n   HTTP request to its submission to the engine: p50" in out, out
    assert out.count(f"({len(PROMPTS)} requests)") == 3, out  # submissions, adds, first tokens
