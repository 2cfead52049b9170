"""Several HTTP server processes on one port: `kvgate serve --api-server-count N` (vLLM's flag).

One API process (an event loop: HTTP, JSON, SSE) streams ~30-40k tokens a second before its CPU is full; past that
new requests wait in its event loop, and the engine runs smaller batches. With N, kvgate serve's own process loads
the engines as always, each embedded engine's core in a process of its own with N pipes (engine/core_clients.py),
and once every embedded engine is ready it starts N - 1 more API processes. Each builds the same router from the
same config, its embedded engines attached to their cores' other pipes, and listens on the same port (SO_REUSEPORT):
the kernel spreads new connections over them.

/health says loading in every process until all of them serve: they count themselves in one shared counter, which
every process's /health reads, so that a readiness probe, whichever process answers it, never sees ok and then
loading again while the others start.

The others follow the first one's life. When it starts draining (SIGTERM, SIGINT, an engine's death) it tells them
on a control pipe, and they drain too; they ignore SIGINT and SIGTERM themselves (a Ctrl-C reaches the whole process
group: the first one decides). If the first one disappears (a second signal exits at once), their control pipes
close and they exit at once. An API process that exits on its own makes the first one drain and exit with status
1; so does an engine core's death, which every API process sees on its pipe (a shared core is not restarted).
What each process counts itself (requests in flight for the router's strategies, API-key limits, the gateway's
own metrics) is per process; the engines' metrics come from the cores and are the same in every process.
"""
from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable

from kvgate.engine.async_engine import AsyncLLMEngine
from kvgate.engine.core_process import CoreProcess
from kvgate.gateway.server import DRAIN_MARGIN_S, GatewayServer, say

JOIN_MARGIN_S = 10.0  # beyond the drain's own time, how long the first process waits for the others to exit


def bind_socket(host: str, port: int, first: bool = False) -> socket.socket:
    """A socket of this process on the port, which the other API processes bind too (SO_REUSEPORT): the kernel spreads
    new connections over them evenly. (One socket shared by all would hand a burst of connections to whichever
    process wakes first: asyncio accepts up to the backlog of them at once.)

    `first`: the first API process's, bound before anything loads. SO_REUSEPORT would also let it share the port with
    another server that listens there with that option (another kvgate serve with several API processes, an old
    one still draining), which would then get part of the new connections: the port is first bound without the
    option, which fails while anything listens there. (Two such servers started on one port in the same seconds,
    neither listening yet, are not told apart.)"""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]

    def bound(reuse_port: bool) -> socket.socket:
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind(address)
        except OSError as e:
            sock.close()
            raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from None
        return sock

    if first:
        bound(reuse_port=False).close()
    return bound(reuse_port=True)


class ApiServers:
    """The first API process's side: starts the others, tells them to drain, notices one that exits."""

    def __init__(self, count: int, config: str | None, overrides: dict[str, Any], server: GatewayServer) -> None:
        self.count, self.config, self.overrides, self.server = count, config, overrides, server
        self.processes: list[Any] = []
        self.controls: list[Any] = []
        self.draining = False
        self.serving = multiprocessing.get_context("spawn").Value("i", 0)  # the others that serve (shared memory)
        self._lock = threading.Lock()  # no process starts once the drain has begun
        server.on_drain.append(self.drain)
        server.router.starting = starting(self.serving, count)  # /health says loading until they all serve

    def start_when_ready(self, engines: list[tuple[str, AsyncLLMEngine]]) -> None:
        """On a thread: once every embedded engine has loaded, start the other API processes, each attached to
        every core through that core's pipe for it (in the router's order of deployments)."""
        def wait_then_start() -> None:
            for _, engine in engines:
                engine.wait_loaded()
            if self.draining or any(e.shared_core is None for _, e in engines):  # one failed to load
                return
            self._start(engines)

        threading.Thread(target=wait_then_start, name="kvgate-api-servers", daemon=True).start()

    def _start(self, engines: list[tuple[str, AsyncLLMEngine]]) -> None:
        ctx = multiprocessing.get_context("spawn")
        level = logging.getLogger("kvgate").getEffectiveLevel()
        for i in range(1, self.count):
            with self._lock:
                if self.draining:
                    break
                self._spawn(ctx, i, engines, level)
        threading.Thread(target=self._watch, name="kvgate-api-servers-watch", daemon=True).start()
        if self.processes:
            say(f"{len(self.processes) + 1} API server processes on the port (pids {os.getpid()} and "
                f"{', '.join(str(p.pid) for p in self.processes)})")

    def _spawn(self, ctx: Any, i: int, engines: list[tuple[str, AsyncLLMEngine]], level: int) -> None:
        cores = []
        for name, e in engines:
            shared = e.shared_core
            cores.append((name, CoreProcess(None, shared.clients[i - 1], shared.config, shared.stats, None)))
        ours, theirs = ctx.Pipe()
        p = ctx.Process(target=run_api_server, name=f"kvgate-api-server-{i}", daemon=False,
                        args=(i, self.count, self.config, self.overrides, cores, theirs, self.serving, level))
        p.start()
        theirs.close()
        for _, core in cores:  # that process holds them now: its end is the core's EOF
            core.conn.close()
        self.processes.append(p)
        self.controls.append(ours)

    def _watch(self) -> None:
        """An API process that exits while nobody asked it to: the whole server drains and exits with status 1."""
        left = {p.sentinel: p for p in self.processes}
        while left:
            for sentinel in multiprocessing.connection.wait(list(left)):
                p = left.pop(sentinel)
                p.join()
                if not self.draining:
                    self.server.request_exit(1, f"API server process {p.name} (pid {p.pid}) exited with status "
                                                f"{p.exitcode}")

    def drain(self) -> None:
        """Tell the others to drain (the first one started to)."""
        with self._lock:
            self.draining = True
        for conn in self.controls:
            try:
                conn.send(("drain", self.server.exit_code))
            except OSError:  # that one is gone already
                pass

    def join(self) -> None:
        """Wait for the others to finish their drain; kill what is left after it."""
        timeout = self.server.shutdown_timeout + DRAIN_MARGIN_S + JOIN_MARGIN_S
        for p in self.processes:
            p.join(timeout)
            if p.is_alive():
                p.kill()
                p.join(5)
        for conn in self.controls:
            conn.close()


