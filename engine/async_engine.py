"""AsyncLLMEngine: the engine loop on its own thread, asyncio streams for callers.

The event loop never waits on a model step: requests and aborts go to the engine thread through a queue, and
outputs come back with `call_soon_threadsafe` into one asyncio.Queue per request. Cancelling a stream (client
gone) aborts its request, which frees its KV blocks on the engine thread's next turn.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from kvgate.engine.config import EngineArgs
from kvgate.engine.llm_engine import LLMEngine, PromptType
from kvgate.engine.outputs import RequestOutput
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.sequence import DEFAULT_PRIORITY

logger = logging.getLogger(__name__)


@dataclass
class AsyncEngineArgs(EngineArgs):
    """EngineArgs for the async engine (same fields: AsyncEngineArgs(model=..., scheduler_delay=0.05, ...))."""


class EngineDeadError(RuntimeError):
    pass


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncLLMEngine:
    def __init__(self, args: EngineArgs, start: bool = True) -> None:
        self.args = args
        self.engine: LLMEngine | None = None
        self.load_error: BaseException | None = None
        self._ready = threading.Event()
        self._inbox: queue.Queue[Callable[[], None]] = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="kvgate-engine", daemon=True)
        if start:
            self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "AsyncLLMEngine":
        """Starts loading at once on the engine thread; `is_ready` / `wait_until_ready()` tell when it is done."""
        return cls(args)

    # ---- state -------------------------------------------------------------------------------------------------
    @property
    def is_ready(self) -> bool:
        return self._ready.is_set() and self.engine is not None

    @property
    def is_dead(self) -> bool:
        return self.load_error is not None or (self._ready.is_set() and not self._thread.is_alive())

    async def wait_until_ready(self, timeout: float | None = None) -> None:
        ok = await asyncio.to_thread(self._ready.wait, timeout)
        if self.load_error is not None:
            raise EngineDeadError(f"the engine failed to load: {self.load_error}") from self.load_error
        if not ok:
            raise TimeoutError(f"the engine did not load within {timeout} s")

    def shutdown(self) -> None:
        self._stopped = True
        self._inbox.put(lambda: None)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)

    # ---- requests ----------------------------------------------------------------------------------------------
    async def generate(self, prompt: PromptType, sampling_params: SamplingParams, request_id: str,
                       priority: int = DEFAULT_PRIORITY, max_batch_delay: float | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Stream this request's outputs; raises ValueError for invalid input (nothing is left behind)."""
        if self.is_dead:
            raise EngineDeadError("the engine is not running")
        if not self.is_ready:
            await self.wait_until_ready()
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._streams[request_id] = stream

        def add() -> None:
            try:
                self.engine.add_request(request_id, prompt, sampling_params, priority, max_batch_delay)
            except Exception as e:  # invalid input: report it to this caller only
                self._streams.pop(request_id, None)
                stream.put(e)

        self._inbox.put(add)
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:  # cancelled or the consumer stopped early: free its blocks now
                self.abort(request_id)

    @property
    def num_requests(self) -> int:
        """Requests accepted and not finished (counted on the caller's side, so it is exact at admission)."""
        return len(self._streams)

    def abort(self, request_id: str) -> None:
        def do() -> None:
            self._streams.pop(request_id, None)
            if self.engine is not None:
                self.engine.abort_request(request_id)

        self._inbox.put(do)

    def call(self, fn: Callable[[LLMEngine], Any]) -> "asyncio.Future[Any]":
        """Run fn(engine) on the engine thread between steps (for stats, tokenization, tests)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()

        def do() -> None:
            try:
                result = fn(self.engine)
            except Exception as e:
                loop.call_soon_threadsafe(fut.set_exception, e)
            else:
                loop.call_soon_threadsafe(fut.set_result, result)

        self._inbox.put(do)
        return fut

    # ---- the engine thread ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.engine = LLMEngine.from_engine_args(self.args)
        except BaseException as e:  # noqa: BLE001 - reported through is_dead / wait_until_ready
            self.load_error = e
            logger.error("engine failed to load: %s", e)
            return
        finally:
            self._ready.set()
        self.engine.sleep_when_held = False  # wait on the inbox instead, so new requests join the held batch
        while not self._stopped:
            wake = self.engine.scheduler.next_wakeup
            if not self.engine.has_unfinished_requests():
                self._drain(timeout=0.5)
            elif wake is not None:
                self._drain(timeout=max(0.0, wake - time.monotonic()))
            else:
                self._drain(timeout=None)
            if self._stopped or not self.engine.has_unfinished_requests():
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a failed step fails the requests in it, never the loop
                logger.exception("engine step failed")
                self._fail_all(e)
                continue
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream.put(out)
                    if out.finished:
                        del self._streams[out.request_id]

    def _drain(self, timeout: float | None) -> None:
        """Run every queued call; wait up to `timeout` seconds for the first one (None: do not wait)."""
        try:
            item = self._inbox.get(timeout=timeout) if timeout else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            item()
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _fail_all(self, error: Exception) -> None:
        for rid in list(self.engine.requests):
            self.engine.abort_request(rid)
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.put(RuntimeError(f"internal engine error: {error}"))

