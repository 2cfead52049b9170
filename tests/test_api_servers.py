"""`kvgate serve --api-server-count 2`: two HTTP server processes on one port, one engine core process behind both
(gateway/api_servers.py, engine/core_clients.py), run as a user starts it."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest

from serve_helpers import CLI, free_port, serve_process
from test_serve_lifecycle import (BLOCKS, blocks_in_use_at_stop, core_pid, read_in_background, slow_model,  # noqa: F401
                                  stream, wait_for)
from test_serve_lifecycle import args as one_process_args


def args(model: str, port: int, *extra: str) -> list[str]:
    return one_process_args(model, port, "--api-server-count", "2", *extra)


def other_api_pid(log: Path) -> int:
    pattern = r"API server 1 of 2 \(pid (\d+)\) serving"
    wait_for(lambda: re.search(pattern, log.read_text()), "the second API process")
    return int(re.search(pattern, log.read_text()).group(1))


def short(base: str) -> str:
    """A greedy completion on a connection of its own."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
    return client.completions.create(model="slow", prompt="The sky is", max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text


def access_lines(log: str, process: str) -> str:
    """The access log's lines of the first API process (process "") or another one (" [api server N]")."""
    return "\n".join(line for line in log.splitlines() if f"kvgate.access{process}: " in line)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_two_api_processes_serve_one_core_and_drain_together(tmp_path: Path, slow_model: str) -> None:
    port, log = free_port(), tmp_path / "serve.log"
    with serve_process(args(slow_model, port, "--shutdown-timeout", "120"), log, port) as (proc, base, _):
        other = other_api_pid(log)
        want = short(base)
        texts, reader = read_in_background(stream(base, 400))
        # on connections of their own, which the kernel spreads over both processes (all 24 on one: p = 1e-7)
        assert {short(base) for _ in range(24)} == {want}
        text = log.read_text()
        assert '"POST /v1/completions" 200' in access_lines(text, "") and \
            '"POST /v1/completions" 200' in access_lines(text, " [api server 1]")
        proc.send_signal(signal.SIGTERM)  # both drain: the stream in flight finishes
        reader.join(timeout=120)
        assert not reader.is_alive() and texts[-1] == "<usage 400>"
        assert proc.wait(timeout=60) == 0
    text = log.read_text()
    assert "the first API process is draining" in text
    # each process's engine reports the shared core as it stops; the last one found nothing left in it
    stops = blocks_in_use_at_stop(text)
    assert len(stops) == 2 and stops[-1] == ("0", "0", "0", str(BLOCKS))
    assert not alive(other)


def test_a_dead_shared_core_stops_every_api_process_with_status_1(tmp_path: Path, slow_model: str) -> None:
    port, log = free_port(), tmp_path / "serve.log"
    with serve_process(args(slow_model, port), log, port) as (proc, base, _):
        other = other_api_pid(log)
        os.kill(core_pid(log), signal.SIGKILL)
        assert proc.wait(timeout=60) == 1
    assert "not restarted (it served several API processes)" in log.read_text()
    wait_for(lambda: not alive(other), "the second API process to exit")


def test_an_engine_core_on_a_thread_cannot_serve_several_api_processes(tmp_path: Path, slow_model: str) -> None:
    run = subprocess.run([*CLI, "serve", *args(slow_model, free_port(), "--no-engine-core-process")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "engine_core_process false cannot serve api_server_count 2 processes" in run.stderr


@pytest.mark.parametrize("reuse_port", [False, True])
def test_a_port_in_use_stops_it_before_anything_loads(slow_model: str, reuse_port: bool) -> None:
    """Any server listening on the port stops it; one listening with SO_REUSEPORT too (another kvgate serve with
    several API processes, or an old one still draining), which would otherwise get part of its connections."""
    import socket

    with socket.socket() as taken:
        if reuse_port:
            taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run([*CLI, "serve", *args(slow_model, port)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in run.stderr
    assert "loading" not in run.stderr


def test_every_api_process_serves_a_config_files_models(tmp_path: Path, slow_model: str) -> None:
    """A config file with an embedded model and a remote one: the other process reads the same file (its relative
    paths included) and relays to the same upstream."""
    from mock_upstream import MockUpstream

    upstream = MockUpstream("far").start()
    try:
        (tmp_path / "model").symlink_to(slow_model)
        (tmp_path / "config.yaml").write_text(
            f"api_server_count: 2\nmodels:\n  - name: slow\n    model: model\n    num_gpu_blocks_override: {BLOCKS}\n"
            f"  - name: far\n    deployments:\n      - url: {upstream.url}\n")
        port, log = free_port(), tmp_path / "serve.log"
        with serve_process(["--config", str(tmp_path / "config.yaml"), "--port", str(port)], log, port) as (
                proc, base, _):
            other_api_pid(log)
            assert short(base) == short(base)
            for _ in range(24):  # fresh connections: both processes answer some (all 24 on one: p = 1e-7)
                client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
                assert client.completions.create(model="far", prompt="hi", max_tokens=5).choices[0].text == \
                    upstream.text()
            text = log.read_text()
            assert '"POST /v1/completions" 200 model=far' in access_lines(text, "") and \
                '"POST /v1/completions" 200 model=far' in access_lines(text, " [api server 1]")
        assert proc.returncode == 0
    finally:
        upstream.stop()
    assert upstream.requests == 24


def test_health_says_ok_from_every_process_only_once_all_serve(tmp_path: Path, slow_model: str) -> None:
    """Three API processes: /health on fresh connections (any process may answer) says loading until all three
    serve, and ok from then on, never loading again (a readiness probe must not flap while the others start)."""
    port, log = free_port(), tmp_path / "serve.log"
    with open(log, "w") as out:  # the child holds its own copy
        proc = subprocess.Popen([*CLI, "serve", *one_process_args(slow_model, port, "--api-server-count", "3")],
                                stdout=out, stderr=subprocess.STDOUT)
    seen: list[str] = []
    try:
        deadline = time.time() + 120
        while time.time() < deadline and seen.count("ok") < 60:
            assert proc.poll() is None, log.read_text()
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)  # a connection of its own
                seen.append(r.json()["status"])
            except httpx.TransportError:
                pass
            time.sleep(0.02)
        assert "ok" in seen, log.read_text()
        first_ok = seen.index("ok")
        assert set(seen[:first_ok]) == {"loading"} and set(seen[first_ok:]) == {"ok"}, seen
        assert len(re.findall(r"API server [12] of 3 \(pid \d+\) serving", log.read_text())) == 2
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0
