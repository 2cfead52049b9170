"""AsyncLLMEngine: asyncio streams for callers, the engine loop (engine/engine_core.py) elsewhere.

The engine core runs on a thread of this process, or in a process of its own (`engine_core_process`, the default
on CUDA): then the HTTP event loop and the engine's host work (scheduling, step tensors, sampling,
detokenization) no longer share one GIL. Either way the event loop never waits on a model step: requests, aborts
and calls go to the core as commands, and each turn's CoreOutputs come back on one thread of this process (the
engine thread, or the reader of the core's pipe), which hands them to their event loops in one
`call_soon_threadsafe` per loop, into one RequestOutputStream per request (engine/output_stream.py: unread DELTA
outputs are merged, so a busy loop is not flooded). Cancelling a stream (client gone) aborts its request, which
frees its KV blocks on the core's next turn. With every turn comes an EngineStats snapshot (`stats`), so readers
never touch live engine state.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from kvgate.engine.config import EngineArgs, EngineConfig
from kvgate.engine.engine_core import CoreOutputs, EngineCore, run_core_process
from kvgate.engine.llm_engine import LLMEngine, PromptType, encode_prompt
from kvgate.engine.output_stream import RequestOutputStream
from kvgate.engine.outputs import EngineOutput, PoolingRequestOutput, RequestOutput
from kvgate.engine.pooling_params import PoolingParams, check_runner
from kvgate.engine.sampling_params import RequestOutputKind, SamplingParams
from kvgate.engine.sequence import DEFAULT_PRIORITY
from kvgate.engine.stats import EngineStats, snapshot
from kvgate.engine.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


@dataclass
class AsyncEngineArgs(EngineArgs):
    """EngineArgs for the async engine (same fields: AsyncEngineArgs(model=..., scheduler_delay=0.05, ...))."""


# Engines load one at a time: loading touches process-wide state (torch's default dtype and seed, transformers'
# lazy imports, which fail when two threads trigger them at once), so several models in one process would race;
# an engine core in its own process holds it too, until it is ready (each sizes its KV cache from free GPU memory).
_LOAD_LOCK = threading.Lock()


class EngineDeadError(RuntimeError):
    pass


class AsyncLLMEngine:
    def __init__(self, args: EngineArgs, start: bool = True,
                 on_loaded: Callable[["AsyncLLMEngine"], None] | None = None) -> None:
        self.args = args
        self.config: EngineConfig | None = None  # set once loaded (max_model_len as the KV cache allows)
        self.tokenizer: Any = None  # set once loaded (None with skip_tokenizer_init)
        self.engine: LLMEngine | None = None  # the engine itself when its core runs on a thread of this process
        self.load_error: BaseException | None = None
        self.load_time: float | None = None  # seconds the load took (set when it is done, failed or not)
        self.stats: EngineStats | None = None  # the latest snapshot, replaced (never mutated) after every turn
        self._on_loaded = on_loaded
        self._ready = threading.Event()
        self._inbox: queue.Queue[tuple] = queue.Queue()  # the core's commands when it runs on a thread
        self._conn: Any = None  # the pipe to the core's process, when it has one
        self._conn_lock = threading.Lock()
        self._process: Any = None
        self._streams: dict[str, RequestOutputStream] = {}
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._call_ids = itertools.count()
        self._stopped = False
        self._core_gone = False  # the core's process exited: set before its streams are failed
        self._thread = threading.Thread(target=self._run, name="kvgate-engine", daemon=True)
        if start:
            self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs,
                         on_loaded: Callable[["AsyncLLMEngine"], None] | None = None) -> "AsyncLLMEngine":
        """Starts loading at once (on the engine thread); `is_ready` / `wait_until_ready()` tell when it is done, and
        `on_loaded(engine)` (if given) is called on the engine thread once the load succeeded or failed."""
        return cls(args, on_loaded=on_loaded)

    # ---- state -------------------------------------------------------------------------------------------------
    @property
    def is_ready(self) -> bool:
        return self._ready.is_set() and self.load_error is None

    @property
    def is_dead(self) -> bool:
        return self.load_error is not None or self._core_gone or (self._ready.is_set() and not self._thread.is_alive())

    @property
    def in_process(self) -> bool:
        """Whether the engine core runs in a process of its own."""
        return self._conn is not None

    async def wait_until_ready(self, timeout: float | None = None) -> None:
        ok = await asyncio.to_thread(self._ready.wait, timeout)
        if self.load_error is not None:
            raise EngineDeadError(f"the engine failed to load: {self.load_error}") from self.load_error
        if not ok:
            raise TimeoutError(f"the engine did not load within {timeout} s")

    def shutdown(self) -> None:
        self._stopped = True
        self._command(("stop",))
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)
        if self._process is not None:
            self._process.join(timeout=10)
            if self._process.is_alive():
                self._process.kill()

    # ---- requests ----------------------------------------------------------------------------------------------
    async def generate(self, prompt: PromptType, sampling_params: SamplingParams, request_id: str,
                       priority: int = DEFAULT_PRIORITY, max_batch_delay: float | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Stream this request's outputs; raises ValueError for invalid input (nothing is left behind), and on an
        engine of the pooling runner."""
        stream = await self._submit(prompt, sampling_params, request_id, priority, max_batch_delay,
                                    sampling_params.output_kind == RequestOutputKind.DELTA)
        finished = False
        try:
            while True:
                item = await stream.get()
                finished = item.finished
                yield item  # type: ignore[misc]
                if finished:
                    return
        finally:
            if not finished:  # cancelled, failed or the consumer stopped early: free its blocks now
                self.abort(request_id)

    async def encode(self, prompt: PromptType, pooling_params: PoolingParams | None, request_id: str,
                     priority: int = DEFAULT_PRIORITY, max_batch_delay: float | None = None
                     ) -> AsyncIterator[PoolingRequestOutput]:
        """vLLM's encode(): pool this prompt on an embedding model (runner="pooling"). Yields one output, finished,
        whose `outputs.embedding` is a list of floats; raises ValueError for invalid input (nothing is left
        behind) and on an engine of the generate runner. Closing the iterator early aborts the request."""
        stream = await self._submit(prompt, pooling_params or PoolingParams(), request_id, priority,
                                    max_batch_delay, False)
        try:
            item = await stream.get()  # the only output (pooling outputs are always finished)
        except BaseException:  # cancelled or failed: free its blocks now
            self.abort(request_id)
            raise
        yield item  # type: ignore[misc]

    async def _submit(self, prompt: PromptType, params: SamplingParams | PoolingParams, request_id: str,
                      priority: int, max_batch_delay: float | None, delta: bool) -> RequestOutputStream:
        """Check, register the request's stream and send it to the core; the caller reads the stream."""
        if self.is_dead:
            raise EngineDeadError("the engine is not running")
        if not self.is_ready:
            await self.wait_until_ready()
        check_runner(self.config.runner, isinstance(params, PoolingParams))
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = RequestOutputStream(asyncio.get_running_loop(), delta)
        if self.in_process:  # the core's outputs leave the prompt out: this side keeps it
            text, ids = encode_prompt(self.tokenizer, prompt)
            stream.prompt, prompt = (text, ids), {"prompt": text, "prompt_token_ids": ids}
        self._streams[request_id] = stream
        if self._core_gone:  # it died after the check above: its reader may have failed the streams already
            self._streams.pop(request_id, None)
            raise EngineDeadError("the engine is not running")
        arrival = time.monotonic()  # now, not when the core gets to it: latencies include that wait
        self._command(("add", request_id, prompt, params, priority, max_batch_delay, arrival))
        return stream

    @property
    def num_requests(self) -> int:
        """Requests accepted and not finished (counted on the caller's side, so it is exact at admission)."""
        return len(self._streams)

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._command(("abort", request_id))

    def call(self, fn: Callable[[LLMEngine], Any]) -> "asyncio.Future[Any]":
        """Run fn(engine) in the engine core between steps (for tests and tools); with the core in its own process,
        fn and its result must pickle (a module-level function)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        cid = next(self._call_ids)
        self._calls[cid] = (loop, fut)
        if self._core_gone:
            del self._calls[cid]
            raise EngineDeadError("the engine is not running")
        try:
            self._command(("call", cid, fn))
        except Exception:
            del self._calls[cid]
            raise
        return fut

    def _command(self, cmd: tuple) -> None:
        if self._conn is None:
            self._inbox.put(cmd)
            return
        with self._conn_lock:
            try:
                self._conn.send(cmd)
            except OSError:  # the core's process is gone: is_dead says so, and its streams have failed
                pass

    # ---- loading, then the engine thread's work ----------------------------------------------------------------
    def _run(self) -> None:
        t0 = time.perf_counter()
        core: EngineCore | None = None
        try:
            with _LOAD_LOCK:
                config = self.args.create_engine_config()
                in_process = self.args.engine_core_process
                if in_process is None:
                    in_process = config.device.type == "cuda"
                if in_process:
                    self._start_process(config)
                else:
                    self.engine = LLMEngine(config)
                    self.config, self.tokenizer = config, self.engine.tokenizer
                    self.stats = snapshot(self.engine)
                    core = EngineCore(self.engine, self._inbox, self._on_core_outputs)
        except BaseException as e:  # noqa: BLE001 - reported through is_dead / wait_until_ready
            self.load_error = e
            logger.error("engine failed to load: %s", e)
            if self._process is not None and self._process.pid is not None:
                self._process.kill()
        finally:
            self.load_time = time.perf_counter() - t0
            self._ready.set()
            if self._on_loaded is not None:
                try:
                    self._on_loaded(self)
                except Exception:  # a reporting callback must not kill the engine thread
                    logger.exception("on_loaded callback failed")
        if self.load_error is not None:
            return
        if core is not None:
            core.run()
        else:
            self._read_outputs()

    def _start_process(self, config: EngineConfig) -> None:
        """Start the core's process, load the tokenizer meanwhile, and wait for the core's report."""
        ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA or threads
        parent, child = ctx.Pipe()
        self._process = ctx.Process(target=run_core_process, name="kvgate-engine-core", daemon=True,
                                    args=(self.args, child, logging.getLogger("kvgate").getEffectiveLevel()))
        self._process.start()
        child.close()
        tokenizer = None if self.args.skip_tokenizer_init else load_tokenizer(config)
        try:
            report = parent.recv()
        except EOFError:
            raise RuntimeError(f"the engine core process exited while loading (exit code "
                               f"{self._process.join(5) or self._process.exitcode})") from None
        if report[0] == "load_error":
            raise report[1]
        _, config, self.stats = report  # the core's own config: what it resolved (max_model_len, dtype, ...)
        self.config, self.tokenizer, self._conn = config, tokenizer, parent
        if self._stopped:  # shut down while loading
            self._command(("stop",))

    def _read_outputs(self) -> None:
        """The core's process sends one CoreOutputs per turn; on EOF (it died or stopped) every stream fails."""
        while True:
            try:
                out = self._conn.recv()
            except (EOFError, OSError):
                break
            self._on_core_outputs(out)
        self._core_gone = True  # first: a stream registered from now on sees it, one registered before is failed here
        if not self._stopped:
            logger.error("the engine core process exited (code %s)", self._process.join(1) or self._process.exitcode)
        error = EngineDeadError("the engine core process exited")
        self._on_core_outputs(CoreOutputs(failed=[(rid, error) for rid in list(self._streams)],
                                          results=[(cid, error, None) for cid in list(self._calls)]))

    def _on_core_outputs(self, out: CoreOutputs) -> None:
        """Hand a turn's outputs, failures and call results to their event loops: one call per loop."""
        if out.stats is not None:
            self.stats = out.stats  # before the outputs go out: a caller that saw them sees these stats
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestOutputStream, EngineOutput | BaseException]]] = {}
        for o in out.outputs:
            stream = self._streams.get(o.request_id)
            if stream is None:
                continue
            if stream.prompt is not None:
                o.prompt, o.prompt_token_ids = stream.prompt
            by_loop.setdefault(stream.loop, []).append((stream, o))
            if o.finished:
                self._streams.pop(o.request_id, None)
        for rid, error in out.failed:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, error))
        for loop, items in by_loop.items():
            if not _send(loop, items):  # the callers' event loop is gone: nobody reads these, stop the requests
                for stream, item in items:
                    if isinstance(item, (RequestOutput, PoolingRequestOutput)) and not item.finished:
                        self.abort(item.request_id)
        for cid, error, value in out.results:
            loop, fut = self._calls.pop(cid, (None, None))
            if loop is not None:
                try:
                    loop.call_soon_threadsafe(_settle, fut, error, value)
                except RuntimeError:  # the caller's event loop is closed
                    pass


def _settle(fut: asyncio.Future, error: BaseException | None, value: Any) -> None:
    if not fut.done():  # the caller may have given up (cancelled)
        fut.set_exception(error) if error is not None else fut.set_result(value)


def _send(loop: asyncio.AbstractEventLoop, items: list[tuple[RequestOutputStream, EngineOutput | BaseException]]
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
