"""`kvgate serve`'s life under signals and faults, as a supervisor sees it: SIGTERM / SIGINT drain the requests in
flight and exit 0; a stream longer than --shutdown-timeout is aborted (an error event, its blocks freed) and the
exit is still 0; an engine core process killed mid-stream fails its stream within seconds, then is restarted
(/health back to ok, requests served) or, with --on-engine-core-death exit, the server exits non-zero.

The model is a tiny one with 8 layers and 4096 positions: about 5 ms a token on the project's 2 CPU cores, so the
long streams here (thousands of tokens) outlast every signal and timeout by far."""
from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from serve_helpers import free_port, serve_process
from tiny_models import build_tiny_model

BLOCKS = 600  # KV blocks: room for a few streams of 4096 tokens in blocks of 16


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("slow") / "llama", "llama", num_hidden_layers=8,
                            max_position_embeddings=4096)


def args(model: str, port: int, *extra: str) -> list[str]:
    return [model, "--port", str(port), "--served-model-name", "slow", "--num-gpu-blocks-override", str(BLOCKS),
            "--max-num-seqs", "4", *extra]


def stream(base: str, max_tokens: int):
    """A streamed completion (the OpenAI SDK) of exactly max_tokens tokens, unless it is cut short."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    return client.completions.create(model="slow", prompt="The sky is", max_tokens=max_tokens, stream=True,
                                     stream_options={"include_usage": True}, extra_body={"ignore_eos": True})


def read_in_background(chunks) -> tuple[list[str], threading.Thread]:
    """The stream's first chunk read here, the rest on a thread: (its texts, then "<usage N>" once the usage chunk
    comes; the thread)."""
    texts = [next(chunks).choices[0].text]

    def read_the_rest() -> None:
        for c in chunks:
            texts.extend(ch.text for ch in c.choices)
            if c.usage is not None:
                texts.append(f"<usage {c.usage.completion_tokens}>")

    reader = threading.Thread(target=read_the_rest)
    reader.start()
    return texts, reader


def wait_for(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"gave up waiting: {what}"
        time.sleep(0.05)


def refused(base: str) -> bool:
    """No answer from the server: the connection is refused (or closed or reset unanswered, when it came just as the
    listening socket was being closed)."""
    try:
        httpx.get(f"{base}/health", timeout=5)
    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
        return True
    return False


def blocks_in_use_at_stop(log: str) -> list[str]:
    return re.findall(r"stopping with (\d+) requests running, (\d+) waiting and (\d+) of (\d+) KV blocks in use", log)


@pytest.mark.parametrize("sig, core", [(signal.SIGTERM, "thread"), (signal.SIGINT, "process")])
def test_a_signal_lets_the_stream_in_flight_finish_and_exits_0(tmp_path: Path, slow_model: str, sig: int,
                                                               core: str) -> None:
    """SIGTERM to the server; SIGINT to its whole process group, as Ctrl-C in a terminal sends it (the engine core
    process, in the group too, must leave the drain to the server)."""
    port, log = free_port(), tmp_path / "serve.log"
    extra = ["--shutdown-timeout", "120"] + (["--engine-core-process"] if core == "process" else [])
    with serve_process(args(slow_model, port, *extra), log, port, start_new_session=True) as (proc, base, _):
        texts, reader = read_in_background(stream(base, 400))
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        wait_for(lambda: refused(base), "the server to stop accepting connections")
        reader.join(timeout=120)
        assert not reader.is_alive()
        assert texts[-1] == "<usage 400>"  # every token came, then the usage chunk: the stream completed
        assert proc.wait(timeout=60) == 0
    text = log.read_text()
    assert f"{signal.Signals(sig).name}: no new connections; 1 requests in flight get up to 120 s" in text
    assert blocks_in_use_at_stop(text) == [("0", "0", "0", str(BLOCKS))] and "stopped (exit status 0)" in text


def test_a_stream_longer_than_the_shutdown_timeout_is_aborted_and_the_exit_is_still_0(tmp_path: Path,
                                                                                      slow_model: str) -> None:
    port, log = free_port(), tmp_path / "serve.log"
    with serve_process(args(slow_model, port, "--shutdown-timeout", "1"), log, port) as (proc, base, _):
        chunks = stream(base, 4000)  # about 20 s of tokens
        next(chunks)
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(openai.APIError, match=r"did not finish within the shutdown timeout \(1 s\)"):
            for _ in chunks:  # the stream ends with an error event, not a cut connection
                pass
        assert proc.wait(timeout=60) == 0
    text = log.read_text()
    assert "shutdown timeout (1 s): aborted 1 requests" in text
    assert blocks_in_use_at_stop(text) == [("0", "0", "0", str(BLOCKS))]  # its KV blocks were freed


def test_a_second_signal_exits_at_once(tmp_path: Path, slow_model: str) -> None:
    port, log = free_port(), tmp_path / "serve.log"
    with serve_process(args(slow_model, port, "--shutdown-timeout", "600"), log, port) as (proc, base, _):
        chunks = stream(base, 4000)
        next(chunks)
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: "requests in flight get up to 600 s" in log.read_text(), "the drain to begin")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM  # not after the stream's 20 s, nor the 600 s
        with pytest.raises((openai.APIConnectionError, httpx.HTTPError)):  # its connection is simply gone
            for _ in chunks:
                pass
    assert "SIGTERM again: exiting now, without waiting for 1 requests in flight" in log.read_text()


def core_pid(log: Path) -> int:
    """The engine core's process id, from the line that says it is ready (written just after /health says ok)."""
    pattern = r"engine core on its own process \(pid (\d+)\)"
    wait_for(lambda: re.search(pattern, log.read_text()), "the engine's ready line in the log")
    return int(re.findall(pattern, log.read_text())[-1])


