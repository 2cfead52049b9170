"""A chat choice's output as a message: the reasoning parser (--reasoning-parser) splits the thinking off, and the
rest goes through the tool-call side (the parser of tool_choice "auto", or the reader of a forced choice). The same
ChatOutputParser serves a stream (step by step) and a whole response (the whole text at once), so the two agree.

Also where a model's parser settings (enable_auto_tool_choice, tool_call_parser, reasoning_parser: per-model
EngineArgs that the engine ignores) are checked against the registries: by the config checks before anything loads,
and by OpenAIServing when it is built."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from kvgate.engine.arg_utils import ArgError
from kvgate.gateway.delta_message import DeltaMessage, ParsedMessage
from kvgate.gateway.reasoning import ReasoningParser, ReasoningParserManager
from kvgate.gateway.tool_parsers import ToolParser, ToolParserManager


class OutputReader(Protocol):
    """What reads an output step by step: a tool-call parser, a forced choice's reader, a reasoning parser."""
    def feed(self, text: str) -> DeltaMessage: ...

    def finish(self) -> DeltaMessage: ...


@dataclass
class ParserSettings:
    """A served model's parsers (from its EngineArgs): the tool-call parser class, whether tool_choice "auto" is
    allowed, the reasoning parser class."""
    tool_parser: type[ToolParser] | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: type[ReasoningParser] | None = None


def parser_settings(args: Any) -> ParserSettings:
    """The parsers `args` (EngineArgs, or anything with its three fields) name; ArgError (a ValueError) naming the
    argument and the registered names for a name that is not registered."""
    tool, reasoning = getattr(args, "tool_call_parser", None), getattr(args, "reasoning_parser", None)
    if tool is not None and tool not in ToolParserManager.tool_parsers:
        raise ArgError("tool_call_parser", f"must be a registered tool-call parser "
                                           f"({', '.join(ToolParserManager.list_registered())}), got {tool!r}")
    if reasoning is not None and reasoning not in ReasoningParserManager.reasoning_parsers:
        raise ArgError("reasoning_parser", f"must be a registered reasoning parser "
                                           f"({', '.join(ReasoningParserManager.list_registered())}), got "
                                           f"{reasoning!r}")
    return ParserSettings(ToolParserManager.get_tool_parser(tool) if tool is not None else None,
                          bool(getattr(args, "enable_auto_tool_choice", False)),
                          ReasoningParserManager.get_reasoning_parser(reasoning) if reasoning is not None else None)


class ChatOutputParser:
    """One choice's output: `reasoning` (or None) first, then `tools` (or None) on the content it leaves."""

    def __init__(self, reasoning: OutputReader | None, tools: OutputReader | None) -> None:
        self.reasoning, self.tools = reasoning, tools

    def feed(self, text: str) -> DeltaMessage:
        if self.reasoning is None:
            return self.tools.feed(text) if self.tools is not None else DeltaMessage(text)
        out = self.reasoning.feed(text)
        return self._tools(out)

    def finish(self) -> DeltaMessage:
        out = self._tools(self.reasoning.finish()) if self.reasoning is not None else DeltaMessage()
        return out.add(self.tools.finish()) if self.tools is not None else out

    def _tools(self, out: DeltaMessage) -> DeltaMessage:
        if self.tools is None or not out.content:
            return out
        content, out.content = out.content, ""
        return out.add(self.tools.feed(content))

    @property
    def num_calls(self) -> int:
        return getattr(self.tools, "num_calls", 0)

    def finish_reason(self, reason: str | None) -> str | None:
        """"tool_calls" for an output that made calls and stopped by itself; the engine's reason otherwise (a call
        cut off by max_tokens keeps "length")."""
        return "tool_calls" if reason == "stop" and self.num_calls else reason

    def parse(self, text: str) -> ParsedMessage:
        """The whole output at once (on a new parser)."""
        return ParsedMessage().add(self.feed(text)).add(self.finish())


def message_of(parsed: ParsedMessage, with_reasoning: bool) -> dict[str, Any]:
    """The response's assistant message: content (null when there are calls and no text), reasoning_content (only
    for a model with a reasoning parser; null when there was none), tool_calls (only when there are some)."""
    message: dict[str, Any] = {"role": "assistant",
                               "content": parsed.content if parsed.content or not parsed.tool_calls else None}
    if with_reasoning:
        message["reasoning_content"] = parsed.reasoning_content or None
    if parsed.tool_calls:
        message["tool_calls"] = [c.to_openai() for c in parsed.tool_calls]
    return message
