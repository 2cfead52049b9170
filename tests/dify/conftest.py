"""Tests of the Dify plugin (dify_plugin/) through the real Dify plugin SDK, against live kvgate gateways.

They run in their own virtualenv and pytest process (`make dify-test`): importing the SDK gevent-patches the
whole process, and its pinned dependencies differ from kvgate's. The main suite (`pytest tests` in .venv) has no
SDK installed, so there this folder is not collected at all (collect_ignore_glob below) rather than skipped test
by test; in a dify venv the SDK is installed and every test here runs, or fails. The kvgate gateways run from the
main venv as a subprocess (kvgate_server.py), found through $KVGATE_PYTHON (default: the repo's .venv).

This file must stay importable without the SDK (the main suite loads it), so the SDK is imported lazily.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PLUGIN_DIR = REPO / "dify_plugin"
START_TIMEOUT_S = 180


def _sdk_installed() -> bool:
    try:  # the distribution's metadata: importing the package would gevent-patch this process
        importlib.metadata.version("dify_plugin")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


if not _sdk_installed():
    collect_ignore_glob = ["*.py"]
else:
    sys.path.insert(0, str(PLUGIN_DIR))  # the plugin's own imports (models.llm..., provider...), as under Dify


@pytest.fixture(scope="session", autouse=True)
def in_plugin_dir() -> Iterator[Path]:
    """The SDK reads manifest.yaml, the provider yaml and _assets relative to the working directory."""
    before = Path.cwd()
    os.chdir(PLUGIN_DIR)
    yield PLUGIN_DIR
    os.chdir(before)


class Gateways:
    """The running kvgate gateways (main, auth, busy, embed, tools: see kvgate_server.py) and what their engines
    recorded."""

    def __init__(self, urls: dict[str, str], record: Path) -> None:
        self.urls, self.record = urls, record

    def __getitem__(self, name: str) -> str:
        return self.urls[name]

    def engine_records(self, marker: str) -> list[dict[str, Any]]:
        """Requests the engines accepted whose prompt contains `marker` (written by the engine thread)."""
        lines = self.record.read_text().splitlines()
        return [r for r in map(json.loads, lines) if marker in r["prompt"]]


@pytest.fixture(scope="session")
def kvgate_python() -> str:
    """The main venv's python (kvgate and torch installed there, not here)."""
    python = os.environ.get("KVGATE_PYTHON") or str(REPO / ".venv" / "bin" / "python")
    if not Path(python).exists():
        raise RuntimeError(f"no kvgate python at {python}: run `make setup` or set KVGATE_PYTHON")
    return python


@pytest.fixture(scope="session")
def gateways(tmp_path_factory: pytest.TempPathFactory, kvgate_python: str) -> Iterator[Gateways]:
    tmp = tmp_path_factory.mktemp("kvgate")
    python = kvgate_python
    ready, record, log = tmp / "ready.json", tmp / "requests.jsonl", tmp / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen([python, str(HERE / "kvgate_server.py"), "--model-dir", str(tmp / "model"),
                                 "--record", str(record), "--ready", str(ready)], stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kvgate_server.py did not start (exit {proc.poll()}):\n{log.read_text()}")
            time.sleep(0.1)
        yield Gateways(json.loads(ready.read_text()), record)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def registration(in_plugin_dir: Path) -> Any:
    """The plugin loaded the way Dify's runner loads it: manifest, provider yaml, classes from their sources."""
    from dify_plugin import DifyPluginEnv
    from dify_plugin.core.plugin_registration import PluginRegistration

    return PluginRegistration(DifyPluginEnv())


@pytest.fixture
def llm(registration: Any) -> Callable[[], Any]:
    """A fresh model instance per call, as the runner makes one per request."""
    from dify_plugin.entities.model import ModelType

    return lambda: registration.get_model_instance("kvgate", ModelType.LLM)


@pytest.fixture
def embedding(registration: Any) -> Callable[[], Any]:
    """A fresh text-embedding model instance per call, as the runner makes one per request."""
    from dify_plugin.entities.model import ModelType

    return lambda: registration.get_model_instance("kvgate", ModelType.TEXT_EMBEDDING)
