"""Start-up time of `kvgate serve`: from launching the process to /health's first answer (503 loading) and to its
first 200, with the model already on disk (the default model converted once beforehand).

  python benchmarks/startup.py --runs 3 [-- --config config.yaml]     # arguments after -- go to kvgate serve
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import append_results, print_table  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(serve_args: list[str], timeout: float) -> dict:
    port = free_port()
    with tempfile.TemporaryFile("w+") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "kvgate.gateway.cli", "serve", "--port", str(port),
                                 *serve_args], stdout=log, stderr=subprocess.STDOUT)
        first = ready = None
        try:
            while time.perf_counter() - t0 < timeout and proc.poll() is None:
                try:
                    r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
                    first = first or time.perf_counter() - t0
                    if r.status_code == 200:
                        ready = time.perf_counter() - t0
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        log.seek(0)
        loads = re.findall(r": ready in ([\d.]+)s", log.read())
    if ready is None:
        raise SystemExit(f"kvgate serve did not become healthy within {timeout} s")
    return {"first /health answer (s)": round(first, 2), "/health 200 (s)": round(ready, 2),
            "model load (s)": ", ".join(loads)}


def main() -> None:
    argv = sys.argv[1:]
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--record", default=None, help="a label: append the rows to benchmarks/RESULTS.md")
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    rows = [{"run": i + 1, **one_run(serve_args, args.timeout)} for i in range(args.runs)]
    print(f"# kvgate serve start-up {' '.join(serve_args)}")
    print_table(rows)
    if args.record:
        append_results(args.record, shlex.join(["python", "benchmarks/startup.py", *sys.argv[1:]]), rows)


if __name__ == "__main__":
    main()
