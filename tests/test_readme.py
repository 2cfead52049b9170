"""The README's examples run as written, against the default model (SmolLM2-135M-Instruct, which CI has): the
server examples against a real `kvgate serve` (only its port differs), the Python ones in a fresh interpreter."""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

from serve_helpers import free_port, serve
from tiny_models import build_tiny_embedding_model

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def blocks(lang: str, must_contain: str) -> list[str]:
    """The README's fenced `lang` code blocks that contain `must_contain`, in order."""
    found = re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)
    return [b for b in found if must_contain in b]


def run_python(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_the_serve_examples_answer_paris_within_their_max_tokens(tmp_path: Path) -> None:
    (curl,) = blocks("bash", "curl http://127.0.0.1:8000/v1/chat/completions")
    (client,) = blocks("python", "stream = client.chat.completions.create")
    (tools,) = blocks("python", "tool_choice=")
    port = free_port()
    with serve(["--port", str(port)], tmp_path / "serve.log", port):
        def at_port(text: str) -> str:
            assert "127.0.0.1:8000" in text
            return text.replace("127.0.0.1:8000", f"127.0.0.1:{port}")

        r = subprocess.run(["bash", "-c", at_port(curl)], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        answer = json.loads(r.stdout)
        assert "Paris" in answer["choices"][0]["message"]["content"]
        assert answer["choices"][0]["finish_reason"] == "stop", answer  # done before its max_tokens
        assert "Paris" in run_python(at_port(client))
        call, answer = run_python(at_port(tools)).splitlines()
        assert "name='get_weather'" in call and "arguments='{\"city\":" in call, call  # compact JSON
        assert set(json.loads(answer)) == {"country", "capital"}, answer


def test_the_offline_examples_answer_paris() -> None:
    offline, engine = blocks("python", "from kvgate.engine import")
    out = run_python(offline)
    assert out.count("Paris") >= 2, out  # the completion and the chat answer
    out = run_python(engine)
    assert "Paris" in out and "'free_blocks'" in out, out


def test_the_embeddings_example_on_a_tiny_model_of_that_name(tmp_path: Path) -> None:
    """The same commands with a tiny random Qwen3-Embedding-shaped model in place of the real one (CI has none)."""
    (command,) = blocks("bash", "kvgate serve ./Qwen3-Embedding-0.6B")
    (client,) = blocks("python", "emb.embeddings.create")
    build_tiny_embedding_model(tmp_path / "Qwen3-Embedding-0.6B", "qwen3")
    port = free_port()
    args = shlex.split(command.replace("--port 8001", f"--port {port}"), comments=True)
    assert args[:2] == ["kvgate", "serve"]
    with serve(args[2:], tmp_path / "serve.log", port, cwd=tmp_path):
        out = run_python(client.replace("127.0.0.1:8001", f"127.0.0.1:{port}")).split()
    assert out[:2] == ["2", "64"] and int(out[2]) > 4  # two vectors of the tiny model's hidden size
