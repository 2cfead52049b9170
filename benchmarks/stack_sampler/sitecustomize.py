"""A poor man's sampling profiler for every Python process started with this directory on PYTHONPATH (the
gateway and its engine core process alike): a thread reads the other threads' stacks every few milliseconds and
rewrites $KVGATE_STACKS_DIR/stacks-<pid>.txt every 5 s with the most frequent innermost frames per thread, so
that a server that is killed still leaves its figures. Without KVGATE_STACKS_DIR it does nothing.

  PYTHONPATH=benchmarks/stack_sampler:$PYTHONPATH KVGATE_STACKS_DIR=/tmp/stacks kvgate serve ...
"""
import collections
import os
import sys
import threading
import time

_DIR = os.environ.get("KVGATE_STACKS_DIR")


def _where(frame, depth: int = 3) -> str:
    parts = []
    while frame is not None and len(parts) < depth:
        code = frame.f_code
        parts.append(f"{os.path.basename(code.co_filename)}:{code.co_name}")
        frame = frame.f_back
    return " < ".join(parts)


def _sample(interval: float = 0.002) -> None:
    me = threading.get_ident()
    counts: dict = collections.defaultdict(collections.Counter)
    totals: collections.Counter = collections.Counter()
    last_dump = time.monotonic()
    path = os.path.join(_DIR, f"stacks-{os.getpid()}.txt")
    while True:
        time.sleep(interval)
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            if ident == me:
                continue
            name = names.get(ident, str(ident))
            counts[name][_where(frame)] += 1
            totals[name] += 1
        if time.monotonic() - last_dump > 5:
            last_dump = time.monotonic()
            with open(path, "w") as f:
                f.write(f"# pid {os.getpid()} {' '.join(sys.argv)[:200]}\n")
                for name, total in totals.most_common():
                    f.write(f"\n## thread {name}: {total} samples\n")
                    for where, n in counts[name].most_common(25):
                        f.write(f"{100 * n / total:5.1f}%  {where}\n")


if _DIR:
    os.makedirs(_DIR, exist_ok=True)
    threading.Thread(target=_sample, name="stack-sampler", daemon=True).start()
