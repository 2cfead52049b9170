"""Reasoning as Dify shows it, on answers built by hand: kvgate's tiny test model never reasons, but a gateway
in front of a reasoning model (a remote vLLM with a reasoning parser) sends `reasoning_content` / `reasoning`."""
from __future__ import annotations

import pytest
from dify_plugin.errors.model import InvokeServerUnavailableError
from models.llm.responses import StreamState, blocking_answer, sse_events


def chat_event(content: str | None = None, reasoning: str | None = None, key: str = "reasoning_content",
               finish: str | None = None) -> dict:
    delta = {k: v for k, v in (("content", content), (key, reasoning)) if v is not None}
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


@pytest.mark.parametrize("key", ["reasoning_content", "reasoning"])
def test_streamed_reasoning_is_wrapped_in_think_tags(key: str) -> None:
    state = StreamState("chat")
    pieces = [state.feed(chat_event(reasoning="Paris is ", key=key)), state.feed(chat_event(reasoning="it.", key=key)),
              state.feed(chat_event(content="Paris")), state.feed(chat_event(content=".", finish="stop")),
              state.feed({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 6}})]
    assert pieces == ["<think>\nParis is ", "it.", "\n</think>Paris", ".", ""]
    assert state.text + state.finish() == "<think>\nParis is it.\n</think>Paris."
    assert state.finish_reason == "stop" and state.usage == {"prompt_tokens": 5, "completion_tokens": 6}


def test_a_stream_that_ends_while_reasoning_closes_the_tag() -> None:
    state = StreamState("chat")
    state.feed(chat_event(reasoning="hmm"))
    assert state.feed(chat_event(finish="length")) == "\n</think>"
    assert state.finish() == "" and state.text == "<think>\nhmm\n</think>"


def test_a_models_own_think_tags_pass_through() -> None:
    state = StreamState("chat")
    text = "<think>\nshort\n</think>Paris."
    assert state.feed(chat_event(content=text, finish="stop")) == text and state.finish() == ""
    body = {"choices": [{"message": {"content": text}, "finish_reason": "stop"}], "usage": None}
    assert blocking_answer(body, "chat") == (text, "stop", None)


def test_blocking_reasoning_and_completion_text() -> None:
    body = {"choices": [{"message": {"content": "Paris.", "reasoning_content": "capital"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4}}
    assert blocking_answer(body, "chat")[0] == "<think>\ncapital\n</think>Paris."
    assert blocking_answer({"choices": [{"text": " Paris", "finish_reason": "length"}]}, "completion") == (
        " Paris", "length", None)


def test_sse_events_stop_at_done_and_raise_error_events() -> None:
    lines = [": keep-alive", "", 'data: {"choices": []}', "event: ignored", "data: [DONE]", 'data: {"late": 1}']
    assert list(sse_events(lines)) == [{"choices": []}]
    with pytest.raises(InvokeServerUnavailableError, match="kvgate failed mid-stream: engine died"):
        list(sse_events(['data: {"error": {"message": "engine died", "code": 500}}']))
