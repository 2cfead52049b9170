"""llama3_json: Llama 3.1 / 3.2 / 3.3 JSON tool calls (their JSON-based tool prompt), a JSON object that starts the
output, or that follows `<|python_tag|>`, several separated by `;`:

    {"name": "get_weather", "parameters": {"city": "Paris"}}
    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}

`arguments` is read where `parameters` is missing. An object that is not a call (no name, arguments not an object,
bad JSON) is content, as is anything after `<|python_tag|>` that is not a JSON object (Llama's built-in Python
tool calls)."""
from __future__ import annotations

from kvgate.gateway.tool_parsers.abstract_tool_parser import (
    ToolParser,
    ToolParserManager,
)
from kvgate.gateway.tool_parsers.utils import (
    JsonValueEnd,
    Piece,
    TextPiece,
    call_from_text,
)

START, TEXT, EXPECT_JSON, IN_JSON, BETWEEN = "start", "text", "expect_json", "in_json", "between"


@ToolParserManager.register_module("llama3_json")
class Llama3JsonToolParser(ToolParser):
    python_tag = "<|python_tag|>"
    keep_special_tokens = True  # <|python_tag|> is a special token: without it a call after text is not found

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._state = START
        self._prefix = ""  # the tag or `;` taken for the coming call: content again if no call follows
        self._scanner: JsonValueEnd | None = None

    def parse(self, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        while self.buffer:
            buf, state = self.buffer, self._state
            if state == IN_JSON:
                assert self._scanner is not None
                end = self._scanner.find(buf)
                if end is None and not final:
                    break
                text = self.take(len(buf) if end is None else end)
                call = call_from_text(text, ("parameters", "arguments")) if end is not None else None
                pieces.append(call if call is not None else TextPiece(self._prefix + text))
                self._prefix, self._state = "", BETWEEN if call is not None else TEXT
                continue
            if state == TEXT:
                if self.text_before(self.python_tag, final, pieces):
                    self._prefix, self._state = self.take(len(self.python_tag)), EXPECT_JSON
                    continue
                break
            # START, EXPECT_JSON, BETWEEN: what the first character after whitespace is decides
            rest = buf.lstrip()
            if not rest:
                if final:
                    pieces.append(TextPiece(self._prefix + self.take(len(buf))))
                    self._prefix = ""
                break
            ws = len(buf) - len(rest)
            if rest[0] == "{":
                if state == EXPECT_JSON:
                    self._prefix += self.take(ws)
                elif ws:
                    pieces.append(TextPiece(self.take(ws)))
                self._state, self._scanner = IN_JSON, JsonValueEnd(0)
            elif state == BETWEEN and rest[0] == ";":
                pieces.append(TextPiece(self.take(ws)))
                self._prefix, self._state = self.take(1), EXPECT_JSON
            elif state != EXPECT_JSON and rest.startswith(self.python_tag):
                pieces.append(TextPiece(self.take(ws)))
                self._prefix, self._state = self.take(len(self.python_tag)), EXPECT_JSON
            elif state != EXPECT_JSON and self.python_tag.startswith(rest) and not final:
                break  # may still become the tag
            else:
                pieces.append(TextPiece(self._prefix))
                self._prefix, self._state = "", TEXT
        return [p for p in pieces if not isinstance(p, TextPiece) or p.text]
