"""ReasoningParser, the base of every reasoning format, and ReasoningParserManager, the registry of formats by name
(vLLM's names: `@ReasoningParserManager.register_module("name")` on a subclass makes `--reasoning-parser name` use
it).

A parser splits one choice's output, as it arrives (`feed(text)` per step, `finish()` at the end), into the
reasoning (the text between `start_token` and `end_token`) and the content after it, as DeltaMessages with
reasoning_content and content. The text that may be the start of a token is held back until it is known; the
whitespace just inside the thinking block and just after it is dropped. The whole output parsed at once gives
exactly what the steps give together."""
from __future__ import annotations

from typing import Any, ClassVar

from kvgate.gateway.delta_message import DeltaMessage, ParsedMessage
from kvgate.gateway.parser_registry import ParserRegistry
from kvgate.gateway.tool_parsers.utils import partial_suffix

__all__ = ["ReasoningParser", "ReasoningParserManager"]
OPENING, REASONING, CONTENT = "opening", "reasoning", "content"


class ReasoningParser:
    """`starts_in_reasoning`: the output is reasoning from its first token, `start_token` or not (the chat
    template opened the block in the prompt: DeepSeek-R1); otherwise only an output that starts with
    `start_token` has reasoning (Qwen3, whose thinking can be switched off). A block never closed (the output was
    cut off) is all reasoning. Parsers are per choice and used once."""
    name: ClassVar[str] = ""
    start_token: ClassVar[str] = "<think>"
    end_token: ClassVar[str] = "</think>"
    starts_in_reasoning: ClassVar[bool] = False

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self.buffer = ""
        self._state = OPENING
        self._trim = True  # drop the leading whitespace of the next text (the start of a block)
        self._pending_ws = ""  # the reasoning's trailing whitespace, held until more reasoning follows it

    def feed(self, text: str) -> DeltaMessage:
        self.buffer += text
        return self._parse(final=False)

    def finish(self) -> DeltaMessage:
        out = self._parse(final=True)
        self.buffer = self._pending_ws = ""
        return out

    def extract_reasoning_content(self, model_output: str) -> ParsedMessage:
        """A whole output at once (on a new parser): reasoning_content and content."""
        return ParsedMessage().add(self.feed(model_output)).add(self.finish())

    def _text(self, text: str) -> str:
        if self._trim:
            text = text.lstrip()
            self._trim = not text
        return text

    def _parse(self, final: bool) -> DeltaMessage:
        out = DeltaMessage()
        while self.buffer:
            buf = self.buffer
            if self._state == OPENING:
                rest = buf.lstrip()
                if rest.startswith(self.start_token):
                    self.buffer, self._state = rest[len(self.start_token):], REASONING
                elif (not rest or self.start_token.startswith(rest)) and not final:
                    break
                else:
                    self._state = REASONING if self.starts_in_reasoning else CONTENT
                    self._trim = self.starts_in_reasoning
                continue
            if self._state == REASONING:
                end = buf.find(self.end_token)
                if end < 0:
                    keep = 0 if final else partial_suffix(buf, self.end_token)
                    text = self._text(self._pending_ws + buf[:len(buf) - keep])
                    body = text.rstrip()
                    self._pending_ws = text[len(body):]
                    out.reasoning_content += body
                    self.buffer = buf[len(buf) - keep:]
                    break
                out.reasoning_content += self._text(self._pending_ws + buf[:end]).rstrip()
                self.buffer, self._state, self._trim, self._pending_ws = buf[end + len(self.end_token):], CONTENT, \
                    True, ""
                continue
            out.content += self._text(buf)
            self.buffer = ""
        return out


_REASONING_PARSERS: ParserRegistry[type[ReasoningParser]] = ParserRegistry("reasoning parser", ReasoningParser)


class ReasoningParserManager:
    """The reasoning formats by name. Built-in: deepseek_r1, qwen3 (gateway/reasoning/)."""
    reasoning_parsers: ClassVar[dict[str, type[ReasoningParser]]] = _REASONING_PARSERS.parsers
    register_module = staticmethod(_REASONING_PARSERS.register)  # @ReasoningParserManager.register_module("name")
    list_registered = staticmethod(_REASONING_PARSERS.names)
    get_reasoning_parser = staticmethod(_REASONING_PARSERS.get)
