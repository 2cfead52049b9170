"""One engine core shared by several API processes (`kvgate serve --api-server-count N`), each on a pipe of its own.

Request ids and call ids are made by each API process, so the core tags them with the client's index on the way in
("{i}/{request id}", (i, call id)) and takes the tag off on the way out: each client gets only its own outputs,
failures and call results, with the turn's stats. A client that sends "stop", or whose pipe closes (its process
ended), leaves: its requests are aborted (their KV blocks freed on the next turn) and its pipe is closed, which its
reader sees as the core's end. The core stops when the last client has left.

A client with nothing of its own in a turn gets that turn's stats only if its last ones are STATS_EVERY_S old: a
client still starting up (not reading yet) would otherwise fill its pipe within a few hundred steps, and the core's
writes to it would then wait for it. When the core goes idle, every client gets the latest stats (`flush`).
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable

from kvgate.engine.engine_core import CoreOutputs
from kvgate.engine.outputs import DELTA_FINISHED
from kvgate.engine.pipe_reader import PipeReader

STATS_EVERY_S = 0.1


class CoreClients:
    def __init__(self, conns: list[Any], inbox: "queue.Queue[tuple]",
                 send: Callable[[Any, CoreOutputs], bool]) -> None:
        """`send(conn, outputs)` writes one client's outputs, False when that client's pipe is gone."""
        self.conns, self.inbox, self.send = conns, inbox, send
        self.owned: list[set[str]] = [set() for _ in conns]  # tagged ids of each client's requests in flight
        self.left: set[int] = set()  # clients that left (their pipes are closed, or about to be)
        self.last_sent = [0.0] * len(conns)  # time.monotonic() of each client's last message
        self.behind: set[int] = set()  # clients that missed the latest stats
        self.stats: Any = None  # the latest stats
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()  # a pipe is closed only between two turns' sends

    def start(self) -> None:
        for i in range(len(self.conns)):
            threading.Thread(target=self._read, args=(i,), name=f"kvgate-core-input-{i}", daemon=True).start()

    def _read(self, i: int) -> None:
        """Client i's commands into the inbox, tagged, until it stops or its pipe closes."""
        reader, tag, owned = PipeReader(self.conns[i]), f"{i}/", self.owned[i]
        while True:
            try:
                cmds = reader.read()
            except (EOFError, OSError):
                cmds = [("stop",)]
            for cmd in cmds:
                kind = cmd[0]
                if kind == "add":
                    owned.add(tag + cmd[1])
                    self.inbox.put((kind, tag + cmd[1], *cmd[2:]))
                elif kind == "abort":
                    self.inbox.put((kind, tag + cmd[1]))
                elif kind == "call":
                    self.inbox.put((kind, (i, cmd[1]), cmd[2]))
                elif kind == "stop":
                    self.leave(i)
                    with self._send_lock:
                        self.conns[i].close()
                    return
                else:
                    self.inbox.put(cmd)

    def leave(self, i: int) -> None:
        """Client i is gone: nothing more is sent to it, its requests are aborted, and after the last client the
        core stops."""
        with self._lock:
            if i in self.left:
                return
            self.left.add(i)
            last = len(self.left) == len(self.conns)
        self.inbox.put(("abort", list(self.owned[i])))
        if last:
            self.inbox.put(("stop",))

    def emit(self, out: CoreOutputs) -> None:
        """A turn's CoreOutputs, split by client, their tags taken off, each part with the turn's stats (a part with
        nothing else goes only to a client whose last stats are STATS_EVERY_S old)."""
        parts = [CoreOutputs(stats=out.stats) for _ in self.conns]
        for o in out.outputs:
            if type(o) is tuple:
                tagged, finished = o[0], o[DELTA_FINISHED]
                i, _, rid = tagged.partition("/")
                o = (rid, *o[1:])
            else:
                tagged, finished = o.request_id, o.finished
                i, _, o.request_id = tagged.partition("/")
            i = int(i)
            if finished:
                self.owned[i].discard(tagged)
            parts[i].outputs.append(o)
        for tagged, error in out.failed:
            i, _, rid = tagged.partition("/")
            self.owned[int(i)].discard(tagged)
            parts[int(i)].failed.append((rid, error))
        for (i, cid), error, value in out.results:
            parts[i].results.append((cid, error, value))
        self.stats = out.stats if out.stats is not None else self.stats
        self._send(parts, skip_stats_only=True)

    def flush(self) -> None:
        """The latest stats to every client that missed them (the core is idle)."""
        if self.behind:
            self._send([CoreOutputs(stats=self.stats) if i in self.behind else None for i in range(len(self.conns))])

    def _send(self, parts: list[CoreOutputs | None], skip_stats_only: bool = False) -> None:
        now = time.monotonic()
        with self._send_lock:
            for i, part in enumerate(parts):
                if part is None or i in self.left:
                    continue
                if skip_stats_only and not (part.outputs or part.failed or part.results) and \
                        now - self.last_sent[i] < STATS_EVERY_S:
                    self.behind.add(i)
                    continue
                self.behind.discard(i)
                self.last_sent[i] = now
                if not self.send(self.conns[i], part):
                    self.leave(i)  # its process is gone: its reader meets the pipe's end and closes it
