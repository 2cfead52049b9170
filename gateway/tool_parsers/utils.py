"""Helpers the tool-call parsers share: where a JSON value ends in text that is still growing, how much of a text's
end could be the start of a marker, and a tool call from a decoded JSON object."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_IN_STRING = re.compile(r'[^"\\]*')  # characters that cannot end a string or start an escape
_OUTSIDE = re.compile(r'[^"{}\[\]]*')  # characters that cannot change the nesting
_SCALAR_END = re.compile(r'[,}\]\s]')


@dataclass
class TextPiece:
    """Text of the output that is not a tool call: content."""
    text: str


@dataclass
class CallPiece:
    """A complete, well-formed tool call found in the output; `arguments` is JSON text of an object."""
    name: str
    arguments: str


Piece = TextPiece | CallPiece


class JsonValueEnd:
    """Finds where the JSON value that starts at `start` ends, in a text that grows between calls: call `find(text)`
    with the same text, longer each time; it resumes where it stopped. Objects, arrays and strings end at their
    closing character (strings and escapes inside are skipped); a scalar ends before the first `,`, `}`, `]` or
    whitespace. Not a validator: json.loads judges the value once its end is known."""

    def __init__(self, start: int) -> None:
        self.start, self.pos = start, start
        self.depth, self.in_string, self.scalar = 0, False, None

    def find(self, text: str) -> int | None:
        """The index just past the value, or None while `text` ends inside it."""
        i, n = self.pos, len(text)
        if i == self.start and i < n and self.scalar is None:
            self.scalar = text[i] not in '{["'
        if self.scalar:
            m = _SCALAR_END.search(text, max(i, self.start + 1))
            self.pos = n if m is None else m.start()
            return None if m is None else m.start()
        while i < n:
            if self.in_string:
                i = _IN_STRING.match(text, i).end()
                if i >= n:
                    break
                if text[i] == "\\":
                    if i + 1 >= n:  # the escaped character has not arrived yet
                        break
                    i += 2
                    continue
                self.in_string = False
                i += 1
                if self.depth == 0:
                    self.pos = i
                    return i
                continue
            i = _OUTSIDE.match(text, i).end()
            if i >= n:
                break
            c = text[i]
            i += 1
            if c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth <= 0:
                    self.pos = i
                    return i
        self.pos = i
        return None


def partial_suffix(text: str, *markers: str) -> int:
    """The length of the longest end of `text` that is the start (not the whole) of one of `markers`: what must be
    held back, since the next text may complete the marker."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


def call_from_object(obj: Any, argument_keys: tuple[str, ...] = ("arguments", "parameters")) -> CallPiece | None:
    """A call from a decoded `{"name": ..., "arguments": {...}}` (the arguments under the first of `argument_keys`
    present; missing: no arguments, `{}`); None unless the name is a non-empty string and the arguments are an
    object, or a string holding the JSON text of one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in argument_keys if k in obj), None)
    args = {} if key is None else obj[key]
    if isinstance(args, str):
        try:
            decoded = json.loads(args)
        except ValueError:
            return None
        return CallPiece(obj["name"], args) if isinstance(decoded, dict) else None
    if not isinstance(args, dict):
        return None
    return CallPiece(obj["name"], json.dumps(args, ensure_ascii=False))


def call_from_text(text: str, argument_keys: tuple[str, ...] = ("arguments", "parameters")) -> CallPiece | None:
    """call_from_object of the JSON `text` (None when it is not JSON)."""
    try:
        return call_from_object(json.loads(text), argument_keys)
    except (ValueError, RecursionError):
        return None


def calls_from_text(text: str, argument_keys: tuple[str, ...] = ("arguments", "parameters")) -> list[CallPiece] | None:
    """The calls of the JSON `text`: one call object, or a non-empty list of them; None unless every one is a
    well-formed call."""
    try:
        decoded = json.loads(text)
    except (ValueError, RecursionError):
        return None
    items = decoded if isinstance(decoded, list) and decoded else [decoded]
    calls = [call_from_object(item, argument_keys) for item in items]
    return None if any(c is None for c in calls) else calls  # type: ignore[return-value]
