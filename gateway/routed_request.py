"""RoutedRequest: one request as the router and route functions see it (the parsed body, headers, priority, the
prompt's length in tokens), and the bytes to send upstream."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from kvgate.gateway.prompt_tokenizer import TOKENIZE_IN_THREAD_CHARS


@dataclass
class RoutedRequest:
    """What a route function sees: the parsed body, headers, priority, and the prompt's token length (`len`)."""
    kind: str  # "chat" | "completions" | "embeddings"
    body: dict[str, Any]
    raw: bytes = b""
    headers: Mapping[str, str] = field(default_factory=dict)
    priority: int = 50
    max_batch_delay: float | None = None
    count_tokens: Callable[[str], int] | None = field(default=None, repr=False)
    model: str = ""  # the model asked for; the route function's choice once routed
    timing: Any = field(default=None, repr=False)  # the RequestTiming of its last dispatch (the router sets it)
    _len: int | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.model = self.model or str(self.body.get("model") or "")

    @property
    def messages(self) -> list[dict] | None:
        return self.body.get("messages")

    @property
    def prompt(self) -> Any:
        """The completion's prompt, or the embedding request's input (the same shapes)."""
        return self.body.get("input" if self.kind == "embeddings" else "prompt")

    @property
    def user(self) -> str | None:
        return self.body.get("user")

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def max_tokens(self) -> int | None:
        m = self.body.get("max_completion_tokens") or self.body.get("max_tokens")
        return m if isinstance(m, int) else (16 if self.kind == "completions" and m is None else None)

    def text(self) -> str:
        """The prompt as text: the messages' contents one after another, or the prompt string(s)."""
        if self.messages is not None:  # the body is not validated yet: any JSON may be here
            parts = []
            for m in self.messages if isinstance(self.messages, list) else []:
                c = m.get("content") if isinstance(m, dict) else None
                parts.append(c if isinstance(c, str) else "".join(
                    t for p in c if isinstance(p, dict) and isinstance(t := p.get("text"), str))
                    if isinstance(c, list) else "")
            return "\n".join(parts)
        p = self.prompt
        return p if isinstance(p, str) else "\n".join(x for x in p if isinstance(x, str)) if isinstance(p, list) else ""

    @property
    def len(self) -> int:
        """Prompt length in tokens (the first embedded model's tokenizer, else about 4 bytes per token)."""
        if self._len is None:
            p = self.prompt
            if isinstance(p, list) and p and all(isinstance(x, int) for x in p):
                self._len = len(p)
            elif isinstance(p, list) and p and all(isinstance(x, list) for x in p):
                self._len = sum(len(x) for x in p)
            else:
                text = self.text()  # a long text is estimated: tokenizing it here would stall the event loop
                self._len = self.count_tokens(text) if self.count_tokens and len(text) <= TOKENIZE_IN_THREAD_CHARS \
                    else len(text.encode()) // 4 + 1
        return self._len

    def prefix_text(self, n: int) -> str:
        return self.text()[:n]

    def body_for(self, model: str) -> bytes:
        """The body to send upstream: the client's bytes unchanged unless the model name must change."""
        if self.raw and self.body.get("model") == model:
            return self.raw
        return json.dumps({**self.body, "model": model}, ensure_ascii=False).encode()
