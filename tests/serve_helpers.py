"""`kvgate serve` in a subprocess, as a user starts it, for tests: wait for /health, yield its URL, stop it."""
from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import httpx

from mock_upstream import free_port

CLI = [sys.executable, "-m", "kvgate.gateway.cli"]
__all__ = ["CLI", "free_port", "serve", "serve_process", "metric_labels"]


@contextlib.contextmanager
def serve(args: list[str], log_path: Path, port: int, env: dict[str, str] | None = None, cwd: Path | None = None
          ) -> Iterator[tuple[str, list[str]]]:
    """`kvgate serve ARGS` in a subprocess; yields (base URL, /health statuses seen until it said ok)."""
    with serve_process(args, log_path, port, env, cwd) as (proc, base, statuses):
        yield base, statuses


@contextlib.contextmanager
def serve_process(args: list[str], log_path: Path, port: int, env: dict[str, str] | None = None,
                  cwd: Path | None = None, **popen: Any) -> Iterator[tuple[subprocess.Popen, str, list[str]]]:
    """`kvgate serve ARGS` in a subprocess (Popen keywords in `popen`), once /health said ok; yields (the process,
    base URL, /health statuses seen until then). Stopped with SIGTERM at the end, unless it has exited already."""
    log = open(log_path, "w")
    proc = subprocess.Popen([*CLI, "serve", *args], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd, **popen)
    base = f"http://127.0.0.1:{port}"
    try:
        statuses: list[str] = []
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                r = httpx.get(f"{base}/health", timeout=5)
                statuses.append(r.json()["status"])
                if r.status_code == 200:
                    break
                assert r.status_code == 503 and r.json()["status"] == "loading", r.text
            except httpx.TransportError:
                pass
            assert proc.poll() is None, log_path.read_text()
            time.sleep(0.1)
        assert statuses and statuses[-1] == "ok", log_path.read_text()
        yield proc, base, statuses
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(timeout=60)
        log.close()


def metric_labels(metrics_text: str, name: str) -> list[dict[str, str]]:
    """The label sets of every sample of metric `name` in a Prometheus text exposition."""
    import re

    out = []
    for line in metrics_text.splitlines():
        if line.startswith(name + "{"):
            body = line[len(name) + 1:line.rindex("}")]
            out.append({k: v.replace('\\"', '"').replace("\\\\", "\\")
                        for k, v in re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', body)})
    return out
