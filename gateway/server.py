"""The HTTP server's life: uvicorn with kvgate's own signal handling, the graceful drain and the exit status.

On SIGTERM or SIGINT the server stops accepting connections, and the requests in flight get `shutdown_timeout`
seconds to finish. Those still running then are aborted: an embedded engine frees their KV blocks and their
clients get an error (a stream ends with an error event, then [DONE]); a relay to a remote upstream is cut
DRAIN_MARGIN_S later by uvicorn's own cancellation. Then the engines stop and `run()` returns with `exit_code`
0: a drained shutdown is a success, not death by a signal (uvicorn would re-raise the signal: status 143). A
second signal during the drain exits at once (status 128 + the signal's number); engine core processes then
stop on their own, as their pipe closes. `request_exit(1, why)` starts the same drain from any thread (kvgate
serve does so when an engine dies for good), ending with that status.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from typing import Any, Callable, Iterator

import uvicorn

from kvgate.gateway.router import ModelRouter

DRAIN_MARGIN_S = 5.0  # after the aborts, how long connections get to send their last bytes before being cut
SIGNALS = (signal.SIGINT, signal.SIGTERM)


def say(text: str) -> None:
    """One line on stderr, written at once (also safe inside a signal handler, unlike print)."""
    os.write(2, f"[kvgate] {text}\n".encode())


class GatewayServer(uvicorn.Server):
    def __init__(self, app: Any, router: ModelRouter, host: str, port: int, shutdown_timeout: float,
                 timeout_keep_alive: float, handle_signals: bool = True) -> None:
        """`timeout_keep_alive`: seconds an idle connection stays open (GatewayConfig's, which has the default).
        `handle_signals` False: SIGTERM / SIGINT are left alone (another API process of kvgate serve's, which drains
        when the first one tells it to: gateway/api_servers.py)."""
        super().__init__(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                        timeout_keep_alive=timeout_keep_alive,
                                        timeout_graceful_shutdown=shutdown_timeout + DRAIN_MARGIN_S))
        self.router, self.shutdown_timeout, self.handle_signals = router, shutdown_timeout, handle_signals
        self.exit_code = 0
        self.signals = 0  # SIGTERM / SIGINT received
        self.on_drain: list[Callable[[], None]] = []  # called as the drain starts

    def request_exit(self, code: int, reason: str) -> None:
        """Start the graceful shutdown (callable from any thread); `run()` then returns with `exit_code` = `code`
        unless a shutdown had already begun (its status stands)."""
        if self.should_exit:
            return
        say(f"{reason}: stopping (exit status {code}); requests in flight get up to {self.shutdown_timeout:g} s")
        self.exit_code = code
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """SIGTERM / SIGINT start the drain, a second one exits at once; nothing is re-raised afterwards."""
        if threading.current_thread() is not threading.main_thread() or not self.handle_signals:
            yield  # signals reach the main thread only
            return
        previous = {sig: signal.signal(sig, self._on_signal) for sig in SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame: Any) -> None:
        self.signals += 1
        name = signal.Signals(sig).name
        if self.signals > 1:
            say(f"{name} again: exiting now, without waiting for {self.router.in_flight()} requests in flight")
            os._exit(128 + sig)  # engine core processes stop on their own when their pipe closes
        if self.should_exit:  # already draining (an engine died): this signal only arms the second one
            return
        say(f"{name}: no new connections; {self.router.in_flight()} requests in flight get up to "
            f"{self.shutdown_timeout:g} s to finish (send {name} again to exit at once)")
        self.should_exit = True

    async def shutdown(self, sockets: Any = None) -> None:
        """uvicorn's shutdown (stop accepting, wait for the connections, the lifespan's end: router.close() stops
        the engines), with the requests still in flight after `shutdown_timeout` seconds aborted."""
        for fn in self.on_drain:
            fn()
        deadline = asyncio.get_running_loop().call_later(self.shutdown_timeout, self._abort_the_rest)
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

    def _abort_the_rest(self) -> None:
        n = self.router.abort_all(f"the server is shutting down, and this request did not finish within the "
                                  f"shutdown timeout ({self.shutdown_timeout:g} s)")
        relayed = self.router.in_flight() - n  # the aborted ones are still counted until their streams close
        say(f"shutdown timeout ({self.shutdown_timeout:g} s): aborted {n} requests"
            + (f"; {relayed} relayed to remote upstreams are cut in {DRAIN_MARGIN_S:g} s" if relayed > 0 else ""))