def kill_core_mid_stream(base: str, log: Path) -> None:
    """SIGKILL the engine core process while a client streams: the client gets an error within 5 s."""
    chunks = stream(base, 4000)
    next(chunks)
    os.kill(core_pid(log), signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(openai.APIError, match=r"the engine core process exited \(exit code -9\)"):
        for _ in chunks:
            pass
    assert time.monotonic() - killed < 5.0


def test_a_killed_engine_core_fails_its_stream_and_is_restarted(tmp_path: Path, slow_model: str) -> None:
    port, log = free_port(), tmp_path / "serve.log"
    with serve_process(args(slow_model, port, "--engine-core-process"), log, port) as (proc, base, _):
        first_pid = core_pid(log)
        kill_core_mid_stream(base, log)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.APIStatusError) as meanwhile:  # a new core takes seconds to start: 503 until then
            client.completions.create(model="slow", prompt="The sky is", max_tokens=5)
        assert meanwhile.value.status_code == 503 and "restarting its engine core" in str(meanwhile.value)
        assert int(meanwhile.value.response.headers["retry-after"]) >= 1
        statuses: list[str] = []

        def health_ok() -> bool:
            r = httpx.get(f"{base}/health", timeout=5)
            statuses.append(r.json()["status"])
            return r.status_code == 200

        wait_for(health_ok, "/health ok after the restart")
        assert statuses[0] == "loading" and set(statuses) == {"loading", "ok"}  # never "dead": it was restarting
        r = client.completions.create(model="slow", prompt="The sky is", max_tokens=5, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 5
        restarted = re.findall(r"the engine core process restarted in [\d.]+ s \(pid (\d+)\)", log.read_text())
        assert len(restarted) == 1 and int(restarted[0]) != first_pid
        metrics = httpx.get(f"{base}/metrics").text
        assert 'vllm:num_requests_running{model_name="slow"} 0.0' in metrics
        assert f'kvgate:kv_cache_free_blocks{{model_name="slow"}} {float(BLOCKS)}' in metrics
        assert 'kvgate:engine_core_restarts_total{model_name="slow"} 1.0' in metrics
        assert proc.poll() is None


def test_a_killed_engine_core_with_the_exit_policy_exits_non_zero(tmp_path: Path, slow_model: str) -> None:
    port, log = free_port(), tmp_path / "serve.log"
    extra = ("--engine-core-process", "--on-engine-core-death", "exit")
    with serve_process(args(slow_model, port, *extra), log, port) as (proc, base, _):
        kill_core_mid_stream(base, log)
        assert proc.wait(timeout=60) == 1  # for a supervisor to restart it
    text = log.read_text()
    assert "not restarted (on_engine_core_death is exit): stopping (exit status 1)" in text
