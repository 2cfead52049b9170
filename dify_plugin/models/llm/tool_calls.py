"""Tool calls in kvgate's answers as Dify's AssistantPromptMessage.ToolCall: OpenAI's streamed tool-call deltas
assembled into complete calls, and the calls of a non-streamed message.

A stream sends each call in fragments: the first fragment of call `index` carries its id, type and name, the later
ones only pieces of its arguments' JSON text. Dify's agent runs every ToolCall it finds in a chunk as a whole call,
so fragments must never reach it: they are collected here, and the calls go to Dify complete, once the stream ends
(as the SDK's OpenAI-compatible model does). A non-streamed message's calls go through the same assembly, so both
paths give the same calls.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from dify_plugin.entities.model.message import AssistantPromptMessage


@dataclass
class _Call:
    id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


def _arguments(value: Any) -> str:
    """Arguments as JSON text (OpenAI's shape); an object (which some servers send) is written as JSON."""
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


class ToolCallAssembler:
    """Collects tool-call fragments by OpenAI's `index`; `calls()` gives the complete calls in index order."""

    def __init__(self) -> None:
        self._calls: dict[int, _Call] = {}
        self._last: int | None = None

    def __bool__(self) -> bool:
        return bool(self._calls)

    def _slot(self, fragment: dict[str, Any]) -> _Call:
        """The call a fragment belongs to. Without an index (a server that leaves it out), a fragment with a new id,
        or a name but no id after a named call, starts the next call; any other continues the last."""
        index = fragment.get("index")
        if not isinstance(index, int):
            last = self._calls.get(self._last) if self._last is not None else None
            fid, fname = fragment.get("id"), (fragment.get("function") or {}).get("name")
            starts = last is None or (bool(fid) and fid != last.id) or (not fid and bool(fname) and bool(last.name))
            index = max(self._calls, default=-1) + 1 if starts else self._last
        self._last = index
        return self._calls.setdefault(index, _Call())

    def feed(self, fragments: list[dict[str, Any]] | None) -> None:
        """One delta's `tool_calls` (a list of fragments; None or empty: nothing)."""
        for fragment in fragments or []:
            if not isinstance(fragment, dict):
                raise ValueError(f"a tool call must be a JSON object, got {fragment!r}")
            call = self._slot(fragment)
            function = fragment.get("function") or {}
            if fragment.get("id"):
                call.id = str(fragment["id"])
            if function.get("name"):
                call.name = str(function["name"])
            call.arguments.append(_arguments(function.get("arguments")))

    def calls(self) -> list[AssistantPromptMessage.ToolCall]:
        """The complete calls; a call the server sent without an id gets one (Dify answers a call by its id). A
        call without a function name is a malformed answer: ValueError."""
        out = []
        for index in sorted(self._calls):
            call = self._calls[index]
            if not call.name:
                raise ValueError(f"tool call {index} came without a function name")
            out.append(AssistantPromptMessage.ToolCall(
                id=call.id or f"call_{uuid.uuid4().hex[:24]}", type="function",
                function=AssistantPromptMessage.ToolCall.ToolCallFunction(name=call.name,
                                                                          arguments="".join(call.arguments))))
        return out


def message_tool_calls(message: dict[str, Any]) -> list[AssistantPromptMessage.ToolCall]:
    """The calls of a non-streamed answer's message (none: [])."""
    calls = message.get("tool_calls") or []
    assembler = ToolCallAssembler()
    assembler.feed([{**c, "index": c.get("index", i)} if isinstance(c, dict) else c for i, c in enumerate(calls)])
    return assembler.calls()
