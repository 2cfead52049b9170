"""The engine requests of one API request (one per prompt of /v1/completions), run together: every one enters the
engine at once (so the scheduler batches them, as vLLM does), their outputs come back as one stream in arrival
order, and the first failure, or the caller going away, aborts the rest before it propagates, so no KV block
outlives the API request."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Generic, TypeVar

T = TypeVar("T")
_DONE = object()


class RequestGroup(Generic[T]):
    """Drives each of `streams` (the engine's per-request output iterators) on a task of its own, all started on
    the same turn of the event loop. Iterate it for the outputs in arrival order; `started()` first, to see every
    request's first output (or its failure) before anything is sent to the client; `aclose()` always."""

    def __init__(self, streams: list[AsyncIterator[T]]) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._open = len(streams)
        self._buffer: list[T] = []
        self._tasks = [asyncio.ensure_future(self._pump(i, s)) for i, s in enumerate(streams)]

    async def _pump(self, i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for out in stream:
                self._queue.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - handed to the reader, which raises it
            self._queue.put_nowait((i, e))
            return
        self._queue.put_nowait((i, _DONE))

    async def _next(self, seen: set[int] | None = None) -> T | None:
        """The next output of any request (None once all have ended); raises the first failure."""
        while self._open:
            i, item = await self._queue.get()
            if seen is not None:
                seen.add(i)
            if item is _DONE:
                self._open -= 1
                continue
            if isinstance(item, Exception):
                self._open = 0
                raise item
            return item
        return None

    async def started(self) -> list[T]:
        """Wait until every request gave its first output or ended; return the outputs read meanwhile (they are
        iterated again). Raises the first failure (the caller then aclose()s the group)."""
        seen: set[int] = set()
        while len(seen) < len(self._tasks) and self._open:
            out = await self._next(seen)
            if out is not None:
                self._buffer.append(out)
        return self._buffer

    async def __aiter__(self) -> AsyncIterator[T]:
        buffered, self._buffer = self._buffer, []
        for out in buffered:
            yield out
        while (out := await self._next()) is not None:
            yield out

    async def aclose(self) -> None:
        """Cancel the requests still running (each one's iterator aborts its engine request) and wait for them."""
        pending = [t for t in self._tasks if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
