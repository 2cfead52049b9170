"""Reading a multiprocessing Connection's messages in bursts: every whole message that is waiting, from one read.

Each side of the engine core's pipe reads it on a thread of its own while its main thread (the event loop, or the
engine loop) runs Python. A thread that comes back from a blocking read needs the GIL, and waits for it up to the
switch interval (5 ms by default) while the main thread holds it. `Connection.recv()` takes two reads per message
(its length, then its bytes), so a burst of 200 requests reached an engine loop busy in Python in 21-242 ms (runs
differ), while the API process's event loop sat blocked in writes to the full pipe (benchmarks/pipe_handoff.py).
Reading everything waiting at once, up to 1 MiB a read, takes one GIL wait per burst: 11-16 ms with the 1 ms
switch interval below.

Both processes also shorten that wait: SWITCH_INTERVAL_S is their switch interval (a thread that wants the GIL
gets it within 1 ms; nothing changes while only one thread runs).

The framing is Connection's own (a 4-byte big-endian signed length; -1 and an 8-byte length for messages of 2 GiB
or more), so the other side keeps writing with `Connection.send`.
"""
from __future__ import annotations

import os
import pickle
import struct
from typing import Any

READ_SIZE = 1 << 20
SWITCH_INTERVAL_S = 0.001  # sys.setswitchinterval() of the engine core's process and of the API process beside it
_LEN, _LONG_LEN = struct.Struct("!i"), struct.Struct("!Q")


class PipeReader:
    """Reads messages sent with `Connection.send` on the other end of `conn`. Use this or `conn.recv()`, not
    both: what this has read ahead is not in the pipe any more."""

    def __init__(self, conn: Any) -> None:
        self.fd = conn.fileno()
        self.buf = bytearray()

    def read(self) -> list[Any]:
        """Every whole message waiting, in order (at least one: blocks until one has come). Raises EOFError once
        the other end is closed and no whole message is left (a message cut by a dying writer is dropped)."""
        while True:
            messages = self._parse()
            if messages:
                return messages
            data = os.read(self.fd, READ_SIZE)
            if not data:
                raise EOFError
            self.buf += data

    def _parse(self) -> list[Any]:
        buf, pos, out = self.buf, 0, []
        view = memoryview(buf)
        try:
            while len(buf) - pos >= 4:
                (size,), start = _LEN.unpack_from(buf, pos), pos + 4
                if size == -1:
                    if len(buf) - start < 8:
                        break
                    (size,), start = _LONG_LEN.unpack_from(buf, start), start + 8
                if len(buf) - start < size:
                    break
                out.append(pickle.loads(view[start:start + size]))
                pos = start + size
        finally:
            view.release()  # a bytearray with a live view cannot be resized
        if pos:
            del buf[:pos]
        return out
