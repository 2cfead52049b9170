"""The access log: one line per request on the `kvgate.access` logger (INFO), written when the response has been
sent (for a stream, when it ends): client, method, path, status, model, API key name, prompt and completion
tokens, latency. Never the prompt, never a key. `kvgate serve --disable-log-requests` (vLLM's flag) turns it off.
Probes and scrapes (GET /health, GET /metrics) that succeed are logged at DEBUG only.

    INFO kvgate.access: 127.0.0.1:53012 "POST /v1/chat/completions" 200 model=tiny key=team-a prompt_tokens=14
         completion_tokens=30 latency_ms=412.6 stream=true

Token counts are the router's: the prompt's length as counted at dispatch (the first embedded model's tokenizer,
or about 4 bytes a token for a text routed to remote upstreams only) and the completion tokens the response
carried (streamed events for a relayed stream)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

logger = logging.getLogger("kvgate.access")
QUIET_PATHS = ("/health", "/metrics")

Send = Callable[[dict], Awaitable[None]]


@dataclass
class AccessRecord:
    """What one request's log line says; the gateway fills it in as the request goes."""
    method: str
    path: str
    client: str
    start: float
    status: int = 0
    model: str = ""
    key: str = "-"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    stream: bool = False

    @classmethod
    def begin(cls, scope: dict) -> "AccessRecord":
        host, port = scope.get("client") or ("-", 0)
        return cls(scope["method"], scope["path"], f"{host}:{port}", time.monotonic())

    def capture(self, send: Send) -> Send:
        """`send` that notes the response's status on its way out."""
        async def send_noting_status(message: dict) -> None:
            if message["type"] == "http.response.start":
                self.status = message["status"]
            await send(message)

        return send_noting_status

    def line(self, now: float) -> str:
        text = f'{self.client} "{self.method} {self.path}" {self.status}'
        if self.model:
            text += f" model={self.model}"
        text += f" key={self.key}"
        if self.prompt_tokens or self.completion_tokens:
            text += f" prompt_tokens={self.prompt_tokens} completion_tokens={self.completion_tokens}"
        text += f" latency_ms={(now - self.start) * 1000:.1f}"
        return text + (" stream=true" if self.stream else "")

    def write(self) -> None:
        quiet = self.path in QUIET_PATHS and self.method == "GET" and self.status < 400
        level = logging.DEBUG if quiet else logging.INFO
        if logger.isEnabledFor(level):
            logger.log(level, self.line(time.monotonic()))


def note_request(record: AccessRecord | None, request: Any) -> None:
    """Copy what a routed request learned (model, stream, the router's token counts) into its record."""
    if record is None or request is None:
        return
    record.model, record.stream = request.model, request.stream
    timing = getattr(request, "timing", None)
    if timing is not None:
        record.prompt_tokens, record.completion_tokens = timing.prompt_tokens, timing.output_tokens
