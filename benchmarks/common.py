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


def print_table(rows: list[dict]) -> None:
    cols = list(rows[0])
    widths = [max(len(str(c)), *(len(str(r.get(c, ""))) for r in rows)) for c in cols]
    print("  ".join(str(c).ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(str(r.get(c, "")).ljust(w) for c, w in zip(cols, widths)))


def append_results(label: str, command: str, rows: list[dict]) -> None:
    """Append a dated markdown table (label, machine, versions, command) to benchmarks/RESULTS.md."""
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
    with open(RESULTS, "a") as f:
        f.write("\n".join(lines) + "\n")
