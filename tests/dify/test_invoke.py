"""The plugin's LLM through the SDK's public invoke(): streamed and blocking answers equal the gateway's own, with
the gateway's usage; stop words and sampling parameters reach the engine; token counts come from the gateway."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from dify_helpers import MODEL, credentials, gateway_post, joined, marker, openai_messages, prompt
from dify_plugin.entities.model import ModelPropertyKey
from dify_plugin.entities.model.message import UserPromptMessage


def test_stream_and_blocking_equal_the_gateways_answer_and_usage(gateways: Any, llm: Callable[[], Any]) -> None:
    text = f"What is the capital of France? {marker()}"
    direct = gateway_post(gateways["main"], "/v1/chat/completions", {
        "model": MODEL, "messages": openai_messages(text), "max_tokens": 12, "temperature": 0})
    creds = credentials(gateways["main"])

    chunks = list(llm().invoke(MODEL, creds, prompt(text), {"max_tokens": 12, "temperature": 0}, stream=True))
    streamed, usage, finish, count = joined(chunks)
    assert streamed == direct["choices"][0]["message"]["content"]
    assert count > 3 and all(c.delta.usage is None for c in chunks[:-1])  # pieces as they came, usage at the end
    assert (usage.prompt_tokens, usage.completion_tokens) == (direct["usage"]["prompt_tokens"], 12)
    assert usage.total_tokens == direct["usage"]["total_tokens"] and finish == "length"

    blocked, usage, _, count = joined(llm().invoke(MODEL, creds, prompt(text), {"max_tokens": 12, "temperature": 0},
                                                   stream=False))
    assert count == 1 and blocked == streamed
    assert (usage.prompt_tokens, usage.completion_tokens) == (direct["usage"]["prompt_tokens"], 12)
    assert llm().get_num_tokens(MODEL, creds, prompt(text)) == direct["usage"]["prompt_tokens"]


def test_completion_mode_sends_the_prompt_as_written(gateways: Any, llm: Callable[[], Any]) -> None:
    text = f"The capital of France is {marker()}"
    direct = gateway_post(gateways["main"], "/v1/completions", {
        "model": MODEL, "prompt": text, "max_tokens": 8, "temperature": 0})
    creds = credentials(gateways["main"], mode="completion")
    for stream in (True, False):
        got, usage, _, _ = joined(llm().invoke(MODEL, creds, [UserPromptMessage(content=text)],
                                               {"max_tokens": 8, "temperature": 0}, stream=stream))
        assert got == direct["choices"][0]["text"]
        assert usage.prompt_tokens == direct["usage"]["prompt_tokens"] and usage.completion_tokens == 8
    assert llm().get_num_tokens(MODEL, creds, [UserPromptMessage(content=text)]) == direct["usage"]["prompt_tokens"]
    assert llm().get_model_mode(MODEL, creds).value == "completion"


def test_stop_words_cut_the_answer(gateways: Any, llm: Callable[[], Any]) -> None:
    creds, text = credentials(gateways["main"]), f"Tell me a story {marker()}"
    full, _, _, _ = joined(llm().invoke(MODEL, creds, prompt(text), {"max_tokens": 16, "temperature": 0}))
    i = next(i for i in range(2, len(full) - 2) if "\ufffd" not in full[i:i + 2] and full[i:i + 2].strip())
    stop = full[i:i + 2]
    for stream in (True, False):
        cut, usage, finish, _ = joined(llm().invoke(MODEL, creds, prompt(text), {"max_tokens": 16, "temperature": 0},
                                                    stop=[stop], stream=stream))
        assert cut == full[:full.index(stop)]
        assert usage.completion_tokens < 16
        if stream:
            assert finish == "stop"
    record = gateways.engine_records(text.split()[-1])[-1]
    assert record["sampling"]["stop"] == [stop]


def test_sampling_parameters_reach_the_engine(gateways: Any, llm: Callable[[], Any]) -> None:
    text = f"Count to ten {marker()}"
    params = {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "presence_penalty": 0.5, "frequency_penalty": -0.25,
              "seed": 7, "max_tokens": 9}
    got, usage, _, _ = joined(llm().invoke(MODEL, credentials(gateways["main"]), prompt(text), dict(params)))
    direct = gateway_post(gateways["main"], "/v1/chat/completions", {
        "model": MODEL, "messages": openai_messages(text), **params})
    assert got == direct["choices"][0]["message"]["content"]  # same seed and parameters, same text
    plugin_record, direct_record = gateways.engine_records(text.split()[-1])
    assert plugin_record["sampling"] == direct_record["sampling"]
    assert {k: plugin_record["sampling"][k] for k in params} == params
    assert usage.completion_tokens == 9


def test_the_auto_model_goes_through_the_gateways_router(gateways: Any, llm: Callable[[], Any]) -> None:
    text = f"Route me {marker()}"
    creds = credentials(gateways["main"], endpoint_model_name="auto")
    got, usage, _, _ = joined(llm().invoke("my-dify-name", creds, prompt(text), {"max_tokens": 5}))
    assert usage.completion_tokens == 5 and got
    assert [r["server"] for r in gateways.engine_records(text.split()[-1])] == ["main"]


def test_model_schema_follows_the_credentials(gateways: Any, llm: Callable[[], Any]) -> None:
    creds = credentials(gateways["main"], context_size=512, max_tokens_to_sample=300)
    schema = llm().get_model_schema("any-name", creds)
    assert schema.model_properties[ModelPropertyKey.CONTEXT_SIZE] == 512
    assert schema.model_properties[ModelPropertyKey.MODE] == "chat"
    rules = {r.name: r for r in schema.parameter_rules}
    assert set(rules) == {"temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty", "max_tokens",
                          "seed"}
    assert rules["max_tokens"].max == 300 and rules["max_tokens"].default == 300
    with pytest.raises(ValueError, match="max_tokens should be less than or equal to 300"):
        list(llm().invoke(MODEL, creds, prompt("x"), {"max_tokens": 301}))
