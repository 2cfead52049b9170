"""Compile every Triton kernel of kvgate for a GPU, on a machine without one (run by tests/test_kernels_compile.py,
in a process of its own: Triton's interpreter must be off here).

The kernels' interpreter tests run their Python on the CPU, and the interpreter lets through what the compiler
refuses (a kernel reading a plain global, as triton_sample did for a day: every sampled step on a GPU failed). Here
each public wrapper is called with CPU tensors of the shapes and dtypes the engine uses, and each launch is compiled
for the target instead (`triton.compile` down to a cubin: Triton's own front end, MLIR passes and ptxas) and not
run. Prints one line per compiled kernel configuration; exits non-zero on the first error.

  python tests/triton_compile_check.py [--arch 90]
"""
from __future__ import annotations

import argparse
import inspect
import os
import sys

assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "run with Triton's interpreter off"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import BaseBackend, GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction, native_specialize_impl  # noqa: E402

TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int64: "i64",
         torch.int32: "i32", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1"}
OPTIONS = ("num_warps", "num_stages", "num_ctas")


def _type(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {value!r}")


def compile_instead(target: GPUTarget, seen: dict[tuple, str]):
    """A JITFunction.run that compiles the launch for `target` and runs nothing."""
    def run(self: JITFunction, *args, grid=None, warmup=False, **kwargs):
        options = {k: kwargs.pop(k) for k in OPTIONS if k in kwargs}
        bound = inspect.signature(self.fn).bind(*args, **kwargs)
        bound.apply_defaults()
        signature, constexprs, attrs = {}, {}, {}
        for param, (name, value) in zip(self.params, bound.arguments.items()):
            if param.is_constexpr or value is None:
                signature[name], constexprs[name] = "constexpr", value
            elif isinstance(value, int) and not isinstance(value, bool):  # as Triton keys a launch: its type by
                # value, 1 as a constant, multiples of 16 apart (unless the kernel says do_not_specialize)
                kind, attrs[name] = native_specialize_impl(BaseBackend, value, False, not param.do_not_specialize,
                                                           True)
                if kind == "constexpr":
                    signature[name], constexprs[name] = "constexpr", value
                else:
                    signature[name] = kind
            else:
                signature[name] = _type(value)
        key = (self.fn.__name__, tuple(signature.items()), tuple(constexprs.items()), tuple(attrs.items()),
               tuple(options.items()))
        if key not in seen:
            kernel = triton.compile(ASTSource(self, signature, constexprs=constexprs), target=target,
                                    options=options)
            seen[key] = kernel.name
            print(f"compiled {self.fn.__name__} {constexprs} {options}", flush=True)
    return run


def launches() -> None:
    """The wrappers, called as the engine calls them: bf16 and fp32 caches (fp16 takes bf16's paths), GQA groups,
    head dims 128 and 80 (padded), decode with and without split-K, prefill, the KV store, the fused small ops and
    the sampling kernel (a step's seed is any 32-bit value; the kernel takes its low 31 bits as one int32 argument)."""
    from kvgate.kernels import triton_decode, triton_fused, triton_prefill, triton_sample, triton_store

    for dtype in (torch.bfloat16, torch.float32):
        for kvh, group, d in ((8, 2, 128), (1, 8, 80)):
            blocks, bs, seqs = 32, 16, 3
            k_cache = torch.zeros(blocks, bs, kvh, d, dtype=dtype)
            v_cache = torch.zeros_like(k_cache)
            table = torch.zeros(seqs, 8, dtype=torch.int32)
            lens = torch.tensor([5, 70, 128], dtype=torch.int32)
            q = torch.zeros(seqs, kvh * group, d, dtype=dtype)
            for parts in (None, 32):  # the default rule, and split-K forced (with its reduce kernel)
                triton_decode.paged_decode(q, k_cache, v_cache, table, lens, 0.1, 128, partition_size=parts)
            tokens = 20
            qp = torch.zeros(tokens, kvh * group, d, dtype=dtype)
            kv = torch.zeros(tokens, kvh, d, dtype=dtype)
            starts = torch.tensor([0, 5, 12, 20], dtype=torch.int32)
            triton_prefill.paged_prefill(qp, kv, kv, k_cache, v_cache, table, starts, lens, 8, 0.1)
            triton_store.store_kvcache(kv, kv, k_cache, v_cache, torch.arange(tokens, dtype=torch.int64))
        x = torch.zeros(6, 256, dtype=dtype)
        w = torch.ones(256, dtype=dtype)
        triton_fused.rms_norm(x, w, 1e-6)
        triton_fused.rms_norm(x, w, 1e-6, torch.zeros_like(x))
        qkv = torch.zeros(6, (8 + 2 * 2) * 64, dtype=dtype)
        qr, kr = qkv[:, :512].view(6, 8, 64), qkv[:, 512:640].view(6, 2, 64)
        cos = torch.zeros(64, 32, dtype=torch.float32)
        triton_fused.rotary(torch.arange(6), qr, kr, cos, cos)
        triton_fused.qk_norm_rotary(torch.arange(6), qr, kr, w[:64], w[:64], 1e-6, cos, cos)
        triton_fused.silu_and_mul(torch.zeros(6, 2 * 384, dtype=dtype))
    logits = torch.zeros(4, 1000)
    for step_seed in (0xDEADBEEF, 5, 16, 1):  # the sampler's random step seeds: one configuration for all
        triton_sample.sample(logits, torch.ones(4), step_seed)
    triton_sample.sample(logits, torch.ones(4), torch.tensor([1, 2, 3, 4]))
    words = (logits.shape[1] + 31) // 32  # guided rows: the grammar's bitmask, for every row or some, with UTF-8's
    bitmask = torch.zeros(4, words, dtype=torch.int32)
    triton_sample.sample(logits, torch.ones(4), 7, bitmask=bitmask)
    triton_sample.sample(logits, torch.ones(4), 7, bitmask=bitmask, mask_rows=torch.tensor([0, -1, 2, -1],
                         dtype=torch.int32), valid=torch.zeros(words, dtype=torch.int32))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="the CUDA compute capability (90: H100 / H200)")
    args = ap.parse_args()
    seen: dict[tuple, str] = {}
    JITFunction.run = compile_instead(GPUTarget("cuda", args.arch, 32), seen)  # type: ignore[method-assign]
    launches()
    print(f"{len(seen)} kernel configurations compiled for sm_{args.arch}: "
          f"{' '.join(sorted({k[0] for k in seen}))}")


if __name__ == "__main__":
    sys.exit(main())
