"""Reading answers built by hand: reasoning as Dify shows it (a gateway in front of a reasoning model sends
`reasoning_content` / vLLM's newer `reasoning`), and tool calls assembled from OpenAI's streamed fragments, in the
shapes servers send them (several calls interleaved, no index, arguments as an object)."""
from __future__ import annotations

import pytest
from dify_plugin.errors.model import InvokeServerUnavailableError
from models.llm.responses import Answer, StreamState, blocking_answer, sse_events
from models.llm.tool_calls import ToolCallAssembler


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
    assert blocking_answer(body, "chat") == Answer(text, [], "stop", None)


def test_blocking_reasoning_and_completion_text() -> None:
    body = {"choices": [{"message": {"content": "Paris.", "reasoning_content": "capital"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4}}
    assert blocking_answer(body, "chat").text == "<think>\ncapital\n</think>Paris."
    assert blocking_answer({"choices": [{"text": " Paris", "finish_reason": "length"}]}, "completion") == Answer(
        " Paris", [], "length", None)


def test_sse_events_stop_at_done_and_raise_error_events() -> None:
    lines = [": keep-alive", "", 'data: {"choices": []}', "event: ignored", "data: [DONE]", 'data: {"late": 1}']
    assert list(sse_events(lines)) == [{"choices": []}]
    with pytest.raises(InvokeServerUnavailableError, match="kvgate failed mid-stream: engine died"):
        list(sse_events(['data: {"error": {"message": "engine died", "code": 500}}']))


def fragment(index: int | None, id: str | None = None, name: str | None = None, arguments: str = "") -> dict:
    call: dict = {} if index is None else {"index": index}
    if id is not None:
        call.update(id=id, type="function")
    call["function"] = {"arguments": arguments, **({"name": name} if name is not None else {})}
    return call


def calls_of(calls: list) -> list[tuple[str, str, str]]:
    return [(c.id, c.function.name, c.function.arguments) for c in calls]


def test_streamed_tool_call_fragments_assemble_into_whole_calls() -> None:
    state = StreamState("chat")
    events = [chat_event(reasoning="look it up"),
              {"choices": [{"index": 0, "delta": {"tool_calls": [fragment(0, "call_a", "get_weather")]}}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [fragment(0, arguments='{"city": ')]}}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [fragment(1, "call_b", "get_time", '{"zone"'),
                                                                 fragment(0, arguments='"Paris"}')]}}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [fragment(1, arguments=': "CET"}')]},
                            "finish_reason": "tool_calls"}]}]
    shown = [state.feed(e) for e in events]
    assert shown == ["<think>\nlook it up", "\n</think>", "", "", ""]  # the first call closes the think tag
    assert state.finish_reason == "tool_calls"
    assert calls_of(state.calls()) == [("call_a", "get_weather", '{"city": "Paris"}'),
                                       ("call_b", "get_time", '{"zone": "CET"}')]


def test_fragments_without_index_and_calls_without_id() -> None:
    assembler = ToolCallAssembler()
    assembler.feed([fragment(None, "call_a", "f", "{")])
    assembler.feed([fragment(None, arguments="}")])
    assembler.feed([fragment(None, None, "g", "{}")])  # a new name after a named call: the next call
    (a, b) = assembler.calls()
    assert (a.id, a.function.name, a.function.arguments) == ("call_a", "f", "{}")
    assert b.function.name == "g" and b.id.startswith("call_")  # an id made up: Dify answers a call by its id
    broken = ToolCallAssembler()
    broken.feed([fragment(0, arguments="{}")])
    with pytest.raises(ValueError, match="tool call 0 came without a function name"):
        broken.calls()


def test_blocking_tool_calls_and_object_arguments() -> None:
    body = {"choices": [{"finish_reason": "tool_calls", "message": {"content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
        {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": {"b": "é"}}}]}}]}
    answer = blocking_answer(body, "chat")
    assert answer.text == "" and answer.finish_reason == "tool_calls"
    assert calls_of(answer.tool_calls) == [("call_1", "f", '{"a": 1}'), ("call_2", "g", '{"b": "é"}')]
