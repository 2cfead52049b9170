"""`kvgate serve` as a user starts it (the default model: test_readme.py): a two-model config.yaml (flags
overriding it), and an invalid config refused before anything loads."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from pathlib import Path

import openai
import pytest

from mock_upstream import MockUpstream
from serve_helpers import CLI, free_port, serve
from tiny_models import build_tiny_embedding_model

from kvgate.engine import LLM, SamplingParams


def test_kvgate_serve_config_with_two_models_and_an_embedding_model(tmp_path: Path,
                                                                    tiny_model_dirs: dict[str, str]) -> None:
    models = {"tiny-llama": tiny_model_dirs["llama"], "tiny-qwen": tiny_model_dirs["qwen3"]}
    embed = build_tiny_embedding_model(tmp_path / "embed", "qwen3")
    in_file, port = free_port(), free_port()
    config = tmp_path / "config.yaml"
    config.write_text(f"port: {in_file}\nmax_num_seqs: 4\nnum_gpu_blocks_override: 64\nmodels:\n"
                      f"  - name: tiny-llama\n    model: {models['tiny-llama']}\n"
                      f"  - name: tiny-qwen\n    model: {models['tiny-qwen']}\n    block_size: 32\n"
                      f"  - name: tiny-embed\n    model: {embed}\n")
    log = tmp_path / "serve.log"
    with serve(["--config", str(config), "--port", str(port)], log, port) as (base, _):  # the flag wins
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        assert sorted(m.id for m in client.models.list().data) == sorted([*models, "tiny-embed"])
        e = client.embeddings.create(model="tiny-embed", input=["The sky is"], encoding_format="float")
        assert len(e.data[0].embedding) == 64  # the embedding model beside the chat ones
        with pytest.raises(openai.BadRequestError, match="embedding model"):
            client.completions.create(model="tiny-embed", prompt="The sky is", max_tokens=2)
        sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        for name, path in models.items():
            r = client.completions.create(model=name, prompt="The sky is", max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
            offline = LLM(path, num_gpu_blocks_override=64).generate(["The sky is"], sp)[0].outputs[0].text
            assert r.choices[0].text == offline  # each name reaches its own model
        text = log.read_text()
        assert "tiny-llama: ready in" in text and "tiny-qwen: ready in" in text  # load progress on stderr
        assert re.search(r'"POST /v1/completions" 200 model=tiny-qwen key=- prompt_tokens=\d+ completion_tokens=8 '
                         r'latency_ms=', text), text  # the access log: one line a request, never the prompt
        assert "The sky is" not in text


def test_kvgate_serve_config_with_a_remote_upstream_and_a_route(tmp_path: Path, tiny_model_dirs: dict[str, str]
                                                               ) -> None:
    """config.yaml with an embedded model, a remote OpenAI upstream and an "auto" route function: the
    ModelRouter behind kvgate serve."""
    big = MockUpstream("big").start()
    port = free_port()
    config = tmp_path / "config.yaml"
    config.write_text(f"max_num_seqs: 4\nmodels:\n  - name: small\n    model: {tiny_model_dirs['llama']}\n"
                      f"  - name: big\n    deployments:\n      - url: {big.url}\n"
                      f"routes:\n  - name: auto\n    function: mock_upstream:route_by_length\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    try:
        with serve(["--config", str(config), "--port", str(port)], tmp_path / "serve.log", port, env) as (base, _):
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
            assert {m.id for m in client.models.list().data} == {"small", "big", "auto"}
            r = client.chat.completions.create(model="big", messages=[{"role": "user", "content": "hi"}])
            assert r.system_fingerprint == "fp_big" and r.choices[0].message.content == big.text()
            r = client.chat.completions.create(model="auto", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=2)
            assert r.model == "small" and big.requests == 1  # a short prompt: the route function chose small
    finally:
        big.stop()


def test_kvgate_serve_refuses_an_invalid_config(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("models:\n  - name: a\n    model: nowhere\n    max_num_seq: 8\n")
    r = subprocess.run([*CLI, "serve", "--config", str(config)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip() == (f"kvgate: error: {config}: models[0]: unknown key 'max_num_seq' "
                                f"(did you mean 'max_num_seqs'?)")


def test_an_idle_keep_alive_connection_outlives_httpx_pool_expiry(tmp_path: Path, tiny_model_dirs: dict[str, str]
                                                                   ) -> None:
    """A connection left idle for longer than httpx's keep-alive expiry (5 s, uvicorn's default timeout too) still
    serves the next request: the server's timeout (--timeout-keep-alive, default 75 s) is longer than a client's, so
    a client never reuses a connection the server is closing (under load that reset streams of a benchmark client).
    With the flag set below the idle time, the server closes it."""
    def health(sock: socket.socket) -> bytes:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        data = b""
        while b'"ok"' not in data:
            chunk = sock.recv(4096)
            if not chunk:
                break  # closed by the server
            data += chunk
        return data

    for flags, idle, reused in (([], 6, True), (["--timeout-keep-alive", "1"], 2, False)):
        port = free_port()
        with serve(["--model", tiny_model_dirs["llama"], "--port", str(port), "--num-gpu-blocks-override", "64",
                    *flags], tmp_path / "serve.log", port):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                assert health(sock).startswith(b"HTTP/1.1 200")
                time.sleep(idle)
                second = health(sock)
                assert second.startswith(b"HTTP/1.1 200") if reused else second == b"", (flags, second)
