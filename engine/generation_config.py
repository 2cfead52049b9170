"""Sampling defaults from a model's generation_config.json (vLLM's `generation_config` argument): they fill in
what a request leaves out, never what it sets."""
from __future__ import annotations

import json
import os
from typing import Any

# generation_config.json key -> SamplingParams field (vLLM reads the same five, and max_new_tokens)
_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
         "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_config_dir(choice: str, model_path: str) -> str | None:
    """Where the generation_config.json comes from: the model's directory (auto), none (vllm), or a directory."""
    if choice == "vllm":
        return None
    if choice == "auto":
        return model_path if os.path.isdir(model_path) else None  # a GGUF file carries no sampling defaults
    if not os.path.isfile(os.path.join(choice, "generation_config.json")):
        raise ValueError(f"generation_config must be auto, vllm or a directory holding a generation_config.json; "
                         f"there is none in {choice!r}")
    return choice


def load_generation_defaults(choice: str, model_path: str) -> dict[str, Any]:
    """SamplingParams fields -> values from the chosen generation_config.json ({} when there is none)."""
    directory = generation_config_dir(choice, model_path)
    if directory is None:
        return {}
    path = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object")
    defaults = {}
    for key, name in _KEYS.items():
        value = raw.get(key)
        if key == "top_k" and value == 50:
            continue  # transformers' own default, which vLLM (reading the file's diff from it) does not apply either
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            defaults[name] = int(value) if name in ("top_k", "max_tokens") else float(value)
    if defaults:  # a default that SamplingParams would refuse is the model's mistake: say so now, not per request
        from kvgate.engine.sampling_params import SamplingParams

        try:
            SamplingParams(**defaults)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e
    return defaults
