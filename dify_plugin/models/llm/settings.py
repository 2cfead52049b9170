"""One model's credentials from Dify's form, checked and turned into what each HTTP call to kvgate needs.

Dify sends every form value as a string. Mistakes a user can make are reported as ValueError with the field's name,
what was wrong and the allowed range; ranges that the gateway owns (priority 0-100, batch delay 0-60000 ms) are
left to the gateway, whose 400 names them, so the two can never disagree.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

DEFAULT_TIMEOUT_S = 300.0
MAX_TIMEOUT_S = 86400.0
DEFAULT_MAX_BATCH_DELAY_MS = 50.0
DEFAULT_PRIORITY = 50
DEFAULT_CONTEXT_SIZE = 4096
CONNECT_TIMEOUT_S = 10.0  # connecting never needs long; a dead host should fail fast even with a long timeout
MODES = ("chat", "completion")


def _text(credentials: Mapping[str, Any], key: str) -> str:
    value = credentials.get(key)
    return "" if value is None else str(value).strip()


def _number(credentials: Mapping[str, Any], key: str, default: float, what: str) -> float:
    raw = _text(credentials, key)
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{key} must be {what}, got {raw!r}") from None


def _whole(credentials: Mapping[str, Any], key: str, default: int, what: str) -> int:
    value = _number(credentials, key, default, what)
    if value != int(value):
        raise ValueError(f"{key} must be {what}, got {_text(credentials, key)!r}")
    return int(value)


@dataclass(frozen=True)
class GatewaySettings:
    """What the plugin needs to call one model on one kvgate gateway."""

    root_url: str  # the gateway's base URL without a trailing /v1
    api_key: str | None
    model_name: str  # the name sent to the gateway ("auto": its router chooses)
    mode: str  # "chat" or "completion"
    context_size: int
    max_tokens: int  # the largest max_tokens a Dify user may pick
    timeout: float  # seconds: the longest wait for the gateway's answer or its next streamed piece
    max_batch_delay_ms: float
    priority: int

    @classmethod
    def from_credentials(cls, model: str, credentials: Mapping[str, Any]) -> "GatewaySettings":
        url = _text(credentials, "vllm_endpoint").rstrip("/")
        if not url:
            raise ValueError("vllm_endpoint (the kvgate gateway's base URL, e.g. http://kvgate:8000) is required")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"vllm_endpoint must start with http:// or https://, got {url!r}")
        root = url[: -len("/v1")] if url.endswith("/v1") else url
        mode = _text(credentials, "mode") or "chat"
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        context_size = _whole(credentials, "context_size", DEFAULT_CONTEXT_SIZE, "a whole number of tokens >= 1")
        if context_size < 1:
            raise ValueError(f"context_size must be a whole number of tokens >= 1, got {context_size}")
        max_tokens = _whole(credentials, "max_tokens_to_sample", context_size, "a whole number of tokens >= 1")
        if not 1 <= max_tokens <= context_size:
            raise ValueError(f"max_tokens_to_sample must be in [1, context_size={context_size}], got {max_tokens}")
        timeout = _number(credentials, "timeout", DEFAULT_TIMEOUT_S, f"a number of seconds in [1, {MAX_TIMEOUT_S:g}]")
        if not 1 <= timeout <= MAX_TIMEOUT_S:
            raise ValueError(f"timeout must be in [1, {MAX_TIMEOUT_S:g}] seconds, got {timeout:g}")
        delay = _number(credentials, "max_batch_delay", DEFAULT_MAX_BATCH_DELAY_MS, "a number of milliseconds")
        priority = _whole(credentials, "priority", DEFAULT_PRIORITY,
                          "a whole number in [0, 100] (higher is more urgent)")
        return cls(root_url=root, api_key=_text(credentials, "api_key") or None,
                   model_name=_text(credentials, "endpoint_model_name") or model, mode=mode,
                   context_size=context_size, max_tokens=max_tokens, timeout=timeout, max_batch_delay_ms=delay,
                   priority=priority)

    def url(self, path: str) -> str:
        """`path` is the gateway's own path: "/v1/chat/completions", "/tokenize", ..."""
        return self.root_url + path

    def headers(self) -> dict[str, str]:
        """Sent with every request: kvgate's scheduler reads the batching window and the priority from them."""
        headers = {"X-Max-Batch-Delay-Ms": f"{self.max_batch_delay_ms:g}", "X-Priority": str(self.priority)}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def http_timeout(self) -> httpx.Timeout:
        """`timeout` bounds every wait for the gateway: the answer (blocking) or the next piece of a stream."""
        return httpx.Timeout(self.timeout, connect=min(CONNECT_TIMEOUT_S, self.timeout))
