"""AsyncLLMEngine: the engine loop on its own thread, asyncio streams for callers.

The event loop never waits on a model step: requests and aborts go to the engine thread through a queue, and
each step's outputs come back in one `call_soon_threadsafe` per event loop into one RequestOutputStream per
request (engine/output_stream.py: unread DELTA outputs are merged, so a busy loop is not flooded). Cancelling a stream (client
gone) aborts its request, which frees its KV blocks on the engine thread's next turn. After every step the engine
thread publishes an EngineStats snapshot (`stats`), so readers on other threads never touch live engine state.
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
from kvgate.engine.output_stream import RequestOutputStream
from kvgate.engine.outputs import RequestOutput
from kvgate.engine.sampling_params import RequestOutputKind, SamplingParams
from kvgate.engine.sequence import DEFAULT_PRIORITY
from kvgate.engine.stats import EngineStats, snapshot

logger = logging.getLogger(__name__)


@dataclass
class AsyncEngineArgs(EngineArgs):
    """EngineArgs for the async engine (same fields: AsyncEngineArgs(model=..., scheduler_delay=0.05, ...))."""


# Engines load one at a time: loading touches process-wide state (torch's default dtype and seed, transformers'
# lazy imports, which fail when two threads trigger them at once), so several models in one process would race.
_LOAD_LOCK = threading.Lock()


class EngineDeadError(RuntimeError):
    pass


class AsyncLLMEngine:
    def __init__(self, args: EngineArgs, start: bool = True,
                 on_loaded: Callable[["AsyncLLMEngine"], None] | None = None) -> None:
        self.args = args
        self.engine: LLMEngine | None = None
        self.load_error: BaseException | None = None
        self.load_time: float | None = None  # seconds the load took (set when it is done, failed or not)
        self.stats: EngineStats | None = None  # the latest snapshot, replaced (never mutated) by the engine thread
        self._on_loaded = on_loaded
        self._ready = threading.Event()
        self._inbox: queue.Queue[Callable[[], None]] = queue.Queue()
        self._streams: dict[str, RequestOutputStream] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="kvgate-engine", daemon=True)
        if start:
            self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs,
                         on_loaded: Callable[["AsyncLLMEngine"], None] | None = None) -> "AsyncLLMEngine":
        """Starts loading at once on the engine thread; `is_ready` / `wait_until_ready()` tell when it is done, and
        `on_loaded(engine)` (if given) is called on the engine thread once the load succeeded or failed."""
        return cls(args, on_loaded=on_loaded)

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
        stream = RequestOutputStream(asyncio.get_running_loop(), sampling_params.output_kind == RequestOutputKind.DELTA)
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._streams[request_id] = stream
        arrival = time.monotonic()  # now, not when the engine thread gets to it: latencies include that wait

        def add() -> None:
            try:
                self.engine.add_request(request_id, prompt, sampling_params, priority, max_batch_delay,
                                        arrival_time=arrival)
            except Exception as e:  # invalid input: report it to this caller only
                self._streams.pop(request_id, None)
                _send(stream.loop, [(stream, e)])

        self._inbox.put(add)
        finished = False
        try:
            while True:
                item = await stream.get()
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

        def settle(error: Exception | None, result: Any) -> None:
            if not fut.done():  # the caller may have given up (cancelled)
                fut.set_exception(error) if error is not None else fut.set_result(result)

        def do() -> None:
            try:
                outcome: tuple[Exception | None, Any] = (None, fn(self.engine))
            except Exception as e:
                outcome = (e, None)
            try:
                loop.call_soon_threadsafe(settle, *outcome)
            except RuntimeError:  # the caller's event loop is closed
                pass

        self._inbox.put(do)
        return fut

    # ---- the engine thread ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            with _LOAD_LOCK:
                self.engine = LLMEngine.from_engine_args(self.args)
            self.stats = snapshot(self.engine)
        except BaseException as e:  # noqa: BLE001 - reported through is_dead / wait_until_ready
            self.load_error = e
            logger.error("engine failed to load: %s", e)
            return
        finally:
            self.load_time = time.perf_counter() - t0
            self._ready.set()
            if self._on_loaded is not None:
                try:
                    self._on_loaded(self)
                except Exception:  # a reporting callback must not kill the engine thread
                    logger.exception("on_loaded callback failed")
        self.engine.sleep_when_held = False  # wait on the inbox instead, so new requests join the held batch
        while not self._stopped:
            wake = self.engine.scheduler.next_wakeup
            if not self.engine.has_unfinished_requests():
                ran = self._drain(timeout=0.5)
            elif wake is not None:
                ran = self._drain(timeout=max(0.0, wake - time.monotonic()))
            else:
                ran = self._drain(timeout=None)
            if ran:  # new requests, aborts (blocks freed): publish before waiting again
                self.stats = snapshot(self.engine)
            if self._stopped or not self.engine.has_unfinished_requests():
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a failed step fails the requests in it, never the loop
                logger.exception("engine step failed")
                self._fail_all(e)
                self.stats = snapshot(self.engine)
                continue
            self.stats = snapshot(self.engine)  # before the outputs go out: a caller that saw them sees the stats
            self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams: one call_soon_threadsafe per event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestOutputStream, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            by_loop.setdefault(stream.loop, []).append((stream, out))
            if out.finished:
                del self._streams[out.request_id]
        for loop, items in by_loop.items():
            if not _send(loop, items):  # the callers' event loop is gone: nobody reads these, stop the requests
                for _, out in items:
                    self._streams.pop(out.request_id, None)
                    if not out.finished:
                        self.engine.abort_request(out.request_id)

    def _drain(self, timeout: float | None) -> bool:
        """Run every queued call; wait up to `timeout` seconds for the first one (None: do not wait).
        Returns whether any call ran."""
        try:
            item = self._inbox.get(timeout=timeout) if timeout else self._inbox.get_nowait()
        except queue.Empty:
            return False
        while True:
            item()
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _fail_all(self, error: Exception) -> None:
        for rid in list(self.engine.requests):
            self.engine.abort_request(rid)
            stream = self._streams.pop(rid, None)
            if stream is not None:
                _send(stream.loop, [(stream, RuntimeError(f"internal engine error: {error}"))])


def _send(loop: asyncio.AbstractEventLoop, items: list[tuple[RequestOutputStream, RequestOutput | BaseException]]
          ) -> bool:
    """Push items into their streams on `loop` (from the engine thread); False when that loop is closed."""
    def push_all() -> None:
        for stream, item in items:
            stream.push(item)

    try:
        loop.call_soon_threadsafe(push_all)
    except RuntimeError:
        return False
    return True

