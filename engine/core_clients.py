"""One engine core shared by several API processes (`kvgate serve --api-server-count N`), each on a pipe of its own.

Request ids and call ids are made by each API process, so the core tags them with the client's index on the way in
("{i}/{request id}", (i, call id)) and takes the tag off on the way out: each client gets only its own outputs,
failures and call results, with every turn's stats. A client that sends "stop", or whose pipe closes (its process
ended), leaves: its requests are aborted (their KV blocks freed on the next turn) and its pipe is closed, which its
reader sees as the core's end. The core stops when the last client has left.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable

from kvgate.engine.engine_core import CoreOutputs
from kvgate.engine.pipe_reader import PipeReader

logger = logging.getLogger(__name__)
FINISHED = 6  # a DeltaTuple's `finished`


class CoreClients:
    def __init__(self, conns: list[Any], inbox: "queue.Queue[tuple]",
                 send: Callable[[Any, CoreOutputs], bool]) -> None:
        """`send(conn, outputs)` writes one client's outputs, False when that client's pipe is gone."""
        self.conns, self.inbox, self.send = conns, inbox, send
        self.owned: list[set[str]] = [set() for _ in conns]  # tagged ids of each client's requests in flight
        self.left: set[int] = set()  # clients that left (their pipes are closed, or about to be)
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
        """A turn's CoreOutputs, split by client, their tags taken off; every client still here gets the stats."""
        parts = [CoreOutputs(stats=out.stats) for _ in self.conns]
        for o in out.outputs:
            if type(o) is tuple:
                tagged, finished = o[0], o[FINISHED]
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
        with self._send_lock:
            for i, part in enumerate(parts):
                if i not in self.left and not self.send(self.conns[i], part):
                    self.leave(i)  # its process is gone: its reader meets the pipe's end and closes it
