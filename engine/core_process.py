"""The engine core's process, seen from the API process: starting one and waiting for its report, and the budget
that limits how often a dead one is restarted (AsyncLLMEngine decides when; engine/engine_core.py holds the child's
side, `run_core_process`)."""
from __future__ import annotations

import collections
import logging
import multiprocessing
from dataclasses import dataclass, field
from typing import Any

from kvgate.engine.config import EngineArgs, EngineConfig
from kvgate.engine.engine_core import run_core_process
from kvgate.engine.stats import EngineStats
from kvgate.engine.tokenizer import load_tokenizer

RESTART_WINDOW_S = 60.0  # max_engine_core_restarts counts the restarts within this many seconds


@dataclass
class CoreProcess:
    """A started core process that reported ready: its pipe, and the config and stats it reported."""
    process: Any  # multiprocessing.Process
    conn: Any  # our end of the pipe (multiprocessing.connection.Connection)
    config: EngineConfig  # the core's own config: what it resolved (max_model_len, dtype, ...)
    stats: EngineStats
    tokenizer: Any
    clients: list[Any] = field(default_factory=list)  # pipes to the core for other API processes (api_server_count)

    @property
    def exit_code(self) -> int | None:
        """The process's exit status once it has ended (-N: killed by signal N), after waiting up to 1 s."""
        self.process.join(1)
        return self.process.exitcode


def start_core_process(args: EngineArgs, config: EngineConfig, tokenizer: Any = None, clients: int = 1
                       ) -> CoreProcess:
    """Start a core process for `args` and wait for its report, loading the tokenizer meanwhile (unless one is
    given). With `clients` > 1 the core also takes requests from that many - 1 other API processes, through the
    pipes in CoreProcess.clients (engine/core_clients.py). Raises the core's load error, or RuntimeError when the
    process exits while loading; either way no process is left running."""
    ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA or threads
    parent, child = ctx.Pipe()
    others = [ctx.Pipe() for _ in range(clients - 1)]
    process = ctx.Process(target=run_core_process, name="kvgate-engine-core", daemon=True,
                          args=(args, child, logging.getLogger("kvgate").getEffectiveLevel(),
                                [c for _, c in others]))
    process.start()
    child.close()  # from now on, the process holds the only other end: its death is EOF here
    for _, c in others:
        c.close()
    try:
        if tokenizer is None and not args.skip_tokenizer_init:
            tokenizer = load_tokenizer(config)
        try:
            report = parent.recv()
        except EOFError:
            process.join(5)
            raise RuntimeError(f"the engine core process exited while loading (exit code {process.exitcode})"
                               ) from None
        if report[0] == "load_error":
            raise report[1]
    except BaseException:
        process.kill()
        process.join(5)
        for p in [parent, *(p for p, _ in others)]:
            p.close()
        raise
    _, core_config, stats = report
    return CoreProcess(process, parent, core_config, stats, tokenizer, [p for p, _ in others])


@dataclass
class RestartBudget:
    """At most `limit` restarts within any `window_s` seconds."""
    limit: int
    window_s: float = RESTART_WINDOW_S
    times: collections.deque[float] = field(default_factory=collections.deque)

    def take(self, now: float) -> bool:
        """Count one restart at `now` (monotonic seconds) and return True, or return False (changing nothing) when
        `limit` restarts happened within the last `window_s` seconds."""
        while self.times and now - self.times[0] > self.window_s:
            self.times.popleft()
        if len(self.times) >= self.limit:
            return False
        self.times.append(now)
        return True

    @property
    def used(self) -> int:
        return len(self.times)

    def spent(self) -> str:
        """Why take() said no, for messages."""
        if not self.limit:
            return "max_engine_core_restarts is 0"
        return f"{self.limit} restarts within {self.window_s:.0f} s already"
