"""Were two busy processes on hyperthreads of one physical core? Reads the samples that benchmarks/serving_gpu.sh
takes twice a second ("PID CPU" lines: the logical CPU each process's main thread last ran on) and says how often
the API process (the first pid) and its busiest child (the engine core's process) sat on one physical core.

  python benchmarks/cpu_placement.py SAMPLES API_PID CHILD_PID...
"""
from __future__ import annotations

import sys


def physical_cores() -> dict[int, tuple[str, str]]:
    """Logical CPU -> (package, core), from /proc/cpuinfo."""
    cores = {}
    for block in open("/proc/cpuinfo").read().split("\n\n"):
        f = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in block.splitlines())}
        if "processor" in f:
            cores[int(f["processor"])] = (f.get("physical id", "0"), f.get("core id", f["processor"]))
    return cores


def cpu_ticks(pid: str) -> int:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def main() -> None:
    path, api, *children = sys.argv[1:]
    core = physical_cores()
    busiest = max(children, key=cpu_ticks)
    last: dict[str, int] = {}
    pairs = []
    for line in open(path):
        pid, _, cpu = line.strip().partition(" ")
        if not cpu:
            continue
        last[pid] = int(cpu)
        if pid == busiest and api in last:
            pairs.append((core.get(last[api]), core.get(last[busiest])))
    same = sum(a == b for a, b in pairs)
    print(f"API process {api} and engine core {busiest} on one physical core in {same} of {len(pairs)} samples "
          f"({len(core)} logical CPUs, {len(set(core.values()))} physical cores)")


if __name__ == "__main__":
    main()
