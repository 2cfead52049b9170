"""The SSE stream of chat and completions: one builder for both APIs (chunks, the usage chunk, [DONE]), with the
per-API choice passed in, and the ChunkTemplate fast path for the common one-sample case."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import AsyncIterable, AsyncIterator, Awaitable, Callable

from kvgate.engine.outputs import CompletionOutput, RequestOutput

# (choice index, prompt index, the sample's new output) -> the choice to send, or None when there is nothing to send
ChoiceFormat = Callable[[int, int, CompletionOutput], "dict | None"]


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def usage(prompt: int, completion: int, cached: int = 0) -> dict:
    """OpenAI's usage; `cached`: prompt tokens whose KV came from the prefix cache (or its offload tier)."""
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class ChunkTemplate:
    """The SSE chunks of one stream that differ only in one text field, rendered exactly as `sse(payload)` would
    render them, for the cost of encoding that string (the streaming hot path: one chunk per token or so)."""
    MARK = "\x00kvgate-text\x00"

    def __init__(self, payload: dict) -> None:  # payload holds MARK where the text goes
        self.head, found, self.tail = sse(payload).partition(json.dumps(self.MARK, ensure_ascii=False))
        assert found, "the payload must hold ChunkTemplate.MARK"

    def __call__(self, text: str) -> str:
        return self.head + json.dumps(text, ensure_ascii=False) + self.tail


@dataclass
class StreamSpec:
    """One SSE stream: its envelope (`rid`, `object`, `model`), `n` samples per prompt (choice index =
    prompt index * n + sample index, as OpenAI and vLLM number them), `prompt_index` (engine request id -> prompt
    index; None for one prompt), `choice` (the API's choice for a new output), `plain_choice` (where given: the
    choice of a plain one-sample text delta, holding ChunkTemplate.MARK for the text: the fast path),
    `opening` (choices of a first chunk, e.g. chat's role delta), and the usage chunk's prompt tokens."""
    rid: str
    object: str
    model: str
    n: int
    prompt_tokens: int
    include_usage: bool
    choice: ChoiceFormat
    plain_choice: dict | None = None
    opening: list[dict] | None = None
    prompt_index: dict[str, int] | None = None


class SSEStream:
    """The SSE text of one stream (an async iterator of str) whose aclose() runs `close` even when the stream was
    never iterated (the client went away before the response started): the engine requests behind it are always
    aborted. `close` must be idempotent."""

    def __init__(self, chunks: AsyncIterator[str], close: Callable[[], Awaitable[None]]) -> None:
        self._chunks, self._close = chunks, close

    def __aiter__(self) -> AsyncIterator[str]:
        return self._chunks  # iterated directly: no extra hop per chunk on the streaming hot path

    async def __anext__(self) -> str:
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        try:
            await self._chunks.aclose()  # type: ignore[attr-defined]
        finally:
            await self._close()


def stream_chunks(spec: StreamSpec, first: list[RequestOutput], outs: AsyncIterable[RequestOutput],
                  close: Callable[[], Awaitable[None]]) -> SSEStream:
    """The SSE text of a stream: `spec.opening`, then a chunk per output (`first`, already read, then `outs`) that
    has something to send, the usage chunk if asked for, and [DONE]. `close()` runs however the stream ends (the
    client gone included, before or after it started): it aborts whatever is still running in the engine."""
    return SSEStream(_chunks(spec, first, outs, close), close)


async def _chunks(spec: StreamSpec, first: list[RequestOutput], outs: AsyncIterable[RequestOutput],
                  close: Callable[[], Awaitable[None]]) -> AsyncIterator[str]:
    envelope = {"id": spec.rid, "object": spec.object, "created": int(time.time()), "model": spec.model}
    plain = ChunkTemplate({**envelope, "choices": [spec.plain_choice]}) if spec.plain_choice is not None else None
    completion = 0
    cached: dict[str, int] = {}  # engine request id -> its prompt tokens found in the prefix cache

    def chunk(choices: list[dict], **extra: object) -> str:
        return sse({**envelope, "choices": choices, **extra})

    def render(out: RequestOutput) -> str | None:
        nonlocal completion
        cached[out.request_id] = out.num_cached_tokens
        if plain is not None and len(out.outputs) == 1 and out.outputs[0].finish_reason is None:
            o = out.outputs[0]  # the common case: one sample, text, not the end
            completion += len(o.token_ids)
            return plain(o.text) if o.text else None
        k = spec.prompt_index[out.request_id] if spec.prompt_index is not None else 0
        choices = []
        for o in out.outputs:
            completion += len(o.token_ids)
            choice = spec.choice(k * spec.n + o.index, k, o)
            if choice is not None:
                choices.append(choice)
        return chunk(choices) if choices else None

    try:
        if spec.opening:
            yield chunk(spec.opening)
        for out in first:
            if (text := render(out)) is not None:
                yield text
        async for out in outs:
            if (text := render(out)) is not None:
                yield text
        if spec.include_usage:
            yield chunk([], usage=usage(spec.prompt_tokens, completion, sum(cached.values())))
        yield sse("[DONE]")
    finally:
        await close()
