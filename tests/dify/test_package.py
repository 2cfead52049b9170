"""The .difypkg: built by `python -m kvgate.gateway.dify_package` (main venv), it holds the plugin's files and
nothing that .difyignore leaves out, and the unpacked package starts with `python -m main` (serverless) and
serves a real call through the SDK's runtime; broken manifests are refused with every problem named."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
import yaml
from dify_helpers import (
    EMBED_MODEL,
    GUIDED_MAX_TOKENS,
    MODEL,
    PLUGIN_DIR,
    REPO,
    TOOLS,
    TOOLS_MODEL,
    credentials,
    embedding_credentials,
    gateway_embeddings,
    tools_credentials,
)

PLUGIN_FILES = {
    ".difyignore", ".env.example", "PRIVACY.md", "README.md", "main.py", "manifest.yaml", "requirements.txt",
    "_assets/icon.svg", "provider/kvgate.py", "provider/kvgate.yaml", "models/common/client.py",
    "models/common/errors.py", "models/common/settings.py", "models/llm/llm.py", "models/llm/messages.py",
    "models/llm/request.py", "models/llm/responses.py", "models/llm/schema.py", "models/llm/settings.py",
    "models/llm/tool_calls.py", "models/text_embedding/settings.py",
    "models/text_embedding/text_embedding.py",
}
VERSION = yaml.safe_load((PLUGIN_DIR / "manifest.yaml").read_text())["version"]


def build(kvgate_python: str, out: Path, *extra: str) -> Path:
    """Run the packager as a user would, in the repository root; return the package it wrote."""
    done = subprocess.run([kvgate_python, "-m", "kvgate.gateway.dify_package", "--out-dir", str(out), *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    target = out / f"kvgate-{VERSION}.difypkg"
    assert str(target) in done.stdout
    return target


@pytest.fixture(scope="module")
def package(kvgate_python: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(kvgate_python, tmp_path_factory.mktemp("dist"))


def test_the_package_holds_the_plugin_and_nothing_ignored(package: Path, kvgate_python: str,
                                                          tmp_path: Path) -> None:
    with zipfile.ZipFile(package) as zf:
        assert set(zf.namelist()) == PLUGIN_FILES
        assert all(zf.read(name) == (PLUGIN_DIR / name).read_bytes() for name in PLUGIN_FILES)
    # a working copy with what a developer leaves lying around: none of it may be shipped
    src = tmp_path / "src"
    shutil.copytree(PLUGIN_DIR, src, ignore=shutil.ignore_patterns("__pycache__"))
    (src / ".env").write_text("REMOTE_INSTALL_KEY=secret\n")
    (src / "models" / "llm" / "__pycache__").mkdir()
    (src / "models" / "llm" / "__pycache__" / "llm.cpython-312.pyc").write_bytes(b"\0")
    (src / "old.difypkg").write_bytes(b"PK")
    (src / ".venv" / "bin").mkdir(parents=True)
    (src / ".venv" / "bin" / "python").write_text("")
    again = build(kvgate_python, tmp_path / "out", "--plugin-dir", str(src))
    assert again.read_bytes() == package.read_bytes()  # same files, same bytes: ignored ones are left out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def serverless_plugin(package: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The unpacked package started the way Dify's plugin CI starts one: `python -m main`, INSTALL_METHOD=serverless."""
    root = tmp_path_factory.mktemp("unpacked")
    with zipfile.ZipFile(package) as zf:
        zf.extractall(root)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REMOTE_INSTALL", "SERVERLESS_"))}
    env.update(INSTALL_METHOD="serverless", SERVERLESS_HOST="127.0.0.1", SERVERLESS_PORT=str(port))
    log = root.parent / "serverless.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "main"], cwd=root, env=env, stdout=out, stderr=out)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            try:
                if httpx.get(url + "/health", timeout=2).text == "OK":
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def session_events(url: str, data: dict[str, Any]) -> list[dict[str, Any]]:
    """One request to the serverless plugin, as Dify's plugin daemon sends it; the session's events."""
    body = {"event": "request", "session_id": "test-session", "data": {"user_id": "u", "provider": "kvgate",
                                                                      "model_type": "llm", "model": MODEL, **data}}
    response = httpx.post(url + "/invoke", json=body, timeout=60)
    assert response.status_code == 200
    events = [json.loads(line) for line in response.text.splitlines() if line.strip()]
    assert events[-1]["data"]["type"] == "end"
    return events[:-1]


def test_python_m_main_serverless_serves_the_packaged_plugin(serverless_plugin: str, gateways: Any) -> None:
    events = session_events(serverless_plugin, {
        "type": "model", "action": "invoke_llm", "credentials": credentials(gateways["main"]),
        "prompt_messages": [{"role": "user", "content": "hi"}], "model_parameters": {"max_tokens": 3},
        "stop": None, "tools": None, "stream": True})
    chunks = [e["data"]["data"] for e in events]
    assert {e["data"]["type"] for e in events} == {"stream"}
    assert chunks[-1]["delta"]["usage"]["completion_tokens"] == 3 and chunks[-1]["delta"]["finish_reason"]
    (failed,) = session_events(serverless_plugin, {
        "type": "model", "action": "validate_model_credentials",
        "credentials": credentials(gateways["main"], priority=101)})
    assert failed["data"]["type"] == "error"
    assert failed["data"]["data"]["error_type"] == "CredentialsValidateFailedError"
    assert "priority must be in [0, 100]" in failed["data"]["data"]["message"]


