"""Structured output through the SDK's public invoke(): the response_format and json_schema parameters (offered when
the form turns structured output on) become OpenAI's response_format, and kvgate's guided decoding makes the tools
gateway's random model answer JSON that validates, streamed and not."""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest
from dify_helpers import GUIDED_MAX_TOKENS, TOOLS_MODEL, joined, marker, prompt, tools_credentials
from dify_plugin.errors.model import InvokeBadRequestError

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome", "Berlin"]},
    "population": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,6}$"}, "maxItems": 2}},
    "required": ["city", "population", "tags"], "additionalProperties": False}


@pytest.mark.parametrize("parameters", [
    # what Dify's structured output sends for a model with the structured-output feature
    {"response_format": "json_schema", "json_schema": json.dumps({"schema": SCHEMA, "name": "llm_response"})},
    # what a user may type into the JSON Schema box (a bare schema, response_format left unset)
    {"json_schema": json.dumps(SCHEMA)},
])
def test_json_schema_answers_validate(gateways: Any, llm: Callable[[], Any], parameters: dict[str, Any]) -> None:
    text = f"Describe a city. {marker()}"
    creds = tools_credentials(gateways["tools"])
    answers = []
    for stream, sampling in ((False, {"temperature": 0}), (True, {"temperature": 0}),
                             (False, {"temperature": 1.0, "seed": 3})):
        got, usage, _, _ = joined(llm().invoke(TOOLS_MODEL, creds, prompt(text), {
            **parameters, **sampling, "max_tokens": GUIDED_MAX_TOKENS}, stream=stream))
        jsonschema.validate(json.loads(got), SCHEMA)
        assert usage.completion_tokens < GUIDED_MAX_TOKENS
        answers.append(got)
    assert answers[0] == answers[1]  # streamed as blocking
    records = gateways.engine_records(text.split()[-1])
    assert [r["guided"] for r in records] == [{"kind": "json", "spec": SCHEMA}] * 3


def test_json_object(gateways: Any, llm: Callable[[], Any]) -> None:
    text = f"Any JSON {marker()}"
    got, _, finish, _ = joined(llm().invoke(TOOLS_MODEL, tools_credentials(gateways["tools"]), prompt(text), {
        "response_format": "json_object", "max_tokens": GUIDED_MAX_TOKENS, "temperature": 0}))
    assert got.startswith("{")
    if finish == "stop":  # any object: a random model may write one past max_tokens
        assert isinstance(json.loads(got), dict)
    assert gateways.engine_records(text.split()[-1])[0]["guided"]["kind"] == "json_object"


@pytest.mark.parametrize("parameters, message", [
    ({"response_format": "json_schema"}, "response_format json_schema needs the json_schema parameter"),
    ({"json_schema": "{not json"}, "json_schema is not valid JSON"),
    ({"json_schema": "[1, 2]"}, "json_schema must be a JSON object"),
    ({"response_format": "json_object", "json_schema": json.dumps(SCHEMA)},
     "json_schema is set but response_format is json_object"),
    ({"json_schema": json.dumps({"type": "object", "properties": {"a": {"type": 12}}})},
     "kvgate answered 400: response_format.json_schema.schema is not a valid JSON schema"),
])
def test_bad_schemas_are_bad_requests(gateways: Any, llm: Callable[[], Any], parameters: dict[str, Any],
                                      message: str) -> None:
    with pytest.raises(InvokeBadRequestError, match=message):
        list(llm().invoke(TOOLS_MODEL, tools_credentials(gateways["tools"]), prompt("x"),
                          {**parameters, "max_tokens": 5}))
