"""How an embedding is made from a model's hidden states: the model's PoolerConfig and a request's PoolingParams
(vLLM's names). A model runs either as a generator or as a pooling (embedding) model, decided once at load."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

POOLING_TYPES = ("LAST", "MEAN", "CLS")
# sentence-transformers' pooling modes (1_Pooling/config.json) -> ours
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}


@dataclass
class PoolerConfig:
    """LAST: the last prompt token's final hidden state (decoder embedding models such as Qwen3-Embedding); MEAN:
    the mean over the prompt's tokens; CLS: the first token's. `normalize`: L2-normalized vectors.
    `matryoshka_dimensions`: None when the model does not allow shorter vectors (`dimensions` is refused), [] when
    any length up to hidden_size is allowed, else the lengths it was trained for."""
    pooling_type: str = "LAST"
    normalize: bool = True
    matryoshka_dimensions: list[int] | None = None

    @property
    def needs_every_token(self) -> bool:
        """MEAN and CLS read hidden states that a prefix-cache hit would skip; LAST reads only the last token's,
        which is always computed. Such requests skip reading the prefix cache."""
        return self.pooling_type != "LAST"

    @classmethod
    def from_model(cls, model_path: str, overrides: dict[str, Any] | None) -> "PoolerConfig":
        """The defaults (LAST, normalized), then what the model's sentence-transformers files say (modules.json,
        its Pooling module's config.json) and its config.json (matryoshka), then `overrides` (the pooler_config
        engine arg)."""
        cfg, hf_config = cls(), {}
        if os.path.isdir(model_path):
            _read_sentence_transformers(model_path, cfg)
            with open(os.path.join(model_path, "config.json")) as f:
                hf_config = json.load(f)
        if hf_config.get("is_matryoshka") or hf_config.get("matryoshka_dimensions"):
            cfg.matryoshka_dimensions = sorted(int(d) for d in hf_config.get("matryoshka_dimensions") or [])
        for key, value in (overrides or {}).items():
            if key == "pooling_type":
                value = str(value).upper()
                if value not in POOLING_TYPES:
                    raise ValueError(f"pooler_config.pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                                     f"got {value!r}")
                cfg.pooling_type = value
            elif key == "normalize":
                if not isinstance(value, bool):
                    raise ValueError(f"pooler_config.normalize must be true or false, got {value!r}")
                cfg.normalize = value
            else:
                raise ValueError(f"unknown pooler_config key {key!r}; the keys are pooling_type, normalize")
        return cfg


def _read_sentence_transformers(model_dir: str, cfg: PoolerConfig) -> None:
    path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(path):
        return
    try:
        with open(path) as f:
            modules = json.load(f)
        types = {m.get("type", ""): m.get("path", "") for m in modules if isinstance(m, dict)}
    except (ValueError, OSError, AttributeError, TypeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    cfg.normalize = any(t.endswith(".Normalize") for t in types)
    pooling_dir = next((p for t, p in types.items() if t.endswith(".Pooling")), None)
    if pooling_dir is None:
        return
    try:
        with open(os.path.join(model_dir, pooling_dir, "config.json")) as f:
            modes = json.load(f)
    except (ValueError, OSError) as e:
        raise ValueError(f"cannot read the pooling config in {os.path.join(model_dir, pooling_dir)}: {e}") from e
    for key, kind in _ST_MODES.items():
        if modes.get(key):
            cfg.pooling_type = kind
            return
    raise ValueError(f"{os.path.join(model_dir, pooling_dir)}: unsupported pooling mode (kvgate supports "
                     f"{', '.join(_ST_MODES)})")


def has_sentence_transformers_pooling(model_dir: str) -> bool:
    return os.path.isfile(os.path.join(model_dir, "modules.json"))


@dataclass
class PoolingParams:
    """One embedding request's options: `dimensions` (a shorter matryoshka vector: the first `dimensions` values,
    cut before normalizing), `normalize` (None: the model's PoolerConfig decides). Checked on construction for
    their types, and against the model by `verify`."""
    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        d = self.dimensions
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise ValueError(f"dimensions must be a positive integer, got {d!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true, false or null, got {self.normalize!r}")

    def verify(self, pooler: PoolerConfig, hidden_size: int) -> None:
        """Raise a ValueError naming the limit when this model cannot honour `dimensions` (the engine and the
        gateway both ask here, so they never disagree)."""
        d = self.dimensions
        if d is None:
            return
        allowed = pooler.matryoshka_dimensions
        if allowed is None:
            raise ValueError(f"dimensions is not supported by this model: it was not trained for shorter "
                             f"(matryoshka) embeddings, so its vectors always have {hidden_size} dimensions; "
                             f"leave dimensions out")
        if allowed and d not in allowed:
            raise ValueError(f"dimensions must be one of {', '.join(map(str, allowed))} for this model (its "
                             f"matryoshka dimensions), got {d}")
        if d > hidden_size:
            raise ValueError(f"dimensions must be in [1, {hidden_size}] for this model, got {d}")

    def should_normalize(self, pooler: PoolerConfig) -> bool:
        return pooler.normalize if self.normalize is None else self.normalize


def check_runner(runner: str, pooling: bool) -> None:
    """Refuse a request the engine's runner cannot serve: a generate request on a pooling (embedding) engine, or
    a pooling request on a generate engine; the ValueError says how to change the runner."""
    if pooling and runner != "pooling":
        raise ValueError(f"this model runs with runner={runner!r} (text generation) and cannot make embeddings; "
                         f"start an embedding model with runner=\"pooling\" (kvgate serve --runner pooling)")
    if not pooling and runner == "pooling":
        raise ValueError("this model runs with runner='pooling' (an embedding model) and cannot generate text; "
                         "use embed()/encode() (/v1/embeddings), or start a generative model with "
                         "runner=\"generate\" (kvgate serve --runner generate)")
