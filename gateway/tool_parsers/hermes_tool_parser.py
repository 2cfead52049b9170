"""hermes: calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes 2 Pro / 3, Qwen2.5, Qwen3,
SmolLM2 and most ChatML tool templates), any number of them, after optional content:

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
    </tool_call>

SmolLM2's template asks for a list of calls in one tag (`<tool_call>[{"name": ...}, ...]</tool_call>`): read too. A
call whose closing tag never comes is read up to the end of the output (as vLLM does); one whose body is not a JSON
object with a name and object arguments (or a list of them) is content, tags included."""
from __future__ import annotations

from kvgate.gateway.tool_parsers.abstract_tool_parser import (
    ToolParser,
    ToolParserManager,
)
from kvgate.gateway.tool_parsers.utils import (
    Piece,
    TextPiece,
    calls_from_text,
)


@ToolParserManager.register_module("hermes")
class HermesToolParser(ToolParser):
    start_tag = "<tool_call>"
    end_tag = "</tool_call>"
    keep_special_tokens = True  # <tool_call> is a special token in some tokenizers (Hermes 2 Pro)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._in_call = False  # the buffer starts with start_tag
        self._search_from = 0  # where to look for end_tag next (the text before cannot hold it)

    def parse(self, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        while self.buffer:
            buf = self.buffer
            if self._in_call:
                end = buf.find(self.end_tag, self._search_from)
                if end < 0 and not final:
                    self._search_from = max(len(self.start_tag), len(buf) - len(self.end_tag) + 1)
                    break
                stop = len(buf) if end < 0 else end + len(self.end_tag)
                body = buf[len(self.start_tag):len(buf) if end < 0 else end]
                whole = self.take(stop)
                self._in_call = False
                calls = calls_from_text(body)
                pieces += calls if calls is not None else [TextPiece(whole)]
                continue
            if self.text_before(self.start_tag, final, pieces):
                self._in_call, self._search_from = True, len(self.start_tag)
                continue
            break
        return pieces
