"""Every Triton kernel compiles for the GPUs kvgate runs on (sm_90: H100 / H200), checked on a machine without one:
tests/triton_compile_check.py calls the kernels' wrappers with CPU tensors and compiles each launch down to a cubin
instead of running it, in a process of its own with Triton's interpreter off. The interpreter tests check what the
kernels compute; this checks what only the compiler refuses (a kernel that reads a plain Python global ran under the
interpreter and failed on every GPU), and that a kernel's scalar arguments that change every step do not make
Triton compile it again."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

KERNELS = {"_decode_kernel", "_reduce_kernel", "_prefill_kernel", "_store_kvcache_kernel", "_rms_norm_kernel",
           "_rotary_kernel", "_qk_norm_rotary_kernel", "_silu_and_mul_kernel", "_sample_kernel"}


def test_every_kernel_compiles_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("triton_compile_check.py")
    run = subprocess.run([sys.executable, str(script), "--arch", "90"], capture_output=True, text=True, env=env,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    last = run.stdout.strip().splitlines()[-1]
    assert last.endswith("compiled for sm_90: " + " ".join(sorted(KERNELS))), last
    assert int(last.split()[0]) >= 20  # each kernel in several configurations
    # the sampling kernel: a plain step, per-row seeds, and masks for all rows or some. Four step seeds, as the
    # sampler draws them, take one configuration: a new one would compile mid-run (a seed >= 2**31 typed int64, a
    # multiple of 16 or 1 specialized), stalling the step that met it
    assert sum(line.startswith("compiled _sample_kernel ") for line in run.stdout.splitlines()) == 4, run.stdout
