"""One model's credentials from Dify's form: what every call to kvgate needs, whatever the model type.

Dify sends every form value as a string. Mistakes a user can make are reported as ValueError with the field's name,
what was wrong and the allowed range; ranges that the gateway owns (priority 0-100, batch delay 0-60000 ms) are
left to the gateway, whose 400 names them, so the two can never disagree. Each model type adds its own fields in a
subclass (models/llm/settings.py, models/text_embedding/settings.py) through `type_fields`.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

import httpx

DEFAULT_TIMEOUT_S = 300.0
MAX_TIMEOUT_S = 86400.0
DEFAULT_MAX_BATCH_DELAY_MS = 50.0
DEFAULT_PRIORITY = 50
DEFAULT_CONTEXT_SIZE = 4096
CONNECT_TIMEOUT_S = 10.0  # connecting never needs long; a dead host should fail fast even with a long timeout


def text(credentials: Mapping[str, Any], key: str) -> str:
    """The field's value, stripped; "" when it is missing."""
    value = credentials.get(key)
    return "" if value is None else str(value).strip()


def number(credentials: Mapping[str, Any], key: str, default: float, what: str) -> float:
    """The field as a number (`default` when empty); ValueError naming `what` it must be otherwise."""
    raw = text(credentials, key)
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{key} must be {what}, got {raw!r}") from None


def whole(credentials: Mapping[str, Any], key: str, default: int, what: str) -> int:
    """The field as a whole number (`default` when empty); "4.5" is refused like "4k"."""
    value = number(credentials, key, default, what)
    if value != int(value):
        raise ValueError(f"{key} must be {what}, got {text(credentials, key)!r}")
    return int(value)


@dataclass(frozen=True)
class GatewaySettings:
    """What the plugin needs to call one model on one kvgate gateway."""

    root_url: str  # the gateway's base URL without a trailing /v1
    api_key: str | None
    model_name: str  # the name sent to the gateway ("auto": its router chooses)
    context_size: int
    timeout: float  # seconds: the longest wait for the gateway's answer or its next streamed piece
    max_batch_delay_ms: float
    priority: int

    @classmethod
    def from_credentials(cls, model: str, credentials: Mapping[str, Any]) -> Self:
        """The settings of `model` (Dify's name for it); ValueError naming the first bad field."""
        common = gateway_fields(model, credentials)
        return cls(**common, **cls.type_fields(credentials, common))

    @classmethod
    def type_fields(cls, credentials: Mapping[str, Any], common: Mapping[str, Any]) -> dict[str, Any]:
        """The fields a model type adds (none here); `common` holds the checked shared ones."""
        return {}

    def url(self, path: str) -> str:
        """`path` is the gateway's own path: "/v1/chat/completions", "/v1/embeddings", "/tokenize", ..."""
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

    def client(self) -> httpx.Client:
        """An HTTP client that sends these headers with every request and waits at most `timeout`; close it."""
        return httpx.Client(timeout=self.http_timeout(), headers=self.headers())


def gateway_fields(model: str, credentials: Mapping[str, Any]) -> dict[str, Any]:
    """The shared fields of GatewaySettings, checked in the form's order."""
    url = text(credentials, "vllm_endpoint").rstrip("/")
    if not url:
        raise ValueError("vllm_endpoint (the kvgate gateway's base URL, e.g. http://kvgate:8000) is required")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"vllm_endpoint must start with http:// or https://, got {url!r}")
    context_size = whole(credentials, "context_size", DEFAULT_CONTEXT_SIZE, "a whole number of tokens >= 1")
    if context_size < 1:
        raise ValueError(f"context_size must be a whole number of tokens >= 1, got {context_size}")
    timeout = number(credentials, "timeout", DEFAULT_TIMEOUT_S, f"a number of seconds in [1, {MAX_TIMEOUT_S:g}]")
    if not 1 <= timeout <= MAX_TIMEOUT_S:
        raise ValueError(f"timeout must be in [1, {MAX_TIMEOUT_S:g}] seconds, got {timeout:g}")
    delay = number(credentials, "max_batch_delay", DEFAULT_MAX_BATCH_DELAY_MS, "a number of milliseconds")
    priority = whole(credentials, "priority", DEFAULT_PRIORITY, "a whole number in [0, 100] (higher is more urgent)")
    return dict(root_url=url[: -len("/v1")] if url.endswith("/v1") else url,
                api_key=text(credentials, "api_key") or None,
                model_name=text(credentials, "endpoint_model_name") or model, context_size=context_size,
                timeout=timeout, max_batch_delay_ms=delay, priority=priority)
