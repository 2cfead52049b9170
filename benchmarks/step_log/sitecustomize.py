"""A log of every engine step, for every Python process started with this directory on PYTHONPATH that runs an
engine (the offline LLM, or `kvgate serve`'s engine core process): each `LLMEngine.step()` call's start and wall
time, the part of it spent waiting for the GPU (the sampled tokens' copy event), and the size of the step it started;
in the engine core's loop also each wait for commands (and how many requests it added) and each emit of outputs; in
an API process, each request's time from the HTTP request's start to its submission to the engine.
Rows are appended to $KVGATE_STEP_LOG_DIR/steps-<pid>.tsv once a second, so a server that is killed still leaves
them. Without KVGATE_STEP_LOG_DIR it does nothing. `python benchmarks/step_log/summarize.py DIR` reads them.

  PYTHONPATH=benchmarks/step_log:$PYTHONPATH KVGATE_STEP_LOG_DIR=/tmp/steps kvgate serve ...

Rows (tab-separated, times in seconds from time.perf_counter()):
  step  start  wall  gpu_wait  tokens  seqs  decodes  outputs   (tokens/seqs/decodes: the step this call started;
                                                                  0 when it started none)
  drain start  wall  added
  emit  start  wall  outputs
  add   start  waited        (a request the core added: seconds since its arrival in the API process)
  first start  ttft          (a request's first token completed: seconds since its arrival)
  submit start  waited       (API process: a request submitted to the engine, seconds since its HTTP request began)
"""
import contextvars
import os
import sys
import threading
import time

_DIR = os.environ.get("KVGATE_STEP_LOG_DIR")
_rows: list = []
_state = {"wait": 0.0, "started": None, "added": 0}
_http_start: contextvars.ContextVar = contextvars.ContextVar("step_log_http_start")


def _patch_engine(llm_engine, sampler, stats) -> None:
    perf = time.perf_counter
    step, start, result = llm_engine.LLMEngine.step, llm_engine.LLMEngine._start, sampler.Sampler.result
    on_tokens = stats.LatencyStats.on_tokens

    def logged_step(self):
        _state["wait"], _state["started"] = 0.0, None
        t0 = perf()
        out = step(self)
        t1 = perf()
        _rows.append(("step", t0, t1 - t0, _state["wait"], *(_state["started"] or (0, 0, 0)), len(out)))
        return out

    def logged_start(self, so):
        _state["started"] = (so.num_batched_tokens, len(so.scheduled), so.num_decodes)
        return start(self, so)

    def logged_result(self, s):
        if s.ready is not None:
            t0 = perf()
            s.ready.synchronize()  # the original's own synchronize then returns at once
            _state["wait"] += perf() - t0
        return result(self, s)

    def logged_on_tokens(self, req, now):
        if req.request_id not in self._last_token_time:
            _rows.append(("first", perf(), now - req.arrival_time))
        return on_tokens(self, req, now)

    llm_engine.LLMEngine.step, llm_engine.LLMEngine._start = logged_step, logged_start
    stats.LatencyStats.on_tokens = logged_on_tokens
    sampler.Sampler.result = logged_result


def _patch_core(engine_core) -> None:
    perf = time.perf_counter
    core = engine_core.EngineCore
    init, drain, run_command = core.__init__, core._drain, core._run_command

    def logged_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        emit = self.emit

        def logged_emit(out):
            t0 = perf()
            emit(out)
            _rows.append(("emit", t0, perf() - t0, len(out.outputs)))

        self.emit = logged_emit

    def logged_drain(self, timeout):
        _state["added"] = 0
        t0 = perf()
        ran = drain(self, timeout)
        _rows.append(("drain", t0, perf() - t0, _state["added"]))
        return ran

    def logged_run_command(self, cmd):
        if cmd[0] == "add":
            _state["added"] += 1
            _rows.append(("add", perf(), time.monotonic() - cmd[6]))
        return run_command(self, cmd)

    core.__init__, core._drain, core._run_command = logged_init, logged_drain, logged_run_command


def _patch_api(gateway_app, async_engine) -> None:
    """Each HTTP request's start (the gateway's ASGI entry), seen by the engine's _submit in the same task (or a task
    started from it)."""
    perf = time.perf_counter
    call, submit = gateway_app.GatewayApp.__call__, async_engine.AsyncLLMEngine._submit

    async def logged_call(self, scope, receive, send):
        if scope["type"] == "http":
            _http_start.set(perf())
        return await call(self, scope, receive, send)

    async def logged_submit(self, *args, **kwargs):
        stream = await submit(self, *args, **kwargs)
        t0 = _http_start.get(None)
        if t0 is not None:
            now = perf()
            _rows.append(("submit", now, now - t0))
        return stream

    gateway_app.GatewayApp.__call__, async_engine.AsyncLLMEngine._submit = logged_call, logged_submit


def _loaded(name: str) -> bool:
    """Whether the module's import has finished (it is in sys.modules from the start of its import)."""
    spec = getattr(sys.modules.get(name), "__spec__", None)
    return spec is not None and not getattr(spec, "_initializing", False)


_written = [0]
_lock = threading.Lock()


def _flush() -> None:
    """Append the rows not written yet to this process's file."""
    with _lock:
        n = len(_rows)
        if n > _written[0]:
            with open(os.path.join(_DIR, f"steps-{os.getpid()}.tsv"), "a") as f:
                f.write("".join("\t".join(map(str, r)) + "\n" for r in _rows[_written[0]:n]))
            _written[0] = n


def _watch() -> None:
    """Patch each module once it is imported (each process imports some of them); write the new rows once a second
    (and at exit)."""
    names = ("kvgate.engine.llm_engine", "kvgate.engine.sampler", "kvgate.engine.stats")
    api_names = ("kvgate.gateway.app", "kvgate.engine.async_engine")
    engine_done = core_done = api_done = False
    last = began = time.monotonic()
    while True:  # a process imports what it runs at start-up: after two minutes, look once a second
        all_done = engine_done and core_done and api_done
        time.sleep(0.01 if not all_done and time.monotonic() - began < 120 else 1.0)
        if not engine_done and all(_loaded(n) for n in names):
            _patch_engine(*(sys.modules[n] for n in names))
            engine_done = True
        if not core_done and _loaded("kvgate.engine.engine_core"):
            _patch_core(sys.modules["kvgate.engine.engine_core"])
            core_done = True
        if not api_done and all(_loaded(n) for n in api_names):
            _patch_api(*(sys.modules[n] for n in api_names))
            api_done = True
        if time.monotonic() - last >= 1.0:
            _flush()
            last = time.monotonic()


if _DIR:
    import atexit

    os.makedirs(_DIR, exist_ok=True)
    atexit.register(_flush)
    threading.Thread(target=_watch, name="step-log", daemon=True).start()
