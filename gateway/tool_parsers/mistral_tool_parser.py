"""mistral: Mistral's `[TOOL_CALLS]` calls, in both of its formats, after optional content:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

The first is Mistral 7B v0.3 / Mixtral / Nemo (tokenizers before v11), the second Mistral Small 3.2, Magistral,
Devstral (v11 and later; a `[CALL_ID]id` after the name is skipped). Call ids are 9 alphanumerics, the only ones
Mistral's chat templates accept back. A list holding anything but calls, a name that is not a plain identifier, or
arguments that are not a JSON object are content, `[TOOL_CALLS]` included."""
from __future__ import annotations

import json
import re
import secrets
import string

from kvgate.gateway.tool_parsers.abstract_tool_parser import (
    ToolParser,
    ToolParserManager,
)
from kvgate.gateway.tool_parsers.utils import (
    JsonValueEnd,
    Piece,
    TextPiece,
    call_from_object,
    calls_from_text,
)

TEXT, AFTER_TOKEN, IN_LIST, NAME, EXPECT_ARGS, IN_ARGS = "text", "after_token", "in_list", "name", "expect", "args"
MAX_NAME = 256  # characters between [TOOL_CALLS] and [ARGS]: more, and it is not a call
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


@ToolParserManager.register_module("mistral")
class MistralToolParser(ToolParser):
    bot_token = "[TOOL_CALLS]"
    args_token = "[ARGS]"
    call_id_token = "[CALL_ID]"
    keep_special_tokens = True  # [TOOL_CALLS] and [ARGS] are control tokens

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._state = TEXT
        self._taken = ""  # the marker and name taken for the coming call: content again if it is malformed
        self._name = ""
        self._scanner: JsonValueEnd | None = None

    def make_tool_call_id(self) -> str:
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))

    def _malformed(self, pieces: list[Piece], text: str = "") -> None:
        pieces.append(TextPiece(self._taken + text))
        self._taken, self._state = "", TEXT

    def _skip_space(self, pieces: list[Piece], final: bool) -> str | None:
        """Take the buffer's leading whitespace into the call's text; the rest of the buffer, or None when nothing
        else has come yet (at the end: the call is malformed)."""
        rest = self.buffer.lstrip()
        if not rest:
            if final:
                self._malformed(pieces, self.take(len(self.buffer)))
            return None
        self._taken += self.take(len(self.buffer) - len(rest))
        return rest

    def parse(self, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        while self.buffer:
            buf, state = self.buffer, self._state
            if state == TEXT:
                if self.text_before(self.bot_token, final, pieces):
                    self._taken, self._state = self.take(len(self.bot_token)), AFTER_TOKEN
                    continue
                break
            if state == AFTER_TOKEN:  # "[": the list format; anything else: a name
                rest = self._skip_space(pieces, final)
                if rest is None:
                    break
                if rest[0] == "[":
                    self._state, self._scanner = IN_LIST, JsonValueEnd(0)
                else:
                    self._state = NAME
                continue
            if state in (IN_LIST, IN_ARGS):
                assert self._scanner is not None
                end = self._scanner.find(buf)
                if end is None and not final:
                    break
                text = self.take(len(buf) if end is None else end)
                calls = None if end is None else (self._list_calls(text) if state == IN_LIST else self._args_call(text))
                if calls is None:
                    self._malformed(pieces, text)
                else:
                    pieces += calls
                    self._taken, self._state = "", TEXT
                continue
            if state == NAME:
                at = buf.find(self.args_token)
                if at < 0:
                    if final or len(buf) > MAX_NAME or "\n" in buf:
                        self._malformed(pieces)
                    break
                name = buf[:at].strip()
                name = name.split(self.call_id_token, 1)[0].strip()
                self._taken += self.take(at + len(self.args_token))
                if not _NAME.fullmatch(name):
                    self._malformed(pieces)
                    continue
                self._name, self._state = name, EXPECT_ARGS
                continue
            if state == EXPECT_ARGS:
                rest = self._skip_space(pieces, final)
                if rest is None:
                    break
                if rest[0] != "{":
                    self._malformed(pieces)
                    continue
                self._state, self._scanner = IN_ARGS, JsonValueEnd(0)
        return pieces

    def _list_calls(self, text: str) -> list[Piece] | None:
        calls = calls_from_text(text) if text.lstrip().startswith("[") else None
        return list(calls) if calls is not None else None

    def _args_call(self, text: str) -> list[Piece] | None:
        try:
            args = json.loads(text)
        except (ValueError, RecursionError):
            return None
        call = call_from_object({"name": self._name, "arguments": args})
        return [call] if call is not None and isinstance(args, dict) else None
