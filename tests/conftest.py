"""Shared pytest fixtures: tiny random models built once per session (never downloaded)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:  # lets tests do `from tiny_models import ...` under any import mode
    sys.path.insert(0, _TESTS_DIR)

from tiny_models import ARCHS, build_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """arch -> directory of a tiny random HF model (with tokenizer), for every arch in ARCHS."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: build_tiny_model(root / arch, arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_dirs: dict[str, str]) -> str:
    """Directory of the tiny Llama model (tied embeddings, default RoPE)."""
    return tiny_model_dirs["llama"]
