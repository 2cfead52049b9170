"""Tool calling through the SDK's public invoke() against the tools gateway (kvgate_server.py: a tiny random model
with a Qwen-style tools template, served with --enable-auto-tool-choice --tool-call-parser hermes).

A random model calls tools only when made to: the `tool_choice` parameter "required" has kvgate's guided decoding
produce calls, so these tests check what any model's calls must be (a name among the tools, arguments that
validate against its parameters), streamed and not, and that the default ("auto") sends the tools to the model's
template. A conversation with the calls and their results goes back to the model as OpenAI's history."""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest
from dify_helpers import (
    GUIDED_MAX_TOKENS,
    MODEL,
    TIME,
    TOOLS,
    TOOLS_MODEL,
    WEATHER,
    credentials,
    joined,
    marker,
    prompt,
    tool_calls,
    tools_credentials,
)
from dify_plugin.entities.model.message import AssistantPromptMessage, ToolPromptMessage, UserPromptMessage
from dify_plugin.errors.model import CredentialsValidateFailedError, InvokeBadRequestError

PARAMETERS = {t.name: t.parameters for t in TOOLS}
REQUIRED = {"tool_choice": "required", "max_tokens": GUIDED_MAX_TOKENS}


def assert_valid(call: AssistantPromptMessage.ToolCall) -> None:
    """A call Dify can run: an id, a name among the tools, arguments that validate against its parameters."""
    assert call.id and call.type == "function"
    assert call.function.name in PARAMETERS, call
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 1},
                                      {"temperature": 1.0, "seed": 2}])
def test_required_tool_choice_returns_a_valid_call(gateways: Any, llm: Callable[[], Any],
                                                   sampling: dict[str, Any]) -> None:
    text = f"Weather in Paris? {marker()}"
    creds = tools_credentials(gateways["tools"], function_calling_type="single_tool_call")
    (chunk,) = llm().invoke(TOOLS_MODEL, creds, prompt(text), {**REQUIRED, **sampling}, tools=TOOLS, stream=False)
    (call,) = chunk.delta.message.tool_calls
    assert_valid(call)
    assert chunk.delta.usage.completion_tokens > 0
    (record,) = gateways.engine_records(text.split()[-1])
    assert record["guided"]["kind"] == "json" and record["guided"]["spec"]["maxItems"] == 1  # one call per turn
    assert '"name": "get_weather"' in record["prompt"] and "<tools>" in record["prompt"]


def test_streamed_calls_arrive_complete_and_equal_the_blocking_ones(gateways: Any, llm: Callable[[], Any]) -> None:
    """Several calls per turn: a random model keeps adding calls until kvgate's guided decoding closes the array
    within max_tokens (a few calls here), each streamed as OpenAI's fragments; Dify gets them whole, in one chunk."""
    text = f"What time is it in Berlin? {marker()}"
    creds = tools_credentials(gateways["tools"])
    params = {**REQUIRED, "max_tokens": 200, "temperature": 0}
    blocking = tool_calls(llm().invoke(TOOLS_MODEL, creds, prompt(text), dict(params), tools=TOOLS, stream=False))
    chunks = list(llm().invoke(TOOLS_MODEL, creds, prompt(text), dict(params), tools=TOOLS, stream=True))
    streamed = tool_calls(chunks)
    assert streamed
    for s, b in zip(streamed, blocking, strict=True):
        assert_valid(s)
        assert (s.function.name, s.function.arguments) == (b.function.name, b.function.arguments)
    assert len({c.id for c in streamed}) == len(streamed)
    assert sum(1 for c in chunks if c.delta.message.tool_calls) == 1  # assembled: one chunk with whole calls
    _, usage, finish, _ = joined(chunks)
    assert finish == "tool_calls" and usage.completion_tokens <= 200
    records = gateways.engine_records(text.split()[-1])
    assert "maxItems" not in records[0]["guided"]["spec"]  # several calls per turn: parallel_tool_calls left on


def test_auto_is_the_default_and_sends_the_tools_to_the_template(gateways: Any, llm: Callable[[], Any]) -> None:
    text = f"Weather in Rome? {marker()}"
    chunks = list(llm().invoke(TOOLS_MODEL, tools_credentials(gateways["tools"]), prompt(text),
                               {"max_tokens": 6, "temperature": 0}, tools=TOOLS))
    _, usage, finish, _ = joined(chunks)
    assert usage.completion_tokens <= 6 and finish in ("length", "stop", "tool_calls")
    for call in tool_calls(chunks):  # whatever a random model writes: a call the hermes parser found is whole
        assert call.function.name in PARAMETERS
    (record,) = gateways.engine_records(text.split()[-1])
    assert record["guided"] is None  # the model decides
    assert json.dumps({"type": "function", "function": {"name": TIME.name, "description": TIME.description,
                                                        "parameters": TIME.parameters}}) in record["prompt"]


@pytest.mark.parametrize("stream", [True, False])
def test_a_tool_result_goes_back_as_openai_history(gateways: Any, llm: Callable[[], Any], stream: bool) -> None:
    """An agent's turn: the model calls a tool, Dify runs it and sends the call and its result back."""
    text = f"Weather in Paris? {marker()}"
    creds = tools_credentials(gateways["tools"], function_calling_type="single_tool_call")
    (first,) = llm().invoke(TOOLS_MODEL, creds, prompt(text), {**REQUIRED, "temperature": 0}, tools=[WEATHER],
                            stream=False)
    (call,) = first.delta.message.tool_calls
    history = [*prompt(text), AssistantPromptMessage(content="", tool_calls=[call]),
               ToolPromptMessage(content="21 °C, sunny", tool_call_id=call.id)]
    answer, usage, _, _ = joined(llm().invoke(TOOLS_MODEL, creds, history, {"max_tokens": 5, "temperature": 0},
                                              tools=[WEATHER], stream=stream))
    assert usage.completion_tokens <= 5
    record = gateways.engine_records(text.split()[-1])[-1]
    arguments = json.dumps(json.loads(call.function.arguments))  # the template writes them as an object
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>' in record["prompt"]
    assert "<|im_start|>user\n<tool_response>\n21 °C, sunny\n</tool_response><|im_end|>" in record["prompt"]
    assert llm().get_num_tokens(TOOLS_MODEL, creds, history) > 0


def test_function_calling_is_checked_when_the_model_is_saved(gateways: Any, llm: Callable[[], Any]) -> None:
    llm().validate_credentials(TOOLS_MODEL, tools_credentials(gateways["tools"]))
    with pytest.raises(CredentialsValidateFailedError, match="function calling is on for this model.*"
                                                             "--enable-auto-tool-choice"):
        llm().validate_credentials(MODEL, credentials(gateways["main"], function_calling_type="tool_call"))
    with pytest.raises(CredentialsValidateFailedError, match="function_calling_type tool_call needs mode chat"):
        llm().validate_credentials(MODEL, credentials(gateways["main"], mode="completion",
                                                      function_calling_type="tool_call"))


def test_a_bad_tool_is_the_gateways_bad_request(gateways: Any, llm: Callable[[], Any]) -> None:
    twice = [WEATHER, WEATHER]
    with pytest.raises(InvokeBadRequestError, match="kvgate answered 400: .*'get_weather' is given twice"):
        list(llm().invoke(TOOLS_MODEL, tools_credentials(gateways["tools"]), [UserPromptMessage(content="hi")],
                          {"max_tokens": 3}, tools=twice))
