"""The engine core's pipe under a busy GIL: how long messages take to cross while the reading side's main thread runs
Python (engine/pipe_reader.py says why that matters).

Two processes, as `kvgate serve` runs them (the API process and the engine core's), each side's reader on a thread
of its own while its main thread spins in Python, the way a host-bound engine loop or a saturated event loop does:
- commands: the parent sends a burst of `--burst` "add" commands (a real SamplingParams, a 128-token prompt) to a
  child whose engine loop takes them from its inbox between 5 ms "steps"; reported: how long the parent's sends
  took (its event loop is blocked that long) and when the child's loop had the last one;
- outputs: the child sends one CoreOutputs of `--streams` DELTA outputs every 5 ms step for 2 s (it sleeps in
  between, as a core waiting on its GPU does) to a parent whose main thread spins; reported: how late each turn
  reached the parent's reader (p50 / p99 / max) and the child's time in `send()` (pickling included).
Each for the readers `recv` (Connection.recv(), one message at a time) and `burst` (engine/pipe_reader.py), at
switch intervals of 5 ms (Python's default) and 1 ms.

    python benchmarks/pipe_handoff.py [--burst 200] [--streams 200]
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import queue
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table  # noqa: E402

from kvgate.engine.engine_core import CoreOutputs, freeze_gc_heap, merge_core_outputs  # noqa: E402
from kvgate.engine.outputs import CompletionOutput, RequestOutput  # noqa: E402
from kvgate.engine.pipe_reader import PipeReader  # noqa: E402
from kvgate.engine.sampling_params import SamplingParams  # noqa: E402

STEP_S = 0.005


def spin(seconds: float) -> None:
    """Run Python (holding the GIL but for its switch interval) for `seconds`."""
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        for i in range(200):
            x += i * i


def reader_thread(conn, mode: str, on_messages) -> threading.Thread:
    def run() -> None:
        reader = PipeReader(conn) if mode == "burst" else None
        while True:
            try:
                messages = reader.read() if reader is not None else [conn.recv()]
            except (EOFError, OSError):
                return
            on_messages(time.perf_counter(), messages)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def command_child(conn, mode: str, switch: float, burst: int) -> None:
    freeze_gc_heap()  # as both of kvgate's processes do
    sys.setswitchinterval(switch)
    inbox: queue.Queue = queue.Queue()
    reader_thread(conn, mode, lambda _, cmds: [inbox.put(c) for c in cmds])
    conn.send("ready")
    got = 0
    while got < burst:  # the engine loop: a step, then every command waiting
        spin(STEP_S)
        while not inbox.empty():
            inbox.get_nowait()
            got += 1
    conn.send(time.perf_counter())


def output_child(conn, switch: float, streams: int, seconds: float) -> None:
    freeze_gc_heap()
    sys.setswitchinterval(switch)
    conn.recv()  # go
    blocked, turns = 0.0, int(seconds / STEP_S)
    for turn in range(turns):
        time.sleep(STEP_S)  # the step runs on the GPU (a spinning core would need a third core on a 2-core machine)
        out = CoreOutputs([RequestOutput(f"cmpl-{i:032x}", None, [], [CompletionOutput(0, "ab", [1234 + turn])],
                                         False) for i in range(streams)])
        out.stats = time.perf_counter()  # the send time rides along (any picklable value does)
        t = time.perf_counter()
        conn.send(out)
        blocked += time.perf_counter() - t
    conn.send(("done", blocked, turns))


def commands(mode: str, switch: float, burst: int) -> dict:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=command_child, args=(child, mode, switch, burst))
    p.start()
    child.close()
    parent.recv()
    time.sleep(0.3)
    cmd = ("add", "cmpl-" + "0" * 32, {"prompt_token_ids": list(range(1000, 1128))},
           SamplingParams(temperature=0, max_tokens=128, ignore_eos=True), 0, None, time.monotonic())
    t0 = time.perf_counter()
    for _ in range(burst):
        parent.send(cmd)
    sent = time.perf_counter() - t0
    done = parent.recv() - t0
    p.join()
    return {"sends blocked ms": f"{sent * 1e3:.1f}", "all in the engine loop ms": f"{done * 1e3:.1f}"}


def outputs(mode: str, switch: float, streams: int, seconds: float) -> dict:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=output_child, args=(child, switch, streams, seconds))
    p.start()
    child.close()
    old = sys.getswitchinterval()
    sys.setswitchinterval(switch)
    late: list[float] = []
    end: list = []

    def on_messages(now: float, messages: list) -> None:
        for m in messages:
            if isinstance(m, tuple):
                end.append(m)
        turns = [m for m in messages if isinstance(m, CoreOutputs)]
        if turns:
            merge_core_outputs(turns)  # what AsyncLLMEngine does with a burst
            late.extend(now - m.stats for m in turns)

    t = reader_thread(parent, mode, on_messages)
    parent.send("go")
    while not end:  # a saturated event loop
        spin(0.01)
    sys.setswitchinterval(old)
    p.join()
    parent.close()
    t.join(5)
    _, blocked, turns = end[0]
    late.sort()
    return {"turns late p50 ms": f"{statistics.median(late) * 1e3:.2f}",
            "p99 ms": f"{late[int(0.99 * (len(late) - 1))] * 1e3:.2f}", "max ms": f"{late[-1] * 1e3:.2f}",
            "core's send() calls ms": f"{blocked * 1e3:.0f} in {turns * STEP_S * 1e3:.0f}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--burst", type=int, default=200, help="commands sent at once")
    ap.add_argument("--streams", type=int, default=200, help="outputs per turn")
    ap.add_argument("--seconds", type=float, default=2.0, help="of turns, in the outputs test")
    args = ap.parse_args()
    freeze_gc_heap()
    rows = []
    for mode in ("recv", "burst"):
        for switch in (0.005, 0.001):
            rows.append({"reader": mode, "switch interval ms": switch * 1e3,
                         **commands(mode, switch, args.burst), **outputs(mode, switch, args.streams, args.seconds)})
    print_table(rows)


if __name__ == "__main__":
    main()
