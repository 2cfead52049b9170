"""What a chat choice's output becomes once parsed: DeltaMessage (vLLM's name), the new reasoning, content and
tool-call fragments of one step, and ParsedMessage, the whole message folded from them.

Parsers (gateway/tool_parsers/, gateway/reasoning/) emit DeltaMessages as text arrives; a streamed response sends
each one as a chunk's `delta`, and a non-streamed response folds them (the same parser run over the whole output),
so the two agree by construction: the streamed content, reasoning and each call's argument fragments concatenate to
the non-streamed message."""
from __future__ import annotations

import secrets
import string
from dataclasses import dataclass, field


def random_tool_call_id() -> str:
    """OpenAI's shape: "call_" and 24 random alphanumerics."""
    return "call_" + "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(24))


@dataclass
class DeltaToolCall:
    """A fragment of the tool call numbered `index` (0, 1, ... within the choice): the first fragment of a call
    carries its `id` and `name`, the later ones only `arguments` text."""
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict:
        out: dict = {"index": self.index}
        if self.id is not None:
            out["id"], out["type"] = self.id, "function"
        function: dict = {"name": self.name} if self.name is not None else {}
        function["arguments"] = self.arguments
        out["function"] = function
        return out


@dataclass
class DeltaMessage:
    """New text of one step: reasoning, content, tool-call fragments (any of them may be empty)."""
    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning_content or self.tool_calls)

    def add(self, other: "DeltaMessage") -> "DeltaMessage":
        """`other` appended to this one (in place; returns self). Consecutive fragments of one call merge."""
        self.content += other.content
        self.reasoning_content += other.reasoning_content
        for call in other.tool_calls:
            last = self.tool_calls[-1] if self.tool_calls else None
            if last is not None and last.index == call.index and call.id is None:
                last.arguments += call.arguments
            else:
                self.tool_calls.append(DeltaToolCall(call.index, call.id, call.name, call.arguments))
        return self

    def to_openai(self) -> dict:
        """The `delta` object of a chat.completion.chunk (only the fields with something in them)."""
        out: dict = {}
        if self.reasoning_content:
            out["reasoning_content"] = self.reasoning_content
        if self.content:
            out["content"] = self.content
        if self.tool_calls:
            out["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        return out


@dataclass
class ToolCall:
    """A whole tool call: its id, the function's name and the arguments as JSON text."""
    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedMessage:
    """A choice's whole message: the fold of its DeltaMessages."""
    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def add(self, delta: DeltaMessage) -> "ParsedMessage":
        """`delta` folded in (in place; returns self): a fragment with an id starts a call, the others extend the
        call of their index."""
        self.content += delta.content
        self.reasoning_content += delta.reasoning_content
        for c in delta.tool_calls:
            if c.id is not None:
                self.tool_calls.append(ToolCall(c.id, c.name or "", c.arguments))
            else:
                self.tool_calls[c.index].arguments += c.arguments  # calls are numbered in order from 0
        return self
