"""Where an engine's steps spend their time, from the logs of benchmarks/step_log/sitecustomize.py: per process, the
steps by size (tokens) with their mean wall time, the part spent waiting for the GPU and the rest (the host's work:
scheduling, building and launching the step, completing the one before), and in the engine core's loop the waits
for commands and the emits of outputs; for an API process, how long its requests took to reach the engine. A step
that waits ~0 for the GPU was bound by the host.

  python benchmarks/step_log/summarize.py DIR [DIR ...]
"""
from __future__ import annotations

import argparse
import glob
import os

BUCKETS = (64, 128, 256, 384, 512, 1024, 2048, 1 << 30)  # upper bounds of the step sizes (tokens), inclusive


def pct(xs: list[float], p: float) -> float:
    return xs[min(len(xs) - 1, int(len(xs) * p / 100))]


def read(path: str) -> dict[str, list[list[float]]]:
    rows: dict[str, list[list[float]]] = {"step": [], "drain": [], "emit": [], "add": [], "first": [], "submit": []}
    with open(path) as f:
        for line in f:
            kind, *vals = line.split("\t")
            try:
                rows[kind].append([float(v) for v in vals])
            except (KeyError, ValueError):  # a line cut short by a process killed while writing it
                pass
    return rows


def latencies(rows: list[list[float]], what: str) -> None:
    ms = sorted(r[1] * 1e3 for r in rows)
    if ms:
        print(f"   {what}: p50 {pct(ms, 50):.1f} ms, p90 {pct(ms, 90):.1f}, p99 {pct(ms, 99):.1f}, max {ms[-1]:.1f} "
              f"({len(ms)} requests)")


def summarize(path: str) -> None:
    rows = read(path)
    name = f"{os.path.basename(os.path.dirname(path)) or '.'}/{os.path.basename(path)}"
    if rows["submit"]:  # an API process
        print(f"## {name} (API process)")
        latencies(rows["submit"], "HTTP request to its submission to the engine")
    steps = [r for r in rows["step"] if r[3] > 0]  # calls that started a step: start wall wait tokens seqs decodes out
    if not steps:
        return
    t0 = steps[0][0]
    t1 = max(r[0] + r[1] for r in rows["step"])
    span = t1 - t0
    within = lambda rs: [r for r in rs if t0 <= r[0] <= t1]  # noqa: E731
    drains, emits = within(rows["drain"]), within(rows["emit"])
    calls = within(rows["step"])
    step_s, wait_s = sum(r[1] for r in calls), sum(r[2] for r in calls)
    drain_s, emit_s = sum(r[1] for r in drains), sum(r[1] for r in emits)
    print(f"## {name}: {len(steps)} steps over "
          f"{span:.2f} s ({span / len(steps) * 1e3:.2f} ms a step), {sum(r[3] for r in steps) / len(steps):.0f} tokens "
          f"a step")
    print(f"   step calls {step_s:.2f} s (GPU wait {wait_s:.2f}, host {step_s - wait_s:.2f}), waits for commands "
          f"{drain_s:.2f} s ({len(drains)}, {sum(r[2] for r in drains):.0f} requests added), emits {emit_s:.2f} s "
          f"({len(emits)}), the rest {span - step_s - drain_s - emit_s:.2f} s")
    latencies(rows["add"], "arrival to the core's add")  # every request (the first add comes before any step)
    latencies(rows["first"], "arrival to the first token (engine TTFT)")
    print("   | step tokens | steps | decode-only | wall ms | GPU wait ms | host ms | steps waiting < 0.05 ms |")
    print("   |---|---|---|---|---|---|---|")
    lo = 0
    for hi in BUCKETS:
        b = [r for r in steps if lo < r[3] <= hi]
        if b:
            n = len(b)
            print(f"   | {lo + 1}-{hi if hi < 1 << 30 else ''} | {n} | {sum(r[5] == r[4] for r in b)} | "
                  f"{sum(r[1] for r in b) / n * 1e3:.2f} | {sum(r[2] for r in b) / n * 1e3:.2f} | "
                  f"{sum(r[1] - r[2] for r in b) / n * 1e3:.2f} | {100 * sum(r[2] < 5e-5 for r in b) / n:.0f}% |")
        lo = hi


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+")
    for d in ap.parse_args().dirs:
        for path in sorted(glob.glob(os.path.join(d, "steps-*.tsv"))):
            summarize(path)


if __name__ == "__main__":
    main()
