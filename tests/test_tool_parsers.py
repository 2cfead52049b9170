"""Tool-call and reasoning parsers on recorded model outputs (the shapes Qwen2.5/3, Hermes 3, SmolLM2, Llama 3.1,
Mistral and DeepSeek-R1 produce): the whole output parsed at once, and the same output streamed per character, per
token of the tiny tokenizer and in random pieces, must give the same content, reasoning and calls (the calls'
argument fragments concatenate to the non-streamed arguments); malformed or cut-off calls come back as content."""
from __future__ import annotations

import json
import random
from typing import Any, Callable

import pytest
from tiny_models import _trained_tokenizer_json
from tokenizers import Tokenizer

from kvgate.gateway.chat_output import ChatOutputParser, message_of
from kvgate.gateway.delta_message import DeltaMessage, ParsedMessage
from kvgate.gateway.reasoning import ReasoningParser, ReasoningParserManager
from kvgate.gateway.tool_parsers import ToolParser, ToolParserManager
from kvgate.gateway.tool_parsers.forced_tool_calls import NamedToolCall, RequiredToolCalls
from kvgate.gateway.tool_parsers.utils import JsonValueEnd, TextPiece

W = '{"city": "Paris", "unit": "celsius"}'
T = '{"zone": "CET"}'
CALLS = [("get_weather", W), ("get_time", T)]
Expected = tuple[str, list[tuple[str, str]]]  # content, [(name, arguments)]

CASES: dict[str, list[tuple[str, Expected]]] = {
    "hermes": [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
         ("", CALLS[:1])),
        ('I will look both up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
         '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
         ("I will look both up.", CALLS)),
        ('<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, {"name": '
         '"get_time", "arguments": {"zone": "CET"}}]</tool_call>', ("", CALLS)),  # SmolLM2's list
        ('<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}', ("", [("get_time", T)])),
        ("Il fait beau à Paris : 21 °C 🙂\n\n", ("Il fait beau à Paris : 21 °C 🙂\n\n", [])),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call> sorry',
         ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call> sorry', [])),
        ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
         ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', [])),
        ("a < b and <tool_ x", ("a < b and <tool_ x", [])),
        ('<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
         '"arguments": {"zone": "CET"}}\n</tool_call>',
         ('<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>', [("get_time", T)])),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', ("", CALLS[:1])),
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
         '{"name": "get_time", "parameters": {"zone": "CET"}}', ("", CALLS)),
        ('Sure.<|python_tag|>{"name": "get_time", "arguments": {"zone": "CET"}}', ("Sure.", [("get_time", T)])),
        ("It is sunny in Paris.", ("It is sunny in Paris.", [])),
        ('<|python_tag|>brave_search.call(query="weather Paris")',
         ('<|python_tag|>brave_search.call(query="weather Paris")', [])),
        ('{"answer": 42}', ('{"answer": 42}', [])),
        ('{"name": "get_weather", "parameters": {"city": "Par', ('{"name": "get_weather", "parameters": {"city": "Par',
                                                               [])),
        ("  <|python", ("  <|python", [])),
    ],
    "mistral": [
        ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, {"name": '
         '"get_time", "arguments": {"zone": "CET"}}]', ("", CALLS)),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}',
         ("", CALLS)),
        ('Let me check. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}',
         ("Let me check.", CALLS[:1])),
        ('[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"zone": "CET"}', ("", [("get_time", T)])),
        ('[TOOL_CALLS]get weather[ARGS]{"city": "Paris"}', ('[TOOL_CALLS]get weather[ARGS]{"city": "Paris"}', [])),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Pa', ('[TOOL_CALLS]get_weather[ARGS]{"city": "Pa', [])),
        ('[TOOL_CALLS] ["get_weather"]', ('[TOOL_CALLS] ["get_weather"]', [])),
        ("Paris is sunny [TOOL", ("Paris is sunny [TOOL", [])),
    ],
}
_TOKENIZER = Tokenizer.from_str(_trained_tokenizer_json())


def token_pieces(text: str) -> list[str]:
    """`text` as the tiny tokenizer's tokens would stream it (incremental decoding: a token that ends inside a
    multi-byte character waits for the next)."""
    ids = _TOKENIZER.encode(text).ids
    pieces, sent = [], ""
    for k in range(len(ids)):
        now = _TOKENIZER.decode(ids[:k + 1])
        if now.endswith("\ufffd") and k < len(ids) - 1:
            continue
        pieces.append(now[len(sent):])
        sent = now
    assert "".join(pieces) == text
    return pieces