def starting(serving: Any, count: int) -> Callable[[], bool]:
    """The router's `starting` for N API processes: True until the shared count of the others that serve is N - 1."""
    return lambda: serving.value < count - 1


def run_api_server(index: int, count: int, config: str | None, overrides: dict[str, Any],
                   cores: list[tuple[str, CoreProcess]], control: Any, serving: Any, log_level: int) -> None:
    """Another API process: the same config, its engines attached to the given cores, a socket of its own on the
    port; `serving` counts the other processes that serve."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the first API process decides when to stop
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s %(name)s [api server {index}]: "
                                                f"%(message)s")
    from kvgate.engine.engine_core import freeze_gc_heap
    from kvgate.engine.pipe_reader import SWITCH_INTERVAL_S
    from kvgate.gateway.config import load_config

    cfg = load_config(config, overrides)
    servers: list[GatewayServer] = []
    engines: list[AsyncLLMEngine] = []

    def attach(name: str, args: Any) -> AsyncLLMEngine:
        core_name, core = cores.pop(0)
        assert core_name == name, f"the deployments came in another order: {core_name} != {name}"

        def dead(engine: AsyncLLMEngine) -> None:
            if servers:
                servers[0].request_exit(1, f"{name}: {engine.death}")
        engines.append(AsyncLLMEngine.from_engine_args(args, on_dead=dead, core=core))
        return engines[-1]

    server = make_server(cfg, attach, handle_signals=False)
    server.router.starting = starting(serving, count)
    servers.append(server)
    threading.Thread(target=_follow, args=(control, server, serving), name="kvgate-api-server-control",
                     daemon=True).start()
    for engine in engines:  # attached: ready once each has its tokenizer
        engine.wait_loaded()
    freeze_gc_heap()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    say(f"API server {index} of {count} (pid {os.getpid()}) serving")
    server.run(sockets=[bind_socket(cfg.host, cfg.port)])
    sys.exit(server.exit_code)


def _follow(control: Any, server: GatewayServer, serving: Any) -> None:
    """Count this process in once it serves; drain when the first API process says so; exit at once when it is
    gone."""
    while not server.started and not server.should_exit:
        time.sleep(0.02)
    if server.started:
        with serving.get_lock():
            serving.value += 1
    try:
        while True:
            kind, code = control.recv()
            if kind == "drain":
                server.request_exit(code, "the first API process is draining")
    except (EOFError, OSError):
        say("the first API process is gone: exiting now")
        os._exit(1)


def make_server(cfg: Any, engine_factory: Callable[[str, Any], AsyncLLMEngine], handle_signals: bool = True
                ) -> GatewayServer:
    """The router (its embedded engines made by `engine_factory(name, args)`), the app and the HTTP server of a
    GatewayConfig."""
    from kvgate.gateway.app import create_app
    from kvgate.gateway.router_config import build_router

    router = build_router(cfg, engine_factory=engine_factory)  # remote deployments, routes, fallbacks included
    app = create_app(router, api_keys=cfg.api_keys, max_body_bytes=cfg.max_body_bytes,
                     max_queue_len=cfg.max_queue_len, log_requests=not cfg.disable_log_requests)
    return GatewayServer(app, router, cfg.host, cfg.port, cfg.shutdown_timeout, cfg.timeout_keep_alive,
                         handle_signals=handle_signals)