def test_the_packaged_plugin_serves_tool_calls(serverless_plugin: str, gateways: Any) -> None:
    """Tools, a history with a call and its result, and the answer's call, as JSON through the SDK's runtime (the
    way Dify's plugin daemon sends and reads them)."""
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
               {"role": "tool", "content": "21 °C", "tool_call_id": "call_1"},
               {"role": "user", "content": "And the time in Paris?"}]
    events = session_events(serverless_plugin, {
        "type": "model", "action": "invoke_llm", "model": TOOLS_MODEL, "prompt_messages": history,
        "credentials": tools_credentials(gateways["tools"], function_calling_type="single_tool_call"),
        "model_parameters": {"tool_choice": "required", "max_tokens": GUIDED_MAX_TOKENS, "temperature": 0},
        "tools": [t.model_dump() for t in TOOLS], "stop": None, "stream": True})
    chunks = [e["data"]["data"] for e in events]
    (call,) = [c for chunk in chunks for c in chunk["delta"]["message"]["tool_calls"]]
    assert call["function"]["name"] in {t.name for t in TOOLS} and json.loads(call["function"]["arguments"])
    assert chunks[-1]["delta"]["finish_reason"] == "tool_calls"


def test_the_packaged_plugin_serves_text_embeddings(serverless_plugin: str, gateways: Any) -> None:
    texts = ["hello world", "the packaged plugin embeds"]
    direct = gateway_embeddings(gateways["embed"], texts)
    (event,) = session_events(serverless_plugin, {
        "type": "model", "action": "invoke_text_embedding", "model_type": "text-embedding", "model": EMBED_MODEL,
        "credentials": embedding_credentials(gateways["embed"]), "texts": texts, "input_type": "document"})
    assert event["data"]["type"] == "stream"
    result = event["data"]["data"]
    assert result["embeddings"] == [d["embedding"] for d in direct["data"]]
    assert result["usage"]["tokens"] == direct["usage"]["prompt_tokens"]


# ---- the packager's checks (its module is plain Python + PyYAML, so it loads here too) ---------------------------
@pytest.fixture(scope="module")
def packager() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dify_package", REPO / "gateway" / "dify_package.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("change, message", [
    ({"version": "1.0"}, "version '1.0' is not valid"),
    ({"author": None}, "required field 'author' is missing"),
    ({"name": "Kv Gate"}, "name 'Kv Gate' is not valid"),
    ({"icon": "missing.svg"}, "icon refers to _assets/missing.svg, which is not in the package"),
    ({"meta": {"version": "0.0.1", "arch": ["x86"], "runner": {"language": "python", "version": "3.12",
                                                             "entrypoint": "start"}}},
     "meta.arch must list some of amd64, arm64.*\n.*entrypoint 'start' needs start.py"),
    ({"plugins": {"models": ["provider/nope.yaml"]}}, "plugins.models refers to provider/nope.yaml"),
])
def test_broken_manifests_are_refused(packager: ModuleType, tmp_path: Path, change: dict, message: str) -> None:
    src = tmp_path / "plugin"
    shutil.copytree(PLUGIN_DIR, src, ignore=shutil.ignore_patterns("__pycache__"))
    manifest = yaml.safe_load((src / "manifest.yaml").read_text())
    manifest.update(change)
    (src / "manifest.yaml").write_text(yaml.safe_dump({k: v for k, v in manifest.items() if v is not None}))
    with pytest.raises(packager.PackageError, match=message):
        packager.build_package(src, tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_difyignore_that_drops_referenced_files_is_refused(packager: ModuleType, tmp_path: Path) -> None:
    src = tmp_path / "plugin"
    shutil.copytree(PLUGIN_DIR, src, ignore=shutil.ignore_patterns("__pycache__"))
    with (src / ".difyignore").open("a") as f:
        f.write("models/\n_assets/*.svg\n")
    with pytest.raises(packager.PackageError) as refused:
        packager.build_package(src, tmp_path / "out")
    assert "refers to models/llm/llm.py, which is not in the package" in str(refused.value)
    assert "icon refers to _assets/icon.svg" in str(refused.value)


def test_ignore_rules_follow_gitignore(packager: ModuleType) -> None:
    rules = packager.IgnoreRules(["# comment", "*.pyc", "!keep.pyc", "/build/", "cache/", "docs/**/*.md", "?.tmp"])
    assert rules.ignored("a/b/c.pyc", False) and not rules.ignored("a/keep.pyc", False)
    assert rules.ignored("build", True) and not rules.ignored("src/build", True) and not rules.ignored("build", False)
    assert rules.ignored("x/cache", True) and not rules.ignored("x/cache", False)
    assert rules.ignored("docs/a/b/c.md", False) and rules.ignored("docs/c.md", False)
    assert not rules.ignored("readme.md", False) and rules.ignored("a.tmp", False) and not rules.ignored("ab.tmp", False)