def splits(text: str) -> dict[str, list[str]]:
    rng = random.Random(len(text))
    chunks, i = [], 0
    while i < len(text):
        n = rng.randint(1, 7)
        chunks.append(text[i:i + n])
        i += n
    return {"whole": [text], "chars": list(text), "tokens": token_pieces(text), "random": chunks}


def stream(make: Callable[[], Any], pieces: list[str]) -> tuple[ParsedMessage, list[DeltaMessage]]:
    parser, deltas = make(), []
    for p in pieces:
        deltas.append(parser.feed(p))
    deltas.append(parser.finish())
    msg = ParsedMessage()
    for d in deltas:
        msg.add(d)
    return msg, deltas


def shape(msg: ParsedMessage) -> tuple[str, str, list[tuple[str, str]]]:
    return msg.reasoning_content, msg.content, [(c.name, c.arguments) for c in msg.tool_calls]


def check_call_deltas(deltas: list[DeltaMessage]) -> None:
    """OpenAI's delta shape: a call's first fragment has its id and name, the later ones only arguments."""
    seen: set[int] = set()
    for d in deltas:
        for c in d.tool_calls:
            assert (c.id is not None and c.name is not None) == (c.index not in seen), d
            seen.add(c.index)
    assert sorted(seen) == list(range(len(seen)))


@pytest.mark.parametrize("name, text, expected", [(n, t, e) for n, cases in CASES.items() for t, e in cases],
                         ids=[f"{n}-{i}" for n, cases in CASES.items() for i in range(len(cases))])
def test_parser_streamed_any_way_equals_the_whole_output(name: str, text: str, expected: Expected) -> None:
    cls = ToolParserManager.get_tool_parser(name)
    whole = cls().extract_tool_calls(text)
    assert shape(whole) == ("", *expected)
    for how, pieces in splits(text).items():
        msg, deltas = stream(cls, pieces)
        assert shape(msg) == shape(whole), how
        check_call_deltas(deltas)
    if expected[1]:
        for c in whole.tool_calls:
            json.loads(c.arguments)
            assert (len(c.id) == 9 and c.id.isalnum()) if name == "mistral" else c.id.startswith("call_")


def test_text_is_streamed_as_it_comes_and_only_a_possible_marker_is_held() -> None:
    p = ToolParserManager.get_tool_parser("hermes")()
    assert p.feed("Hello ").content == "Hello"  # the trailing space waits: a call may follow it
    assert p.feed("world <tool").content == " world"
    assert p.feed("_call>{").content == ""
    assert p.feed('"name": "get_time", "arguments": {}}').tool_calls == []  # a call is sent once complete
    d = p.feed("</tool_call>")
    assert [(c.index, c.name, c.arguments) for c in d.tool_calls] == [(0, "get_time", "{}")]
    assert p.finish().content == ""


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    p = ToolParserManager.get_tool_parser("hermes")(max_calls=1)
    msg = p.extract_tool_calls(CASES["hermes"][1][0])
    assert shape(msg) == ("", "I will look both up.", CALLS[:1])


def test_named_and_required_readers_stream_arguments_as_they_come() -> None:
    named = NamedToolCall("get_weather")
    first = named.feed('{"city": ')
    assert [(c.index, c.name, c.arguments) for c in first.tool_calls] == [(0, "get_weather", '{"city": ')]
    assert first.tool_calls[0].id.startswith("call_")
    assert named.feed('"Paris"}').tool_calls[0].arguments == '"Paris"}'
    text = f'[{{"name":"get_weather","parameters":{W}}}, {{"name": "get_time", "parameters": {T}}}]'
    required = RequiredToolCalls()
    d = required.feed(text[:44])  # the first call's header and part of its arguments
    assert d.tool_calls[0].name == "get_weather" and d.tool_calls[0].arguments == text[36:44] == W[:8]
    for how, pieces in splits(text).items():
        msg, deltas = stream(RequiredToolCalls, pieces)
        assert shape(msg) == ("", "", CALLS), how
        check_call_deltas(deltas)
    cut = stream(RequiredToolCalls, splits(text[:50])["tokens"])[0]  # cut off by max_tokens: what it got
    assert shape(cut) == ("", "", [("get_weather", W[:14])])
    other_order = '[{"parameters": {"zone": "CET"}, "name": "get_time"}]'
    assert shape(stream(RequiredToolCalls, list(other_order))[0]) == ("", "", [("get_time", T)])
    assert shape(stream(RequiredToolCalls, ["not json"])[0]) == ("", "not json", [])


