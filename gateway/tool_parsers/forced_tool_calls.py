"""The output of a request whose tool_choice forces calls, read as tool calls. Guided decoding makes the output
match the schema built in gateway/tool_choice.py, so the calls can stream as they are generated (no holding back,
unlike the parsers of `auto`):

- NamedToolCall (tool_choice {"type": "function", "function": {"name": NAME}}): the output is NAME's arguments.
- RequiredToolCalls (tool_choice "required"): the output is `[{"name": ..., "parameters": {...}}, ...]`; each call's
  id and name go out once `{"name": "...", "parameters":` has arrived, then the arguments as they come.

A call cut off by max_tokens keeps the arguments it got (finish_reason "length", as OpenAI does). Output that is
not the expected JSON at all (only possible without guided decoding) is content from where it stops matching."""
from __future__ import annotations

import json
import re

from kvgate.gateway.delta_message import (
    DeltaMessage,
    DeltaToolCall,
    random_tool_call_id,
)
from kvgate.gateway.tool_parsers.utils import JsonValueEnd, call_from_text

_HEADER = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:')


class NamedToolCall:
    """One call of a known function; its arguments are the whole output."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.num_calls = 0

    def feed(self, text: str) -> DeltaMessage:
        if not text:
            return DeltaMessage()
        if self.num_calls == 0:
            self.num_calls = 1
            return DeltaMessage(tool_calls=[DeltaToolCall(0, random_tool_call_id(), self.name, text)])
        return DeltaMessage(tool_calls=[DeltaToolCall(0, None, None, text)])

    def finish(self) -> DeltaMessage:
        return DeltaMessage()


START, ITEM, HEADER, ARGS_START, ARGS, OBJECT_END, SEPARATOR, DONE, TEXT = range(9)


class RequiredToolCalls:
    """A JSON array of {"name", "parameters"} objects, read as it arrives."""

    def __init__(self) -> None:
        self.buffer = ""
        self.num_calls = 0
        self._state = START
        self._item: JsonValueEnd | None = None  # the whole current object (when its header is not the usual one)
        self._value: JsonValueEnd | None = None  # the current call's parameters, from the start of the buffer
        self._sent = 0  # characters of those parameters sent so far

    def feed(self, text: str) -> DeltaMessage:
        self.buffer += text
        return self._parse()

    def finish(self) -> DeltaMessage:
        out = self._parse()
        if self.buffer and self._state in (HEADER, TEXT):  # an unfinished object, or text that is not the array
            out.content += self.buffer
        self.buffer = ""
        return out

    def _skip_to(self, chars: str) -> str | None:
        """The first character after whitespace (whitespace removed) if it is one of `chars`; "" while only
        whitespace has arrived; None (the output stops matching) otherwise."""
        rest = self.buffer.lstrip()
        if not rest:
            self.buffer = ""
            return ""
        self.buffer = rest
        return rest[0] if rest[0] in chars else None

    def _parse(self) -> DeltaMessage:
        out = DeltaMessage()
        while self.buffer:
            state = self._state
            if state == TEXT:
                out.content += self.buffer
                self.buffer = ""
                break
            if state in (START, ITEM, ARGS_START, OBJECT_END, SEPARATOR, DONE):
                expect = {START: "[", ITEM: "{", ARGS_START: '{["-0123456789tfn', OBJECT_END: "}", SEPARATOR: ",]",
                          DONE: ""}[state]
                c = self._skip_to(expect)
                if c == "":
                    break
                if c is None:
                    if state == DONE:  # after the array: nothing more is expected; drop what follows
                        self.buffer = ""
                        break
                    self._state = TEXT
                    continue
                if state == ARGS_START:
                    self._state, self._value, self._sent = ARGS, JsonValueEnd(0), 0
                    continue
                self.buffer = self.buffer[1:]
                if state == ITEM:
                    self.buffer = "{" + self.buffer
                    self._state, self._item = HEADER, JsonValueEnd(0)
                else:
                    self._state = {START: ITEM, OBJECT_END: SEPARATOR, SEPARATOR: ITEM if c == "," else DONE}[state]
                continue
            if state == HEADER:
                m = _HEADER.match(self.buffer)
                if m is not None:
                    self.buffer = self.buffer[m.end():]
                    out.tool_calls.append(DeltaToolCall(self.num_calls, random_tool_call_id(), json.loads(m[1])))
                    self.num_calls += 1
                    self._state = ARGS_START
                    continue
                assert self._item is not None
                end = self._item.find(self.buffer)
                if end is None:
                    break  # at the end, finish() returns the unfinished object as content
                call = call_from_text(self.buffer[:end], ("parameters", "arguments"))
                if call is None:
                    self._state = TEXT
                    continue
                self.buffer = self.buffer[end:]
                out.tool_calls.append(DeltaToolCall(self.num_calls, random_tool_call_id(), call.name, call.arguments))
                self.num_calls += 1
                self._state = SEPARATOR
                continue
            if state == ARGS:
                assert self._value is not None
                end = self._value.find(self.buffer)
                cut = len(self.buffer) if end is None else end
                if cut > self._sent:
                    out.add(DeltaMessage(tool_calls=[DeltaToolCall(self.num_calls - 1, None, None,
                                                                   self.buffer[self._sent:cut])]))
                self._sent = cut
                if end is None:
                    break
                self.buffer, self._sent, self._state = self.buffer[end:], 0, OBJECT_END
        return out
