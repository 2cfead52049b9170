"""One request's outputs on its caller's event loop, merged while unread (vLLM's RequestOutputCollector idea).

The engine thread hands over a step's outputs in one call per event loop; a stream keeps only the latest state:
a DELTA output that arrives before the consumer read the previous one is appended to it (text, token ids,
logprobs), any other kind replaces it (it already holds everything). A consumer that falls behind, say an HTTP
stream to a slow client or an event loop busy with 200 clients, then reads one output per turn holding several
tokens, instead of a backlog of one-token outputs, each costing a wake-up and a chunk.
"""
from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from kvgate.engine.detokenizer import OutputDetokenizer
from kvgate.engine.outputs import CompletionOutput, RequestOutput


def merge_delta(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    """`new` appended to the unread DELTA output `old` (samples matched by index)."""
    by_index = {o.index: o for o in old.outputs}
    merged: list[CompletionOutput] = []
    for o in new.outputs:
        prev = by_index.pop(o.index, None)
        if prev is None:
            merged.append(o)
            continue
        logprobs = None if prev.logprobs is None and o.logprobs is None else (prev.logprobs or []) + (o.logprobs or [])
        merged.append(replace(o, text=prev.text + o.text, token_ids=prev.token_ids + o.token_ids, logprobs=logprobs))
    merged.extend(by_index.values())  # samples the new output did not mention (nothing new for them)
    merged.sort(key=lambda c: c.index)
    return replace(new, outputs=merged)


class RequestOutputStream:
    """Filled on the event loop (`push`, scheduled by the engine thread), read by one consumer (`get`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, delta: bool) -> None:
        self.loop = loop
        self.delta = delta
        self.prompt: tuple[str | None, list[int]] | None = None  # filled into outputs that come without it
        self.detokenizer: OutputDetokenizer | None = None  # fills the text of outputs that come without it, as
        # they are read
        self._pending: RequestOutput | BaseException | None = None
        self._waiter: asyncio.Future | None = None  # the consumer's while it waits in get() (a bare future:
        # an asyncio.Event's set/wait/clear showed as ~10% of a busy API process's samples)

    def push(self, item: RequestOutput | BaseException) -> None:
        if isinstance(self._pending, BaseException):
            return  # an error ends the stream: nothing after it matters
        if isinstance(self._pending, RequestOutput) and isinstance(item, RequestOutput) and self.delta:
            item = merge_delta(self._pending, item)
        self._pending = item
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> RequestOutput:
        """The next output (several steps' worth if they arrived unread); raises the error that ended the stream."""
        if self._pending is None:
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item, self._pending = self._pending, None
        if isinstance(item, BaseException):
            raise item
        assert item is not None
        if self.detokenizer is not None:  # here, not on the thread that reads the core's pipe: that thread keeps
            self.detokenizer.fill(item)  # up with the core, and merged outputs are detokenized once
        return item


def push_on_loop(loop: asyncio.AbstractEventLoop, items: list[tuple[RequestOutputStream, Any]]) -> bool:
    """Push (stream, output or error) items into their streams on `loop`, from another thread, in one call; False
    (nothing pushed) when that loop is closed."""
    def push_all() -> None:
        for stream, item in items:
            stream.push(item)

    try:
        loop.call_soon_threadsafe(push_all)
    except RuntimeError:
        return False
    return True


def settle(fut: asyncio.Future, error: BaseException | None, value: Any) -> None:
    """Give a future its result or error (on its own loop), unless its caller gave up on it already."""
    if not fut.done():
        fut.set_exception(error) if error is not None else fut.set_result(value)