REASONING: dict[str, list[tuple[str, tuple[str, str]]]] = {
    "deepseek_r1": [
        ("<think>\nThe user asks for the capital of France. That is Paris.\n</think>\n\nThe capital is Paris.",
         ("The user asks for the capital of France. That is Paris.", "The capital is Paris.")),
        ("Paris is in France.\n</think>\n\nParis.", ("Paris is in France.", "Paris.")),  # the prompt opened <think>
        ("Still thinking about </thi", ("Still thinking about </thi", "")),  # cut off while thinking
    ],
    "qwen3": [
        ("<think>\nOkay, Paris.\n</think>\n\nParis.", ("Okay, Paris.", "Paris.")),
        ("Paris.", ("", "Paris.")),  # thinking off
        ("<think>\n\n</think>\n\nParis.", ("", "Paris.")),
        ("<thinking is not the token>", ("", "<thinking is not the token>")),
    ],
}


@pytest.mark.parametrize("name, text, expected", [(n, t, e) for n, cases in REASONING.items() for t, e in cases],
                         ids=[f"{n}-{i}" for n, cases in REASONING.items() for i in range(len(cases))])
def test_reasoning_parser_streamed_any_way_equals_the_whole_output(name: str, text: str,
                                                                   expected: tuple[str, str]) -> None:
    cls = ReasoningParserManager.get_reasoning_parser(name)
    whole = cls().extract_reasoning_content(text)
    assert (whole.reasoning_content, whole.content) == expected
    for how, pieces in splits(text).items():
        assert shape(stream(cls, pieces)[0]) == (*expected, []), how


def test_reasoning_then_tool_calls_and_the_message() -> None:
    text = ('<think>\nThe user wants the weather; I have a tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>')
    qwen3 = ReasoningParserManager.get_reasoning_parser("qwen3")
    hermes = ToolParserManager.get_tool_parser("hermes")
    for how, pieces in splits(text).items():
        parser = ChatOutputParser(qwen3(), hermes())
        msg, _ = stream(lambda: parser, pieces)
        assert shape(msg) == ("The user wants the weather; I have a tool.", "", CALLS[:1]), how
        assert parser.finish_reason("stop") == "tool_calls" and parser.finish_reason("length") == "length"
    message = message_of(ChatOutputParser(qwen3(), hermes()).parse(text), with_reasoning=True)
    assert message["content"] is None and message["reasoning_content"].startswith("The user wants")
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": W}
    plain = message_of(ChatOutputParser(None, hermes()).parse("Hi"), with_reasoning=False)
    assert plain == {"role": "assistant", "content": "Hi"}


def test_registries_take_new_formats_by_decorator_and_list_names_in_errors() -> None:
    @ToolParserManager.register_module("test_bracket")
    class BracketParser(ToolParser):  # a made-up format: CALL name {json}
        def parse(self, final: bool) -> list:
            text = self.take(len(self.buffer)) if final else ""
            return [TextPiece(text)] if text else []

    assert ToolParserManager.get_tool_parser("test_bracket") is BracketParser
    assert BracketParser().extract_tool_calls("x").content == "x"
    with pytest.raises(ValueError, match="already registered"):
        ToolParserManager.register_module("hermes")(BracketParser)
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope': the registered ones are hermes, "):
        ToolParserManager.get_tool_parser("nope")

    @ReasoningParserManager.register_module("test_reason")
    class Reason(ReasoningParser):
        start_token, end_token = "<reason>", "</reason>"

    assert Reason().extract_reasoning_content("<reason>a</reason>b").reasoning_content == "a"
    with pytest.raises(ValueError, match="unknown reasoning parser 'x': the registered ones are deepseek_r1, qwen3"):
        ReasoningParserManager.get_reasoning_parser("x")
    del ToolParserManager.tool_parsers["test_bracket"], ReasoningParserManager.reasoning_parsers["test_reason"]


def test_json_value_end_resumes_and_skips_strings() -> None:
    text = '{"a": "}{\\"", "b": [1, {"c": "]"}]} tail'
    scanner = JsonValueEnd(0)
    found = [scanner.find(text[:k]) for k in range(1, len(text) + 1)]
    end = text.index(" tail")
    assert found[end - 1] == end and all(f is None for f in found[:end - 1])
    assert json.loads(text[:end])["b"][1] == {"c": "]"}
