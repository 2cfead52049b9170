"""Structured outputs and forced tool calls on the real engine (guided decoding, engine/structured_output/), through
the openai client and a real gateway on a tiny random model whose chat template renders tools: whatever the random
model would say, every response must match its schema, regex, choice or grammar, and forced tool calls must carry
schema-valid arguments. Schemas are bounded (enums, ranges, patterns of bounded length, maxItems), so that guided
decoding completes within max_tokens; a schema the grammar library refuses is a 400.

These tests need the engine's side of guided decoding: without it the engine ignores the constraint and they fail.
tests/test_tool_calling.py checks the gateway's side with recorded outputs."""
from __future__ import annotations

import asyncio
import json
import re
from typing import Any, Iterator

import httpx
import jsonschema
import openai
import pytest
from mock_upstream import serving
from test_tool_calling import USER, both, calls_of
from tool_helpers import TOOLS, WEATHER, build_tool_model

from kvgate.engine.async_engine import AsyncEngineArgs, AsyncLLMEngine
from kvgate.gateway.app import create_app
from kvgate.gateway.serving import OpenAIServing

SCHEMAS = {
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
             "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                                                  "admin": {"type": "boolean"}},
                 "required": ["name", "admin"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "array": {"type": "object", "properties": {"scores": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                                      "maximum": 9},
                                                          "minItems": 1, "maxItems": 3}},
              "required": ["scores"], "additionalProperties": False},
    "integer_range": {"type": "object", "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 99}},
                      "required": ["age"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
                "required": ["code"], "additionalProperties": False},
}
SAMPLING = [{"temperature": 0}, {"temperature": 1.0, "seed": 1}, {"temperature": 1.0, "seed": 2}]
MAX_TOKENS = 400  # the tiny tokenizer spends a token on every character or two of JSON


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model = build_tool_model(tmp_path_factory.mktemp("guided") / "model")
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
        model=model, num_gpu_blocks_override=256, enable_auto_tool_choice=True, tool_call_parser="hermes"))
    try:
        asyncio.run(engine.wait_until_ready(timeout=60))
        with serving(create_app({"tiny": OpenAIServing("tiny", engine)})) as url:
            yield url
    finally:
        engine.shutdown()


@pytest.fixture
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("name", SCHEMAS)
def test_json_schema_responses_validate(client: openai.OpenAI, name: str) -> None:
    schema = SCHEMAS[name]
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    for sampling in SAMPLING:
        r = client.chat.completions.create(model="tiny", messages=USER, response_format=fmt, max_tokens=MAX_TOKENS,
                                           **sampling)
        assert r.choices[0].finish_reason == "stop", (sampling, r.choices[0].message.content)
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    c = client.completions.create(model="tiny", prompt="JSON:", max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"guided_json": schema})
    jsonschema.validate(json.loads(c.choices[0].text), schema)


def test_choice_regex_grammar_and_json_object(client: openai.OpenAI) -> None:
    for sampling in SAMPLING:
        r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=50, **sampling,
                                           extra_body={"guided_choice": ["Paris", "Rome", "Berlin"]})
        assert r.choices[0].message.content in ("Paris", "Rome", "Berlin")
        r = client.completions.create(model="tiny", prompt="Code:", max_tokens=50, **sampling,
                                      extra_body={"guided_regex": "[A-Z]{2}-[0-9]{3}"})
        assert re.fullmatch("[A-Z]{2}-[0-9]{3}", r.choices[0].text)
        r = client.completions.create(model="tiny", prompt="Say:", max_tokens=50, **sampling,
                                      extra_body={"structured_outputs": {"grammar": 'root ::= "yes" | "no" | "maybe"'}})
        assert r.choices[0].text in ("yes", "no", "maybe")
        r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=MAX_TOKENS, **sampling,
                                           response_format={"type": "json_object"})
        text = r.choices[0].message.content
        assert text.startswith("{")
        if r.choices[0].finish_reason == "stop":  # any object: it may run past max_tokens
            assert isinstance(json.loads(text), dict)


def test_named_tool_choice_arguments_are_schema_valid(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    for sampling in SAMPLING:
        r = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice=named,
                                           max_tokens=MAX_TOKENS, **sampling)
        ((name, args),) = calls_of(r.choices[0].message)
        assert name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
        jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])


def test_required_tool_choice_calls_are_schema_valid(client: openai.OpenAI) -> None:
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for sampling in SAMPLING:
        r = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=MAX_TOKENS, **sampling)
        calls = calls_of(r.choices[0].message)
        assert len(calls) == 1 and r.choices[0].finish_reason == "tool_calls", r.choices[0].message
        jsonschema.validate(json.loads(calls[0][1]), params[calls[0][0]])


def test_streamed_tool_calls_equal_the_non_streamed_ones(client: openai.OpenAI) -> None:
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        full, streamed = both(client, model="tiny", messages=USER, tools=TOOLS, tool_choice=choice,
                              parallel_tool_calls=False, max_tokens=MAX_TOKENS, temperature=0)
        assert streamed == ("", "", calls_of(full.choices[0].message), full.choices[0].finish_reason)
        assert full.choices[0].finish_reason == "tool_calls"


def test_auto_finds_the_calls_of_a_forced_hermes_output(client: openai.OpenAI) -> None:
    regex = ('Checking\\.\n<tool_call>\n\\{"name": "get_weather", "arguments": \\{"city": "(Paris|Rome)", '
             '"unit": "celsius"\\}\\}\n</tool_call>')
    full, streamed = both(client, model="tiny", messages=USER, tools=TOOLS, max_tokens=MAX_TOKENS, temperature=0,
                          extra_body={"guided_regex": regex})
    m = full.choices[0].message
    assert m.content == "Checking." and full.choices[0].finish_reason == "tool_calls"
    ((name, args),) = calls_of(m)
    assert name == "get_weather" and json.loads(args)["city"] in ("Paris", "Rome")
    assert streamed == (m.content, "", calls_of(m), "tool_calls")


@pytest.mark.parametrize("fields, words", [
    ({"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}, "$defs"),
    ({"guided_regex": "(?<=a)b"}, "Lookbehind"),
    ({"guided_grammar": "rot ::= \"a\""}, "root"),
])
def test_what_the_grammar_library_refuses_is_a_400(base: str, fields: dict[str, Any], words: str) -> None:
    for path, body in (("chat/completions", {"messages": USER}), ("completions", {"prompt": "x"})):
        r = httpx.post(f"{base}/v1/{path}", json={"model": "tiny", "max_tokens": 5, **body, **fields}, timeout=60)
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}
