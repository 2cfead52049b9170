"""Shared helpers for benchmark scripts: a plain-text table and dated rows appended to RESULTS.md."""
from __future__ import annotations

import datetime
import os
import platform

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU ({os.cpu_count()} cores, {platform.machine()})"


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def matched(a: list[list[int]], b: list[list[int]]) -> int:
    """Greedy tokens two runs share: the common prefix of each prompt's continuation, summed."""
    return sum(common_prefix(x, y) for x, y in zip(a, b))


def print_table(rows: list[dict]) -> None:
    cols = list(rows[0])
    widths = [max(len(str(c)), *(len(str(r.get(c, ""))) for r in rows)) for c in cols]
    print("  ".join(str(c).ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(str(r.get(c, "")).ljust(w) for c, w in zip(cols, widths)))


def append_results(label: str, command: str, rows: list[dict], section: str | None = None, note: str = "") -> None:
    """Append a dated markdown table (label, machine, versions, command, then `note`) to benchmarks/RESULTS.md: at
    the end of the file, or last in `section` (a "## ..." heading, added at the end when it is missing)."""
    try:
        import triton

        triton_v = triton.__version__
    except ImportError:
        triton_v = "none"
    import transformers

    cols = list(rows[0])
    lines = [f"\n### {label}: {datetime.date.today().isoformat()}, {device_name()}",
             f"torch {torch.__version__}, triton {triton_v}, transformers {transformers.__version__}, "
             f"python {platform.python_version()}", f"`{command}`", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    if note:
        lines += ["", note]
    entry = "\n".join(lines) + "\n"
    if section is None:
        with open(RESULTS, "a") as f:
            f.write(entry)
        return
    with open(RESULTS) as f:
        text = f.read()
    if section not in text:
        text = text.rstrip("\n") + f"\n\n{section}\n"
    end = text.find("\n## ", text.index(section) + len(section))  # the entry goes last in its section
    end = len(text) if end < 0 else end + 1
    with open(RESULTS, "w") as f:
        f.write(text[:end].rstrip("\n") + "\n" + entry + ("\n" + text[end:] if end < len(text) else ""))
