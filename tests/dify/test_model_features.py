"""The LLM's features and parameters follow its form (function calling, stream function calling, structured output,
thinking), and reasoning that the gateway sends separately (`reasoning_content`, from the tools gateway's
THINK_MODEL, served with a reasoning parser) is shown inside <think> tags, as Dify's agent view reads it."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from dify_helpers import (
    MODEL,
    THINK_MODEL,
    TOOLS_CONTEXT,
    credentials,
    gateway_post,
    joined,
    marker,
    openai_messages,
    prompt,
)
from dify_plugin.entities.model import ModelFeature
from dify_plugin.errors.model import CredentialsValidateFailedError

SAMPLING = {"temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty", "max_tokens", "seed"}
F = ModelFeature


@pytest.mark.parametrize("form, features, parameters", [
    ({}, [], set()),
    ({"function_calling_type": "tool_call"}, [F.TOOL_CALL, F.MULTI_TOOL_CALL, F.STREAM_TOOL_CALL], {"tool_choice"}),
    ({"function_calling_type": "single_tool_call", "stream_function_calling": "not_supported"}, [F.TOOL_CALL],
     {"tool_choice"}),
    ({"stream_function_calling": "supported"}, [], set()),  # nothing to stream without function calling
    ({"structured_output_support": "supported"}, [F.STRUCTURED_OUTPUT], {"response_format", "json_schema"}),
    ({"agent_thought_support": "only_thinking_supported"}, [F.AGENT_THOUGHT], set()),
    ({"agent_thought_support": "supported"}, [F.AGENT_THOUGHT], {"enable_thinking"}),
    ({"function_calling_type": "tool_call", "structured_output_support": "supported",
      "agent_thought_support": "supported"},
     [F.TOOL_CALL, F.MULTI_TOOL_CALL, F.STREAM_TOOL_CALL, F.STRUCTURED_OUTPUT, F.AGENT_THOUGHT],
     {"tool_choice", "response_format", "json_schema", "enable_thinking"}),
])
def test_features_and_parameters_follow_the_form(gateways: Any, llm: Callable[[], Any], form: dict[str, str],
                                                 features: list[ModelFeature], parameters: set[str]) -> None:
    schema = llm().get_model_schema("any-name", credentials(gateways["main"], **form))
    assert schema.features == features
    rules = {r.name: r for r in schema.parameter_rules}
    assert set(rules) == SAMPLING | parameters
    if "tool_choice" in rules:
        assert rules["tool_choice"].options == ["auto", "required"] and rules["tool_choice"].default == "auto"
    if "response_format" in rules:
        assert rules["response_format"].options == ["text", "json_object", "json_schema"]
        assert rules["json_schema"].type.value == "text"


@pytest.mark.parametrize("form, message", [
    ({"function_calling_type": "function_call"},
     "function_calling_type must be one of no_call, tool_call, single_tool_call, got 'function_call'"),
    ({"structured_output_support": "yes"}, "structured_output_support must be one of supported, not_supported"),
    ({"mode": "completion", "agent_thought_support": "supported"},
     "agent_thought_support supported .* needs mode chat"),
])
def test_bad_feature_fields_are_refused_when_saved(gateways: Any, llm: Callable[[], Any], form: dict[str, str],
                                                   message: str) -> None:
    with pytest.raises(CredentialsValidateFailedError, match=message):
        llm().validate_credentials(MODEL, credentials(gateways["main"], **form))
    assert llm().get_model_schema(MODEL, credentials(gateways["main"], **form)).features == []  # the UI stays usable


def test_parameters_of_features_that_are_off_are_not_sent(gateways: Any, llm: Callable[[], Any]) -> None:
    text = f"JSON please {marker()}"
    joined(llm().invoke(MODEL, credentials(gateways["main"]), prompt(text),
                        {"response_format": "json_object", "enable_thinking": False, "max_tokens": 3}))
    (record,) = gateways.engine_records(text.split()[-1])
    assert record["guided"] is None and "<think>" not in record["prompt"]


def test_separate_reasoning_is_shown_in_think_tags(gateways: Any, llm: Callable[[], Any]) -> None:
    text = f"Why is the sky blue? {marker()}"
    params = {"max_tokens": 10, "temperature": 0}
    direct = gateway_post(gateways["tools"], "/v1/chat/completions",
                          {"model": THINK_MODEL, "messages": openai_messages(text), **params})
    message = direct["choices"][0]["message"]
    assert message["reasoning_content"]  # the deepseek_r1 parser reads an output without </think> as reasoning
    shown = f"<think>\n{message['reasoning_content']}\n</think>{message['content'] or ''}"
    creds = credentials(gateways["tools"], context_size=TOOLS_CONTEXT, agent_thought_support="only_thinking_supported")
    for stream in (True, False):
        got, usage, _, _ = joined(llm().invoke(THINK_MODEL, creds, prompt(text), dict(params), stream=stream))
        assert got == shown and usage.completion_tokens == 10


def test_the_thinking_switch_reaches_the_chat_template(gateways: Any, llm: Callable[[], Any]) -> None:
    creds = credentials(gateways["tools"], context_size=TOOLS_CONTEXT, agent_thought_support="supported")
    for enable, empty_think_block in ((False, True), (True, False)):
        text = f"Hello {marker()}"
        joined(llm().invoke(THINK_MODEL, creds, prompt(text), {"enable_thinking": enable, "max_tokens": 2}))
        (record,) = gateways.engine_records(text.split()[-1])
        assert record["prompt"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") == empty_think_block
