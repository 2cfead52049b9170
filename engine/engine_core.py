"""EngineCore: the engine loop behind AsyncLLMEngine, on a thread or in a process of its own (vLLM v1's EngineCore).

Commands arrive in an inbox queue: ("add", request_id, prompt, params, priority, max_batch_delay, arrival_time),
where params is a SamplingParams (generate) or a PoolingParams (an embedding, whose output is a
PoolingRequestOutput), ("abort", request_id), ("call", call_id, fn), ("wake",) (a guided request's grammar finished
compiling on its worker thread: the loop, idle while only such requests wait, looks again) and ("stop",). Between
commands the loop steps the engine, and after each turn that did something it emits one CoreOutputs: the step's
outputs, the requests that failed (refused input, an invalid grammar found by its compilation, a failed step), the
results of calls and a fresh EngineStats snapshot.

On a thread, `emit` hands CoreOutputs straight to AsyncLLMEngine. In a process of its own (`run_core_process`), a
reader thread fills the inbox from a pipe and `emit` writes to it: the API process (HTTP, JSON, SSE) and the
engine (scheduling, step tensors, sampling, detokenization) then stop sharing one GIL.
"""
from __future__ import annotations

import gc
import logging
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from kvgate.engine.config import EngineArgs
from kvgate.engine.llm_engine import LLMEngine
from kvgate.engine.outputs import DeltaTuple, EngineOutput
from kvgate.engine.pipe_reader import SWITCH_INTERVAL_S, PipeReader
from kvgate.engine.stats import EngineStats, snapshot

logger = logging.getLogger(__name__)


@dataclass
class CoreOutputs:
    outputs: list[EngineOutput | DeltaTuple] = field(default_factory=list)
    failed: list[tuple[str, BaseException]] = field(default_factory=list)  # (request id, why it ended)
    results: list[tuple[int, BaseException | None, Any]] = field(default_factory=list)  # (call id, error, value)
    stats: EngineStats | None = None


def merge_core_outputs(outs: list[CoreOutputs]) -> CoreOutputs:
    """Several turns' CoreOutputs as one, in turn order (the latest stats)."""
    merged = CoreOutputs()
    for out in outs:
        merged.outputs += out.outputs
        merged.failed += out.failed
        merged.results += out.results
        merged.stats = out.stats if out.stats is not None else merged.stats
    return merged


