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

A core in a process of its own can die (the kernel's OOM killer, a CUDA error, SIGKILL). Its pipe then closes, and
every request in flight fails at once with EngineDeadError: no stream waits on a dead core. What follows is the
`on_engine_core_death` policy: "restart" starts a new core (at most `max_engine_core_restarts` within 60 s) while
`is_ready` is False and `is_dead` is not, so the gateway answers 503 "loading" meanwhile; "exit", an exhausted
restart budget or a restart that fails to load leave the engine dead for good, and `on_dead(engine)` is called
(kvgate serve then drains and exits with status 1, for a supervisor to restart it).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Callable

from kvgate.engine.config import EngineArgs, EngineConfig
from kvgate.engine.core_process import RESTART_WINDOW_S, CoreProcess, RestartBudget, start_core_process
from kvgate.engine.detokenizer import OutputDetokenizer, byte_table
from kvgate.engine.engine_core import CoreOutputs, EngineCore, merge_core_outputs
from kvgate.engine.llm_engine import LLMEngine, PromptType, encode_prompt
from kvgate.engine.output_stream import RequestOutputStream, push_on_loop, settle
from kvgate.engine.outputs import EngineOutput, PoolingRequestOutput, RequestOutput, from_delta_tuple
from kvgate.engine.pipe_reader import PipeReader
from kvgate.engine.pooling_params import PoolingParams, check_runner
from kvgate.engine.sampling_params import RequestOutputKind, SamplingParams
from kvgate.engine.sequence import DEFAULT_PRIORITY
from kvgate.engine.stats import EngineStats, idle, snapshot
from kvgate.engine.tokenizer import eos_token_ids, load_tokenizer

logger = logging.getLogger(__name__)


@dataclass
class AsyncEngineArgs(EngineArgs):
    """EngineArgs for the async engine (same fields: AsyncEngineArgs(model=..., scheduler_delay=0.05, ...))."""


# Engines load one at a time: loading touches process-wide state (torch's default dtype and seed, transformers'
# lazy imports, which fail when two threads trigger them at once), so several models in one process would race;
# an engine core in its own process holds it too, until it is ready (each sizes its KV cache from free GPU memory).
_LOAD_LOCK = threading.Lock()


class EngineDeadError(RuntimeError):
    """The engine cannot serve this request: it failed to load, its core process died (or is being restarted), it
    was shut down, or the server aborted the request while shutting down. Nothing of the request is left behind."""


class AsyncLLMEngine:
    def __init__(self, args: EngineArgs, start: bool = True,
                 on_loaded: Callable[["AsyncLLMEngine"], None] | None = None,
                 on_dead: Callable[["AsyncLLMEngine"], None] | None = None, clients: int = 1,
                 core: CoreProcess | None = None) -> None:
        """`clients` > 1: the core's process also serves that many - 1 other API processes (`kvgate serve
        --api-server-count`; their pipes are in `shared_core.clients`), and is not restarted when it dies. `core`: an
        engine of such another API process, on its pipe to a core that one started (`process` None)."""
        self.args = args
        self.clients, self._given_core = clients, core
        self.shared_core: CoreProcess | None = None  # the core's process as started here, with clients > 1
        self.core_stop_timeout = 10.0  # shutdown(): seconds the core's process gets to exit before it is killed
        self.config: EngineConfig | None = None  # set once loaded (max_model_len as the KV cache allows)
        self.tokenizer: Any = None  # set once loaded (None with skip_tokenizer_init)
        self.eos_token_ids: list[int] = []  # set when this process makes text (shares_core)
        self.engine: LLMEngine | None = None  # the engine itself when its core runs on a thread of this process
        self.load_error: BaseException | None = None
        self.load_time: float | None = None  # seconds the load took (set when it is done, failed or not)
        self.stats: EngineStats | None = None  # the latest snapshot, replaced (never mutated) after every turn
        self.num_restarts = 0  # times a dead core process was replaced by a new one
        self.death: str | None = None  # why the engine died for good after it had loaded (None while it serves)
        self._on_loaded, self._on_dead = on_loaded, on_dead
        self._restarts = RestartBudget(args.max_engine_core_restarts)
        self._restarting = False  # a new core process is loading in place of a dead one
        self._ready = threading.Event()
        self._inbox: queue.Queue[tuple] = queue.Queue()  # the core's commands when it runs on a thread
        self._conn: Any = None  # the pipe to the core's process, when it has one
        self._conn_lock = threading.Lock()
        self._process: Any = None  # the core's process, when it has one
        self._streams: dict[str, RequestOutputStream] = {}
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._call_ids = itertools.count()
        self._stopped = False
        self._core_gone = False  # the core cannot take requests (its process exited, or its loop ended)
        self._thread = threading.Thread(target=self._run, name="kvgate-engine", daemon=True)
        if start:
            self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, on_loaded: Callable[["AsyncLLMEngine"], None] | None = None,
                         on_dead: Callable[["AsyncLLMEngine"], None] | None = None, clients: int = 1,
                         core: CoreProcess | None = None) -> "AsyncLLMEngine":
        """Starts loading at once (on the engine thread); `is_ready` / `wait_until_ready()` tell when it is done, and
        `on_loaded(engine)` (if given) is called on the engine thread once the load succeeded or failed.
        `on_dead(engine)` is called on the engine thread, once, if the loaded engine later dies for good (its core
        process died and is not restarted; `death` says why); never for a shutdown."""
        return cls(args, on_loaded=on_loaded, on_dead=on_dead, clients=clients, core=core)

    # ---- state -------------------------------------------------------------------------------------------------
    @property
    def is_ready(self) -> bool:
        """Loaded and able to take requests (False while loading, and while a dead core is being restarted)."""
        return self._ready.is_set() and self.load_error is None and not self._core_gone

    @property
    def is_dead(self) -> bool:
        """Failed to load, shut down, or its core died and is not coming back (False while it restarts)."""
        return self.load_error is not None or (self._core_gone and not self._restarting) or (
            self._ready.is_set() and not self._thread.is_alive())

    @property
    def is_restarting(self) -> bool:
        return self._restarting

    @property
    def in_process(self) -> bool:
        """Whether the engine core runs in a process of its own."""
        return self._conn is not None

    @property
    def shares_core(self) -> bool:
        """Whether the core serves several API processes (`kvgate serve --api-server-count` > 1). Each of them then
        makes the text of its requests without stop strings, which reach the core with detokenize=False (vLLM's
        split): there the core's step limits serving and the API processes have CPU to spare. One API process is
        the busier one at 200 clients, so its core detokenizes (benchmarks/RESULTS.md, 2026-12-07, ninth session)."""
        return self.clients > 1 or self._given_core is not None

    @property
    def name(self) -> str:
        """The served model name, else the model's path (for logs)."""
        return self.args.served_model_name or self.args.model or "the default model"

    @property
    def core_pid(self) -> int | None:
        """The process id of the engine core's process (the latest one, after restarts); None on a thread, and in
        an API process that did not start it."""
        return self._process.pid if self._process is not None else None

    def wait_loaded(self, timeout: float | None = None) -> bool:
        """Block this thread (never an event loop) until the load is done, failed or not; False on timeout."""
        return self._ready.wait(timeout)

    async def wait_until_ready(self, timeout: float | None = None) -> None:
        ok = await asyncio.to_thread(self._ready.wait, timeout)
        if self.load_error is not None:
            raise EngineDeadError(f"the engine failed to load: {self.load_error}") from self.load_error
        if not ok:
            raise TimeoutError(f"the engine did not load within {timeout} s")

    def shutdown(self) -> None:
        """Stop the core (after its current step) and wait for it; requests still in flight fail with
        EngineDeadError, and new ones are refused."""
        self._stopped = True
        self._command(("stop",))
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)
        if self._process is not None:
            self._process.join(timeout=self.core_stop_timeout)  # a shared one: until the other clients have left
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
        if self.is_dead or self._stopped:
            raise EngineDeadError(self.death or "the engine is not running")
        if not self.is_ready:  # loading, or restarting its core: wait for it
            await self.wait_until_ready()
            if not self.is_ready:
                raise EngineDeadError(self.death or "the engine is not running")
        check_runner(self.config.runner, isinstance(params, PoolingParams))
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = RequestOutputStream(asyncio.get_running_loop(), delta)
        if self.in_process:  # the core's outputs leave the prompt out: this side keeps it
            text, ids = encode_prompt(self.tokenizer, prompt)
            stream.prompt, prompt = (text, ids), {"prompt": text, "prompt_token_ids": ids}
            if self.shares_core and self.tokenizer is not None and isinstance(params, SamplingParams) and \
                    params.detokenize and not params.stop:  # no stop string to match: the text is made here
                stream.detokenizer = OutputDetokenizer(self.tokenizer, ids, params, self.eos_token_ids)
                params = replace(params, detokenize=False)
        conn = self._conn  # the core this request goes to: never a newer one that its failure did not see
        self._streams[request_id] = stream
        if self._core_gone:  # it died after the check above: its reader may have failed the streams already
            self._streams.pop(request_id, None)
            raise EngineDeadError("the engine is not running")
        arrival = time.monotonic()  # now, not when the core gets to it: latencies include that wait
        self._command(("add", request_id, prompt, params, priority, max_batch_delay, arrival), conn)
        return stream

    @property
    def num_requests(self) -> int:
        """Requests accepted and not finished (counted on the caller's side, so it is exact at admission)."""
        return len(self._streams)

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._command(("abort", request_id))

    def abort_all(self, error: BaseException) -> int:
        """Fail every request in flight with `error` (each stream raises it at once) and abort it in the core, which
        frees its KV blocks on its next turn. Returns how many there were. New requests are still taken."""
        rids = list(self._streams)
        self._on_core_outputs(CoreOutputs(failed=[(rid, error) for rid in rids]))
        for rid in rids:
            self._command(("abort", rid))
        return len(rids)

    async def settled_stats(self, timeout: float = 5.0) -> EngineStats | None:
        """The core's stats once it has run every command sent before this call (aborts included): the snapshot of
        that turn. None when the core is gone or does not answer within `timeout` seconds."""
        if not self.is_ready:
            return None
        try:
            await asyncio.wait_for(self.call(_nothing), timeout)
        except (EngineDeadError, asyncio.TimeoutError):
            return None
        return self.stats

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

    def _command(self, cmd: tuple, conn: Any = None) -> None:
        """Send a command to the core (to `conn`, the pipe of a given core process, if given)."""
        conn = conn if conn is not None else self._conn
        if conn is None:
            self._inbox.put(cmd)
            return
        with self._conn_lock:
            try:
                conn.send(cmd)
            except OSError:  # the core's process is gone: is_dead says so, and its streams have failed
                pass

    # ---- loading, then the engine thread's work ----------------------------------------------------------------
    def _run(self) -> None:
        t0 = time.perf_counter()
        core: EngineCore | None = None
        try:
            with _LOAD_LOCK:
                given = self._given_core
                config = given.config if given is not None else self.args.create_engine_config()
                in_process = self.args.engine_core_process
                if in_process is None:
                    in_process = config.device.type == "cuda" or self.clients > 1
                if given is not None:
                    if given.tokenizer is None and not self.args.skip_tokenizer_init:
                        given.tokenizer = load_tokenizer(config)
                    self._attach(given)
                elif in_process:
                    started = start_core_process(self.args, config, clients=self.clients)
                    self.shared_core = started if self.clients > 1 else None
                    self._attach(started)
                else:
                    self.engine = LLMEngine(config)
                    self.config, self.tokenizer = config, self.engine.tokenizer
                    self.stats = snapshot(self.engine)
                    core = EngineCore(self.engine, self._inbox, self._on_core_outputs)
        except BaseException as e:  # noqa: BLE001 - reported through is_dead / wait_until_ready
            self.load_error = e
            logger.error("engine failed to load: %s", e)
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
        if core is None:
            self._supervise()
            return
        try:
            core.run()
        finally:  # stopped (or, against every expectation, broken): nothing may wait on it any more
            self._core_gone = True
            self._fail_all(EngineDeadError("the engine was shut down" if self._stopped else "the engine loop ended"))

    def _attach(self, core: CoreProcess) -> None:
        """Take a core process that reported ready as this engine's core."""
        self._process = core.process
        self.config, self.tokenizer, self.stats, self._conn = core.config, core.tokenizer, core.stats, core.conn
        if self.shares_core and core.tokenizer is not None:  # this process makes the text of some requests
            self.eos_token_ids = eos_token_ids(core.config, core.tokenizer)
            byte_table(core.tokenizer)  # built now, not while the first requests wait for it
        if self._stopped:  # shut down while it loaded
            self._command(("stop",))

    def _supervise(self) -> None:
        """Read the core's outputs until its pipe closes; then fail what was in flight, and restart the core if it
        died and the policy and the restart budget allow it. Returns once the engine is stopped or dead for good."""
        while True:
            self._read_outputs()
            if self._process is not None:
                self._process.join(1)
                died = f"the engine core process exited (exit code {self._process.exitcode})"
            else:
                died = "the engine core process exited"
            shared = self.clients > 1 or self._given_core is not None
            restart = not self._stopped and not shared and self.args.on_engine_core_death == "restart" and \
                self._restarts.take(time.monotonic())
            if restart:  # before _core_gone: the engine reads as restarting (503 "loading"), never as dead
                self._restarting = True
                self._ready.clear()
            elif not self._stopped:  # before _core_gone too: whoever sees it dead can say why
                why = "it served several API processes" if shared else \
                    "on_engine_core_death is exit" if self.args.on_engine_core_death == "exit" else \
                    self._restarts.spent()
                self.death = f"{died}; not restarted ({why})"
            if not self._stopped:
                self.stats = idle(self.stats)  # the process and every KV block it held are gone
            self._core_gone = True  # a stream registered from now on sees it, one registered before is failed here
            with self._conn_lock:
                self._conn.close()
            if self._stopped:
                self._fail_all(EngineDeadError("the engine was shut down"))
                return
            self._fail_all(EngineDeadError(died + (": restarting it" if restart else "")))
            if not restart:
                self._die(self.death)
                return
            logger.error("%s: %s (pid %s); restarting it (restart %d of %d allowed within %.0f s)", self.name, died,
                         self.core_pid, self._restarts.used, self._restarts.limit, RESTART_WINDOW_S)
            t0 = time.perf_counter()
            try:
                with _LOAD_LOCK:
                    self._attach(start_core_process(self.args, self.config, self.tokenizer))
            except BaseException as e:  # noqa: BLE001 - the engine is dead: said by is_dead and on_dead
                self.death = f"{died}, and its restart failed: {e}"
                self._restarting = False
                self._die(self.death)
                return
            self.num_restarts += 1
            self._core_gone, self._restarting = False, False
            self._ready.set()
            logger.warning("%s: the engine core process restarted in %.1f s (pid %s)", self.name,
                           time.perf_counter() - t0, self.core_pid)

    def _die(self, why: str) -> None:
        """The engine is dead for good (`death` says why, set before is_dead turned True): log it, release whoever
        waits for a restart, and tell on_dead."""
        self._ready.set()
        logger.error("%s: %s", self.name, why)
        if self._on_dead is not None:
            try:
                self._on_dead(self)
            except Exception:  # a reporting callback must not kill the engine thread
                logger.exception("on_dead callback failed")

    def _read_outputs(self) -> None:
        """The core's process sends one CoreOutputs per turn; the turns waiting are read at once and handed over as
        one (engine/pipe_reader.py). Returns on EOF (it died or stopped)."""
        reader = PipeReader(self._conn)
        while True:
            try:
                outs = reader.read()
            except (EOFError, OSError):
                return
            self._on_core_outputs(outs[0] if len(outs) == 1 else merge_core_outputs(outs))

    def _fail_all(self, error: EngineDeadError) -> None:
        """Fail every request in flight and every pending call with `error` (after _core_gone is set)."""
        self._on_core_outputs(CoreOutputs(failed=[(rid, error) for rid in list(self._streams)],
                                          results=[(cid, error, None) for cid in list(self._calls)]))

    def _on_core_outputs(self, out: CoreOutputs) -> None:
        """Hand a turn's outputs, failures and call results to their event loops: one call per loop."""
        if out.stats is not None:
            self.stats = out.stats  # before the outputs go out: a caller that saw them sees these stats
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestOutputStream, EngineOutput | BaseException]]] = {}
        for o in out.outputs:
            if type(o) is tuple:  # a streamed output as the core's process sends it
                o = from_delta_tuple(o)
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
            if not push_on_loop(loop, items):  # the callers' event loop is gone: nobody reads these, stop the requests
                for stream, item in items:
                    if isinstance(item, (RequestOutput, PoolingRequestOutput)) and not item.finished:
                        self.abort(item.request_id)
        for cid, error, value in out.results:
            loop, fut = self._calls.pop(cid, (None, None))
            if loop is not None:
                try:
                    loop.call_soon_threadsafe(settle, fut, error, value)
                except RuntimeError:  # the caller's event loop is closed
                    pass


def _nothing(engine: LLMEngine) -> None:
    """A call that does nothing: its answer says the core ran every command sent before it."""
