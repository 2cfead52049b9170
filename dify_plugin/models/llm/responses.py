"""Reading kvgate's OpenAI answers: server-sent events of a stream, the JSON of a blocking call, reasoning and tool
calls.

Dify shows a model's reasoning from `<think>...</think>` in the content (its agent view and its LLM node read the
tags there). A model that writes those tags itself passes through unchanged; a gateway that returns reasoning
separately (`reasoning_content` with `--reasoning-parser`, or vLLM's newer `reasoning`) gets it wrapped in the tags
here, the way the Dify SDK's own helper does: the tag closes when the content or the first tool call begins.
Tool calls are assembled by models/llm/tool_calls.py.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from dify_plugin.entities.model.message import AssistantPromptMessage
from dify_plugin.errors.model import InvokeServerUnavailableError

from models.llm.tool_calls import ToolCallAssembler, message_tool_calls


class ThinkTags:
    """Turns separate reasoning deltas into inline `<think>\\n...\\n</think>` content."""

    def __init__(self) -> None:
        self.open = False

    def text(self, content: str, reasoning: str) -> str:
        out = ""
        if reasoning:
            if not self.open:
                out, self.open = "<think>\n", True
            out += reasoning
        if content:
            out += self.close() + content
        return out

    def close(self) -> str:
        if not self.open:
            return ""
        self.open = False
        return "\n</think>"


def _reasoning(message: dict[str, Any]) -> str:
    return message.get("reasoning_content") or message.get("reasoning") or ""


def sse_events(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """The JSON payloads of `data:` lines until `data: [DONE]`; an error event is raised as the gateway's error."""
    for line in lines:
        if not line.startswith("data:"):
            continue  # blank separators, comments (": ping"), event names
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        payload = json.loads(data)
        if isinstance(payload, dict) and payload.get("error"):
            error = payload["error"]
            message = error.get("message") if isinstance(error, dict) else str(error)
            raise InvokeServerUnavailableError(f"kvgate failed mid-stream: {message}")
        yield payload


@dataclass
class StreamState:
    """What a stream told so far: the text (with think tags), the tool calls (assembled), the finish reason and the
    usage, once sent."""

    mode: str
    think: ThinkTags = field(default_factory=ThinkTags)
    text: str = ""
    tool_calls: ToolCallAssembler = field(default_factory=ToolCallAssembler)
    finish_reason: str | None = None
    usage: dict[str, int] | None = None

    def feed(self, payload: dict[str, Any]) -> str:
        """One event; returns the new text to show (may be empty). Tool-call fragments are kept for `calls()`."""
        if payload.get("usage"):
            self.usage = payload["usage"]
        new = ""
        for choice in payload.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue  # Dify asks for one answer (n=1)
            if self.mode == "chat":
                delta = choice.get("delta") or {}
                new += self.think.text(delta.get("content") or "", _reasoning(delta))
                if delta.get("tool_calls"):
                    new += self.think.close()
                    self.tool_calls.feed(delta["tool_calls"])
            else:
                new += choice.get("text") or ""
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        if self.finish_reason is not None:
            new += self.think.close()
        self.text += new
        return new

    def finish(self) -> str:
        """Text still owed at the end of the stream (a think tag left open)."""
        tail = self.think.close()
        self.text += tail
        return tail

    def calls(self) -> list[AssistantPromptMessage.ToolCall]:
        """The stream's tool calls, complete (ValueError for a malformed one)."""
        return self.tool_calls.calls()


@dataclass
class Answer:
    """A non-streamed answer: the text (with think tags), its tool calls, the finish reason and the usage."""

    text: str
    tool_calls: list[AssistantPromptMessage.ToolCall]
    finish_reason: str | None
    usage: dict[str, int] | None


def blocking_answer(body: dict[str, Any], mode: str) -> Answer:
    """The answer of a non-streamed response's first choice; KeyError, IndexError, TypeError or ValueError for a
    body that is not what the OpenAI API promises."""
    choice = body["choices"][0]
    calls: list[AssistantPromptMessage.ToolCall] = []
    if mode == "chat":
        message = choice.get("message") or {}
        think = ThinkTags()
        text = think.text("", _reasoning(message)) + think.close() + (message.get("content") or "")
        calls = message_tool_calls(message)
    else:
        text = choice.get("text") or ""
    return Answer(text, calls, choice.get("finish_reason"), body.get("usage"))
