"""`kvgate serve` as a user starts it: the default model, /health, one chat call through the openai client."""
from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx
import openai


def test_kvgate_serve_default_model_answers(tmp_path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "kvgate.gateway.cli", "serve", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        statuses = []
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                r = httpx.get(f"{base}/health", timeout=5)
                statuses.append(r.json()["status"])
                if r.status_code == 200:
                    break
                assert r.status_code == 503 and r.json()["status"] == "loading"
            except httpx.TransportError:
                pass
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            time.sleep(0.1)
        assert statuses and statuses[-1] == "ok", (tmp_path / "serve.log").read_text()
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(model="SmolLM2-135M-Instruct", temperature=0, max_tokens=24,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in r.choices[0].message.content
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
