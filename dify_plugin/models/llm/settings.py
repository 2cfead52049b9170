"""An LLM's own credentials on top of the shared ones (models/common/settings.py): the completion mode and the
largest max_tokens a Dify user may pick."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from models.common.settings import GatewaySettings, text, whole

MODES = ("chat", "completion")


@dataclass(frozen=True)
class LLMSettings(GatewaySettings):
    """What the plugin needs to call one LLM on one kvgate gateway."""

    mode: str  # "chat" or "completion"
    max_tokens: int  # the largest max_tokens a Dify user may pick, at most context_size

    @classmethod
    def type_fields(cls, credentials: Mapping[str, Any], common: Mapping[str, Any]) -> dict[str, Any]:
        mode = text(credentials, "mode") or "chat"
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        context_size = common["context_size"]
        max_tokens = whole(credentials, "max_tokens_to_sample", context_size, "a whole number of tokens >= 1")
        if not 1 <= max_tokens <= context_size:
            raise ValueError(f"max_tokens_to_sample must be in [1, context_size={context_size}], got {max_tokens}")
        return {"mode": mode, "max_tokens": max_tokens}
