"""ToolParser, the base of every tool-call format, and ToolParserManager, the registry of formats by name (vLLM's
names: `@ToolParserManager.register_module("name")` on a subclass makes `--tool-call-parser name` use it).

A parser reads one choice's output as it arrives (`feed(text)` per step, `finish()` at the end) and returns
DeltaMessages: content, and each tool call once it is complete and well-formed (its name, its id and its arguments
in one fragment). A call is held back while it is being generated, so that one that turns out malformed (bad JSON,
cut off by max_tokens) comes back as the content it was, never as a broken call; text that may be the start of a
call's marker is held back too. The whole output parsed at once gives exactly what the steps give together.

Whitespace next to a call is dropped (the newline between content and a call, or between two calls); an output
without calls comes back exactly as generated."""
from __future__ import annotations

from typing import Any, ClassVar

from kvgate.gateway.delta_message import (
    DeltaMessage,
    DeltaToolCall,
    ParsedMessage,
    random_tool_call_id,
)
from kvgate.gateway.parser_registry import ParserRegistry
from kvgate.gateway.tool_parsers.utils import CallPiece, Piece, TextPiece, partial_suffix

__all__ = ["ToolParser", "ToolParserManager"]


class ToolParser:
    """Subclasses implement `parse(final)`: take decided text from the start of `self.buffer` (with `take`) and
    return it as pieces (TextPiece, CallPiece), leaving what is undecided in the buffer; with `final`, everything
    must be taken. Parsers are per choice and used once. `tokenizer` is the model's (for formats that need it).

    `keep_special_tokens`: the format's markers are special tokens in the models that use it, so the request is
    decoded with skip_special_tokens=False (vLLM's adjust_request does the same)."""
    name: ClassVar[str] = ""
    keep_special_tokens: ClassVar[bool] = False

    def __init__(self, tokenizer: Any = None, max_calls: int | None = None) -> None:
        """`max_calls`: calls past this many are dropped (1 when the request sets parallel_tool_calls false)."""
        self.tokenizer = tokenizer
        self.max_calls = max_calls
        self.buffer = ""  # text given to the parser and not yet decided
        self.num_calls = 0  # calls emitted so far (the next call's index)
        self._pending_ws = ""  # trailing whitespace of the content, held until text (not a call) follows it
        self._after_call = False  # the last piece was a call: the next text's leading whitespace is dropped

    # ---- what a format implements --------------------------------------------------------------------------------
    def parse(self, final: bool) -> list[Piece]:
        raise NotImplementedError

    def make_tool_call_id(self) -> str:
        """A new call's id (OpenAI's shape: "call_" and 24 alphanumerics); a format may require another."""
        return random_tool_call_id()

    # ---- helpers for parse() ----------------------------------------------------------------------------------------
    def take(self, n: int) -> str:
        """The first `n` characters of the buffer, removed from it."""
        head, self.buffer = self.buffer[:n], self.buffer[n:]
        return head

    def text_before(self, marker: str, final: bool, pieces: list[Piece]) -> bool:
        """Move the buffer's text before `marker` into `pieces` as content. True: the buffer now starts with the
        marker; False: it holds no marker (all of it went out, but for a tail that may begin one, unless `final`)."""
        at = self.buffer.find(marker)
        if at >= 0:
            if at:
                pieces.append(TextPiece(self.take(at)))
            return True
        keep = 0 if final else partial_suffix(self.buffer, marker)
        if len(self.buffer) > keep:
            pieces.append(TextPiece(self.take(len(self.buffer) - keep)))
        return False

    # ---- the interface the serving uses -----------------------------------------------------------------------------
    def feed(self, text: str) -> DeltaMessage:
        """What the output's next `text` decides."""
        self.buffer += text
        return self._emit(self.parse(final=False))

    def finish(self) -> DeltaMessage:
        """Everything still held, at the end of the output (a call left incomplete is content)."""
        out = self._emit(self.parse(final=True))
        assert not self.buffer, f"{type(self).__name__}.parse(final=True) left text in the buffer"
        if self.num_calls == 0:
            out.content += self._pending_ws
        self._pending_ws = ""
        return out

    def extract_tool_calls(self, model_output: str) -> ParsedMessage:
        """A whole output at once (on a new parser): content and calls."""
        return ParsedMessage().add(self.feed(model_output)).add(self.finish())

    def _emit(self, pieces: list[Piece]) -> DeltaMessage:
        out = DeltaMessage()
        for p in pieces:
            if isinstance(p, TextPiece):
                text = p.text
                if self._after_call:
                    text = text.lstrip()
                    if not text:
                        continue
                    self._after_call = False
                text = self._pending_ws + text
                body = text.rstrip()
                self._pending_ws = text[len(body):]
                out.content += body
            elif isinstance(p, CallPiece):
                self._pending_ws, self._after_call = "", True
                if self.max_calls is None or self.num_calls < self.max_calls:
                    out.tool_calls.append(DeltaToolCall(self.num_calls, self.make_tool_call_id(), p.name,
                                                        p.arguments))
                    self.num_calls += 1
        return out


_TOOL_PARSERS: ParserRegistry[type[ToolParser]] = ParserRegistry("tool-call parser", ToolParser)


class ToolParserManager:
    """The tool-call formats by name. Built-in: hermes, llama3_json, mistral (gateway/tool_parsers/)."""
    tool_parsers: ClassVar[dict[str, type[ToolParser]]] = _TOOL_PARSERS.parsers
    register_module = staticmethod(_TOOL_PARSERS.register)  # @ToolParserManager.register_module("name")
    list_registered = staticmethod(_TOOL_PARSERS.names)
    get_tool_parser = staticmethod(_TOOL_PARSERS.get)