class EngineCore:
    def __init__(self, engine: LLMEngine, inbox: "queue.Queue[tuple]", emit: Callable[[CoreOutputs], None],
                 on_idle: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.inbox = inbox
        self.emit = emit
        self.on_idle = on_idle  # called whenever the loop waits with nothing to run
        self._stopped = False
        self._pending = CoreOutputs()  # failures and call results of the commands run since the last emit
        engine.structured_output_manager.on_ready = lambda: inbox.put(("wake",))

    def run(self) -> None:
        engine = self.engine
        engine.sleep_when_held = False  # wait on the inbox instead, so new requests join the held batch
        times = engine.loop_times
        t0 = time.perf_counter()
        while not self._stopped:
            wake = engine.scheduler.next_wakeup
            if not engine.has_unfinished_requests() or engine.only_waiting_for_grammars():
                if self.on_idle is not None:
                    self.on_idle()
                ran = self._drain(timeout=0.5)  # a compiled grammar sends ("wake",)
            elif wake is not None:
                ran = self._drain(timeout=max(0.0, wake - time.monotonic()))
            else:
                ran = self._drain(timeout=None)
            t1 = time.perf_counter()
            times.idle += t1 - t0  # commands included: adding a request is quick next to a step
            out, self._pending = self._pending, CoreOutputs()
            stepped = not self._stopped and engine.has_unfinished_requests()
            if stepped:
                try:
                    out.outputs = engine.step()
                except Exception as e:  # a failed step fails the requests in it, never the loop
                    logger.exception("engine step failed")
                    out.failed += self._fail_all(e)
                out.failed += engine.take_failed()
            t0 = time.perf_counter()
            times.busy += t0 - t1
            if ran or stepped:
                out.stats = snapshot(engine)
                self.emit(out)
                t1, t0 = t0, time.perf_counter()
                times.emit += t0 - t1  # seen in the next turn's snapshot

    def _drain(self, timeout: float | None) -> bool:
        """Run every queued command; wait up to `timeout` seconds for the first one (None or 0: do not wait)."""
        try:
            cmd = self.inbox.get(timeout=timeout) if timeout else self.inbox.get_nowait()
        except queue.Empty:
            return False
        while True:
            self._run_command(cmd)
            try:
                cmd = self.inbox.get_nowait()
            except queue.Empty:
                return True

    def _run_command(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, prompt, params, priority, delay, arrival = cmd
            try:
                self.engine.add_request(rid, prompt, params, priority, delay, arrival_time=arrival)
            except Exception as e:  # invalid input: reported to this request's caller only
                self._pending.failed.append((rid, e))
        elif kind == "abort":
            self.engine.abort_request(cmd[1])
        elif kind == "call":
            try:
                self._pending.results.append((cmd[1], None, cmd[2](self.engine)))
            except Exception as e:
                self._pending.results.append((cmd[1], e, None))
        elif kind == "stop":
            self._stopped = True
        elif kind == "wake":  # nothing to run: the loop steps next, which schedules the compiled requests
            pass

    def _fail_all(self, error: Exception) -> list[tuple[str, BaseException]]:
        rids = list(self.engine.requests)
        self.engine.abort_request(rids)
        return [(rid, RuntimeError(f"internal engine error: {error}")) for rid in rids]


# ---- the engine core in a process of its own ---------------------------------------------------------------------
def run_core_process(args: EngineArgs, conn: Any, log_level: int = logging.WARNING, clients: list[Any] | None = None
                     ) -> None:
    """The child process's entry point: load, report ("ready", the engine's EngineConfig, stats) or ("load_error",
    error), then run the loop until a stop command or the parent's end of the pipe closes. With `clients` (the pipes
    of more API processes, `kvgate serve --api-server-count`), `conn` is one client among them
    (engine/core_clients.py), and the core stops once every one has left.

    SIGINT and SIGTERM are ignored: they belong to the parent, which drains its requests and then stops the core
    through the pipe (a Ctrl-C, or a SIGTERM sent to the whole process group, must not kill requests that the
    parent's graceful shutdown lets finish). A dead parent closes the pipe, which stops the core too."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s [engine core]: %(message)s")
    try:
        engine = LLMEngine.from_engine_args(args)
        engine.output_prompts = False  # the API process keeps each request's prompt and fills it in
        engine.delta_tuples = True  # and makes the streamed outputs' RequestOutputs
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        conn.send(("load_error", _picklable(e)))
        return
    freeze_gc_heap()
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # the command reader thread gets the GIL within 1 ms of a step's Python
    conn.send(("ready", engine.config, snapshot(engine)))  # the config as this engine resolved it
    inbox: queue.Queue[tuple] = queue.Queue()
    if clients:
        from kvgate.engine.core_clients import CoreClients

        shared = CoreClients([conn, *clients], inbox, _send)
        shared.start()
        emit: Callable[[CoreOutputs], None] = shared.emit
        on_idle: Callable[[], None] | None = shared.flush
    else:
        threading.Thread(target=_read_commands, args=(conn, inbox), name="kvgate-core-input", daemon=True).start()
        on_idle = None

        def emit(out: CoreOutputs) -> None:
            if not _send(conn, out):  # the parent is gone
                inbox.put(("stop",))

    engine.executor.exit_on_worker_death = True  # the parent restarts this process, and so every rank
    try:
        EngineCore(engine, inbox, emit, on_idle).run()
    finally:
        engine.shutdown()


def _send(conn: Any, out: CoreOutputs) -> bool:
    """Write a turn's outputs to a client's pipe; False when its other end is gone."""
    try:
        conn.send(out)  # pickles first: nothing is written when that fails
    except OSError:
        return False
    except Exception as e:  # a call's result that cannot be pickled: its caller gets the error instead
        out.results = [(cid, TypeError(f"the result of this call cannot be sent between processes: {e}"), None)
                       for cid, _, _ in out.results]
        try:
            conn.send(out)
        except OSError:
            return False
    return True


def freeze_gc_heap() -> None:
    """Move everything alive after loading (torch, transformers, the model's modules: ~500k objects) out of the
    cyclic garbage collector's reach. Otherwise each full collection walks them all, a 100-200 ms pause of the
    engine loop or the event loop every few hundred requests (vLLM freezes its heap after start-up too)."""
    gc.collect()
    gc.freeze()


def _read_commands(conn: Any, inbox: "queue.Queue[tuple]") -> None:
    """Move commands from the pipe into the inbox as they come, every waiting one per read (engine/pipe_reader.py),
    so the parent's writes never wait on a step."""
    reader = PipeReader(conn)
    while True:
        try:
            cmds = reader.read()
        except (EOFError, OSError):  # the parent is gone
            inbox.put(("stop",))
            return
        for cmd in cmds:
            inbox.put(cmd)
            if cmd[0] == "stop":
                return


def _picklable(e: BaseException) -> BaseException:
    import pickle

    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")
