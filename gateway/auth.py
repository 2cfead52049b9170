"""API keys and their limits: who may call the gateway, and how much.

Each key has a name (what logs and metrics show: a key itself is never logged) and optional limits, as LiteLLM's
virtual keys have them: requests per minute (`rpm`), tokens per minute (`tpm`, prompt plus completion tokens) and
requests in flight at once (`max_concurrent`). A request over a limit gets 429 with Retry-After and OpenAI's code
`rate_limit_exceeded`; other keys are unaffected.

Keys are looked up by their SHA-256 digest and then compared with hmac.compare_digest, so the time an answer takes
says nothing about how much of a guess matched.

The rates are token buckets that hold a minute's worth and refill continuously. A request is admitted while its
key's request bucket holds one request and its token bucket is not in debt; its tokens are charged when it ends
(only then are they known), so one large request may put a key in debt, and the key then waits until the bucket
has refilled past zero.
"""
from __future__ import annotations

import hashlib
import hmac
import math
import time
from dataclasses import dataclass, field

from kvgate.engine.arg_utils import arg, arg_specs


@dataclass
class APIKey:
    name: str
    key: str = field(repr=False)  # never printed, never logged
    rpm: int | None = None  # requests per minute
    tpm: int | None = None  # tokens (prompt + completion) per minute
    max_concurrent: int | None = None  # requests in flight at once


@dataclass
class APIKeySpec:
    """An entry of config.yaml's api_keys: (or of an api_keys_file), besides its `name`."""
    key: str | None = arg(None, "the key itself (better kept out of config.yaml: key_env, or an api_keys_file)")
    key_env: str | None = arg(None, "an environment variable that holds the key")
    rpm: int | None = arg(None, "requests per minute", ge=1)
    tpm: int | None = arg(None, "tokens per minute, prompt plus completion", ge=1)
    max_concurrent: int | None = arg(None, "requests in flight at once", ge=1)


KEY_SPECS = arg_specs(APIKeySpec)


@dataclass
class Bucket:
    """A token bucket holding up to `capacity`, refilled by `capacity` per minute; `level` may go below zero."""
    capacity: float
    level: float = 0.0
    at: float = 0.0

    def __post_init__(self) -> None:
        self.level = self.capacity

    def refill(self, now: float) -> float:
        self.level = min(self.capacity, self.level + (now - self.at) * self.capacity / 60.0)
        self.at = now
        return self.level

    def seconds_until(self, level: float) -> float:
        """Seconds until the bucket holds `level` (0 when it already does)."""
        return max(0.0, (level - self.level) * 60.0 / self.capacity)


@dataclass
class KeyState:
    key: APIKey
    requests: Bucket | None = None
    tokens: Bucket | None = None
    in_flight: int = 0
    admitted: int = 0  # totals, for /metrics
    limited: int = 0
    tokens_used: int = 0

    def __post_init__(self) -> None:
        if self.key.rpm:
            self.requests = Bucket(float(self.key.rpm))
        if self.key.tpm:
            self.tokens = Bucket(float(self.key.tpm))


class RateLimited(Exception):
    """A key over one of its limits; `retry_after` is whole seconds (at least 1)."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = max(1, math.ceil(retry_after))


class KeyRing:
    """The gateway's keys. Empty: no key is needed."""

    def __init__(self, keys: list[APIKey]) -> None:
        names = [k.name for k in keys]
        if len(set(names)) != len(names):
            raise ValueError("API key names must be unique")
        self._by_digest = {_digest(k.key): KeyState(k) for k in keys}
        if len(self._by_digest) != len(keys):
            raise ValueError("the same API key is given twice")

    def __bool__(self) -> bool:
        return bool(self._by_digest)

    def find(self, presented: str | None) -> KeyState | None:
        """The key a request presented (the value of `Authorization: Bearer ...`), or None."""
        if presented is None:
            return None
        state = self._by_digest.get(_digest(presented))
        if state is None or not hmac.compare_digest(state.key.key.encode(), presented.encode()):
            return None
        return state

    def admit(self, state: KeyState, now: float | None = None) -> None:
        """Take one request (and a concurrency seat) of `state`'s allowance, or raise RateLimited, changing
        nothing. Every admitted request must end with `release`."""
        now = time.monotonic() if now is None else now
        try:
            self._check(state, now)
        except RateLimited:
            state.limited += 1
            raise
        if state.requests is not None:
            state.requests.level -= 1.0
        state.in_flight += 1
        state.admitted += 1

    @staticmethod
    def _check(state: KeyState, now: float) -> None:
        k = state.key
        if k.max_concurrent is not None and state.in_flight >= k.max_concurrent:
            raise RateLimited(f"API key '{k.name}' has {state.in_flight} requests in flight, its limit of "
                              f"{k.max_concurrent} concurrent requests", 1)
        if state.requests is not None and state.requests.refill(now) < 1.0:
            raise RateLimited(f"API key '{k.name}' is over its limit of {k.rpm} requests per minute",
                              state.requests.seconds_until(1.0))
        if state.tokens is not None and state.tokens.refill(now) <= 0.0:
            raise RateLimited(f"API key '{k.name}' is over its limit of {k.tpm} tokens per minute",
                              state.tokens.seconds_until(1.0))

    def release(self, state: KeyState, tokens: int, now: float | None = None) -> None:
        """An admitted request ended: free its seat and charge the tokens it used."""
        state.in_flight -= 1
        state.tokens_used += tokens
        if state.tokens is not None and tokens:
            state.tokens.refill(time.monotonic() if now is None else now)
            state.tokens.level -= tokens


    def metrics(self) -> str:
        """Per key (label key_name): requests admitted, refused by a limit, tokens used, requests in flight."""
        if not self._by_digest:
            return ""
        lines = []
        for metric, kind, help_text, attr in (
                ("kvgate:api_key_requests_total", "counter", "Requests an API key made that its limits admitted.",
                 "admitted"),
                ("kvgate:api_key_rate_limited_total", "counter", "Requests refused with 429 by an API key's limits.",
                 "limited"),
                ("kvgate:api_key_tokens_total", "counter", "Prompt and completion tokens of an API key's requests.",
                 "tokens_used"),
                ("kvgate:api_key_requests_in_flight", "gauge", "An API key's requests in flight.", "in_flight")):
            lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} {kind}"]
            lines += [f'{metric}{{key_name="{_label(st.key.name)}"}} {getattr(st, attr)}'
                      for st in self._by_digest.values()]
        return "\n".join(lines) + "\n"


def bearer(authorization: bytes | None) -> str | None:
    """The key of an `Authorization: Bearer KEY` header value (None: no such header)."""
    if authorization is None:
        return None
    scheme, _, key = authorization.decode("latin-1").partition(" ")
    return key.strip() if scheme.lower() == "bearer" else None


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
