"""Attention kernels on the GPU: correctness at real shapes, decode bandwidth and prefill TFLOP/s.

  python benchmarks/kernels.py --check              # Triton kernels vs torch twins, bf16, real shapes
  python benchmarks/kernels.py --decode --prefill   # timings (triton.testing.do_bench, CUDA events)

Decode: achieved bandwidth = K/V bytes of the batch's contexts / time, for kvgate's paged split-K kernel on a
shuffled paged cache, next to torch SDPA on the same K/V laid out contiguously ([batch, kv_heads, ctx, d],
GQA through enable_gqa, no paging) with its cuDNN and flash backends. Prefill: causal TFLOP/s of kvgate's
varlen paged prefill (no cached prefix) next to SDPA flash and cuDNN on one sequence of N tokens.
Every timing replays the call from a CUDA graph (triton.testing.do_bench_cudagraph): kernel time, not launch cost.
"""
from __future__ import annotations

import argparse
import os
import random
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import append_results, device_name, print_table  # noqa: E402

from kvgate.kernels.torch_ref import paged_decode_ref, paged_prefill_ref, store_kvcache_ref  # noqa: E402
from kvgate.kernels.triton_attention import paged_decode, paged_prefill, store_kvcache  # noqa: E402

SHAPES = {"qwen3-0.6b": (16, 8, 128), "llama-3-8b": (32, 8, 128)}  # (heads, kv_heads, head_dim)
def bench(fn) -> float:
    """Milliseconds per call on the GPU, replayed from a CUDA graph (as the engine's decode steps run), so that
    Python launch overhead (tens of microseconds for a Triton launch) does not hide the kernel's own time."""
    torch.cuda.synchronize()  # it runs fn on a stream of its own: the inputs, made on the default one, must be there
    return triton.testing.do_bench_cudagraph(fn)


SDPA = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


def paged_cache(seq_lens: list[int], block_size: int, kvh: int, d: int, dtype: torch.dtype, gen: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V caches with every sequence's blocks scattered (a shuffled permutation) and its block table."""
    blocks = [triton.cdiv(n, block_size) for n in seq_lens]
    num_blocks = sum(blocks)
    perm = torch.randperm(num_blocks, generator=gen, device="cuda").int()
    table = torch.zeros((len(seq_lens), max(blocks)), dtype=torch.int32, device="cuda")
    used = 0
    for i, nb in enumerate(blocks):
        table[i, :nb] = perm[used:used + nb]
        used += nb
    k = torch.randn((num_blocks, block_size, kvh, d), dtype=dtype, device="cuda", generator=gen)
    v = torch.randn_like(k)
    return k, v, table


def contiguous_kv(cache: torch.Tensor, table: torch.Tensor, ctx: int) -> torch.Tensor:
    """[batch, kv_heads, ctx, d] copy of equal-length sequences from the paged cache."""
    b = table.shape[0]
    return cache[table.long()].reshape(b, -1, *cache.shape[2:])[:, :ctx].transpose(1, 2).contiguous()


def check(dtype: torch.dtype) -> list[dict]:
    """Each kernel against its torch twin: block sizes 16/32/64, both real shapes, lengths at the edges."""
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape, (h, kvh, d) in SHAPES.items():
        for bs in (16, 32, 64):
            lens = [1, bs - 1, bs, bs + 1, 300, 2049, 8191]
            k_cache, v_cache, table = paged_cache(lens, bs, kvh, d, dtype, gen)
            seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
            q = torch.randn((len(lens), h, d), dtype=dtype, device="cuda", generator=gen)
            scale = d ** -0.5
            ref = paged_decode_ref(q.float(), k_cache.float(), v_cache.float(), table, seq_lens, scale)
            for part in (None, 256):
                out = paged_decode(q, k_cache, v_cache, table, seq_lens, scale, partition_size=part)
                rows.append({"kernel": "decode", "shape": shape, "block_size": bs, "split": part or "auto",
                             "max_abs_err": f"{(out.float() - ref).abs().max().item():.2e}"})
            # prefill/extend: 3 sequences, the second with a cached prefix (chunked prefill / prefix hit)
            q_lens, ctx = [700, 129, 1], [0, 517, 64]
            total = [a + b for a, b in zip(q_lens, ctx)]
            k_cache, v_cache, table = paged_cache(total, bs, kvh, d, dtype, gen)
            qsl = [0]
            for n in q_lens:
                qsl.append(qsl[-1] + n)
            t = qsl[-1]
            q = torch.randn((t, h, d), dtype=dtype, device="cuda", generator=gen)
            k_new = torch.randn((t, kvh, d), dtype=dtype, device="cuda", generator=gen)
            v_new = torch.randn_like(k_new)
            slots = torch.cat([table[i, (c + torch.arange(n, device="cuda")) // bs].long() * bs
                               + (c + torch.arange(n, device="cuda")) % bs
                               for i, (n, c) in enumerate(zip(q_lens, ctx))])
            k_ref, v_ref = k_cache.clone(), v_cache.clone()
            store_kvcache_ref(k_new, v_new, k_ref, v_ref, slots)
            store_kvcache(k_new, v_new, k_cache, v_cache, slots)
            rows.append({"kernel": "store", "shape": shape, "block_size": bs, "split": "-",
                         "max_abs_err": f"{max((k_cache - k_ref).abs().max().item(), (v_cache - v_ref).abs().max().item()):.2e}"})
            sl = torch.tensor(total, dtype=torch.int32, device="cuda")
            out = paged_prefill(q, k_new, v_new, k_cache, v_cache, table, torch.tensor(qsl, dtype=torch.int32,
                                device="cuda"), sl, max(q_lens), scale)
            ref = paged_prefill_ref(q.float(), k_ref.float(), v_ref.float(), table, qsl, total, scale)
            rows.append({"kernel": "prefill", "shape": shape, "block_size": bs, "split": "-",
                         "max_abs_err": f"{(out.float() - ref).abs().max().item():.2e}"})
    return rows


def check_fused(dtype: torch.dtype) -> list[dict]:
    """The fused small-op kernels at Qwen3-0.6B sizes against their torch twins computed in fp32."""
    from kvgate.engine.models.layers import RMSNorm, RotaryEmbedding, silu_and_mul
    from kvgate.kernels import triton_fused

    torch.manual_seed(0)
    t, hidden, (h, kvh, d), inter = 300, 1024, SHAPES["qwen3-0.6b"], 3072
    norm = RMSNorm(hidden, 1e-6).cuda()
    x, res = torch.randn(t, hidden, device="cuda"), torch.randn(t, hidden, device="cuda")
    want, want_res = norm(x.to(dtype).float(), res.to(dtype).float())
    got, got_res = triton_fused.rms_norm(x.to(dtype), norm.weight.to(dtype), norm.eps, res.to(dtype))
    def rel(a: torch.Tensor, b: torch.Tensor) -> str:  # bf16 keeps ~3 significant digits of values up to ~5
        return f"{((a.float() - b).abs().max() / b.abs().max()).item():.2e}"

    rows = [{"kernel": "rms_norm+residual (rel)", "max_abs_err": rel(got, want)},
            {"kernel": "residual sum (rel)", "max_abs_err": rel(got_res, want_res)}]
    rope = RotaryEmbedding(d, 40960, 1e6, None).cuda()
    qkv = torch.randn(t, (h + 2 * kvh) * d, device="cuda").to(dtype)
    q, k = qkv[:, : h * d].view(t, h, d), qkv[:, h * d:(h + kvh) * d].view(t, kvh, d)
    pos = torch.randint(0, 40960, (t,), device="cuda")
    want_q, _ = rope(pos, q.float(), k.float())
    got_q, _ = triton_fused.rotary(pos, q, k, rope.cos, rope.sin)
    rows.append({"kernel": "rotary (rel)", "max_abs_err": rel(got_q, want_q)})
    qn, kn = RMSNorm(d, 1e-6).cuda(), RMSNorm(d, 1e-6).cuda()
    qkv = torch.randn(t, (h + 2 * kvh) * d, device="cuda").to(dtype)
    q, k = qkv[:, : h * d].view(t, h, d), qkv[:, h * d:(h + kvh) * d].view(t, kvh, d)
    want_q, want_k = rope(pos, qn(q.float()), kn(k.float()))
    got_q, got_k = triton_fused.qk_norm_rotary(pos, q, k, qn.weight.to(dtype), kn.weight.to(dtype), qn.eps, rope.cos,
                                               rope.sin)
    rows.append({"kernel": "qk_norm_rotary q (rel)", "max_abs_err": rel(got_q, want_q)})
    rows.append({"kernel": "qk_norm_rotary k (rel)", "max_abs_err": rel(got_k, want_k)})
    a = torch.randn(t, 2 * inter, device="cuda").to(dtype)
    rows.append({"kernel": "silu_and_mul (rel)", "max_abs_err": rel(triton_fused.silu_and_mul(a), silu_and_mul(a.float()))})
    return [{"shape": "qwen3-0.6b", "block_size": "-", "split": "-", **r} for r in rows]


def bench_decode(h: int, kvh: int, d: int, dtype: torch.dtype, batches: list[int], ctxs: list[int],
                 block_size: int) -> list[dict]:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    elem = torch.empty(0, dtype=dtype).element_size()
    for b in batches:
        for ctx in ctxs:
            k_cache, v_cache, table = paged_cache([ctx] * b, block_size, kvh, d, dtype, gen)
            seq_lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
            q = torch.randn((b, h, d), dtype=dtype, device="cuda", generator=gen)
            out = torch.empty_like(q)
            scale = d ** -0.5
            gbytes = 2 * b * ctx * kvh * d * elem / 1e9
            ms = bench(lambda: paged_decode(q, k_cache, v_cache, table, seq_lens, scale, ctx, out))
            row = {"batch": b, "ctx": ctx, "kvgate_us": round(ms * 1e3, 1), "kvgate_TB/s": round(gbytes / ms, 2)}
            kc, vc = contiguous_kv(k_cache, table, ctx), contiguous_kv(v_cache, table, ctx)
            del k_cache, v_cache
            q4 = q[:, :, None, :]
            for name, backend in SDPA.items():
                try:
                    with sdpa_kernel(backend):
                        fn = lambda: F.scaled_dot_product_attention(q4, kc, vc, scale=scale, enable_gqa=True)  # noqa: E731
                        fn()
                        ms_s = bench(fn)
                    row[f"{name}_TB/s"] = round(gbytes / ms_s, 2)
                    row[f"vs_{name}"] = round(ms_s / ms, 2)
                except RuntimeError as e:  # the backend refuses this shape
                    row[f"{name}_TB/s"] = "n/a"
                    row[f"vs_{name}"] = str(e).split("\n")[0][:20]
            rows.append(row)
            del kc, vc
            torch.cuda.empty_cache()
    return rows


def sweep_decode(h: int, kvh: int, d: int, dtype: torch.dtype, batches: list[int], ctxs: list[int],
                 block_size: int, ragged: bool = False) -> list[dict]:
    """Tuning aid: decode time for forced partition sizes and (TILE_N, warps, stages) configs. `ragged`: context
    lengths drawn from U[ctx / 16, ctx] (as in a serving batch, where a few long sequences finish last) instead of
    all equal to ctx; by default large batches are not split at all."""
    from kvgate.kernels import triton_decode

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    lengths = random.Random(0)
    default_config = triton_decode.decode_config
    configs = [(64, 4, 2), (64, 4, 3), (32, 4, 3), (32, 2, 4), (64, 8, 3), (128, 8, 2)]
    for b in batches:
        for ctx in ctxs:
            lens = [lengths.randint(max(1, ctx // 16), ctx) if ragged else ctx for _ in range(b)]
            k_cache, v_cache, table = paged_cache(lens, block_size, kvh, d, dtype, gen)
            seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
            q = torch.randn((b, h, d), dtype=dtype, device="cuda", generator=gen)
            out = torch.empty_like(q)
            auto = bench(lambda: paged_decode(q, k_cache, v_cache, table, seq_lens, d ** -0.5, ctx, out))
            row = {"batch": b, "ctx": ctx, "auto_us": round(auto * 1e3, 1)}
            best = (auto, "auto")
            for part in (128, 192, 256, 320, 384, 512, 768, 1024):  # multiples of 64 between the powers of two too
                if ctx // part > 128:
                    continue
                for cfg in configs:
                    triton_decode.decode_config = lambda hd, dt, cfg=cfg: cfg
                    try:
                        ms = bench(lambda: paged_decode(q, k_cache, v_cache, table, seq_lens, d ** -0.5, ctx, out,
                                                        partition_size=part))
                    finally:
                        triton_decode.decode_config = default_config
                    if ms < best[0]:
                        best = (ms, f"part {part} tile {cfg[0]} warps {cfg[1]} stages {cfg[2]}")
            row["best_us"] = round(best[0] * 1e3, 1)
            row["best"] = best[1]
            rows.append(row)
            print(row, flush=True)
    return rows


def prefill_case(n: int, h: int, kvh: int, d: int, dtype: torch.dtype, block_size: int, gen: torch.Generator):
    """One causal sequence of n new tokens (no cached prefix): (a call of kvgate's prefill on it, its TFLOP,
    (q, k, v))."""
    q = torch.randn((n, h, d), dtype=dtype, device="cuda", generator=gen)
    k = torch.randn((n, kvh, d), dtype=dtype, device="cuda", generator=gen)
    v = torch.randn_like(k)
    k_cache, v_cache, table = paged_cache([n], block_size, kvh, d, dtype, gen)
    qsl = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    sl = torch.tensor([n], dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    call = lambda: paged_prefill(q, k, v, k_cache, v_cache, table, qsl, sl, n, d ** -0.5, out)  # noqa: E731
    return call, 2 * n * n * h * d / 1e12, (q, k, v)  # causal: half of 4 * n^2 * h * d


def bench_prefill(h: int, kvh: int, d: int, dtype: torch.dtype, lengths: list[int], block_size: int) -> list[dict]:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n in lengths:
        call, tflop, (q, k, v) = prefill_case(n, h, kvh, d, dtype, block_size, gen)
        scale = d ** -0.5
        ms = bench(call)
        row = {"tokens": n, "kvgate_us": round(ms * 1e3, 1), "kvgate_TFLOP/s": round(tflop / ms * 1e3, 1)}
        qt, kt, vt = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        for name, backend in SDPA.items():
            try:
                with sdpa_kernel(backend):
                    fn = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale,  # noqa: E731
                                                                enable_gqa=True)
                    fn()
                    ms_s = bench(fn)
                row[f"{name}_TFLOP/s"] = round(tflop / ms_s * 1e3, 1)
                row[f"vs_{name}"] = round(ms_s / ms, 2)
            except RuntimeError as e:
                row[f"{name}_TFLOP/s"] = "n/a"
                row[f"vs_{name}"] = str(e).split("\n")[0][:20]
        rows.append(row)
    return rows


def sweep_prefill(h: int, kvh: int, d: int, dtype: torch.dtype, lengths: list[int], block_size: int) -> list[dict]:
    """Tuning aid: prefill time for (BLOCK_M, BLOCK_N, warps, stages) configs, one causal sequence of N tokens."""
    from kvgate.kernels import triton_prefill

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    default_config = triton_prefill.prefill_config
    configs = [(128, 64, 8, 3), (128, 64, 8, 2), (128, 64, 4, 3), (128, 128, 8, 2), (128, 128, 8, 3),
               (128, 32, 4, 3), (64, 64, 4, 3), (64, 64, 4, 4), (64, 32, 4, 4)]
    for n in lengths:
        call, tflop, _ = prefill_case(n, h, kvh, d, dtype, block_size, gen)
        row: dict = {"tokens": n}
        best = (float("inf"), "")
        for cfg in configs:
            triton_prefill.prefill_config = lambda *_, cfg=cfg: cfg
            try:
                ms = bench(call)
            except Exception as e:  # noqa: BLE001 (out of shared memory: the config does not fit)
                print(f"# {cfg}: {str(e).splitlines()[0][:80]}", flush=True)
                continue
            finally:
                triton_prefill.prefill_config = default_config
            row["x".join(map(str, cfg))] = round(tflop / ms * 1e3, 1)
            if ms < best[0]:
                best = (ms, "x".join(map(str, cfg)))
        row["best (M x N x warps x stages)"] = best[1]
        rows.append(row)
        print(row, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare each kernel with its torch twin (bf16)")
    ap.add_argument("--decode", action="store_true")
    ap.add_argument("--prefill", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="try decode partition sizes and kernel configs")
    ap.add_argument("--ragged", action="store_true", help="--sweep with context lengths drawn from [ctx / 16, ctx]")
    ap.add_argument("--sweep-prefill", action="store_true", help="try prefill tile and pipeline configs (TFLOP/s)")
    ap.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64, 128, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192, 16384])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--record", default=None, help="a label: append the tables to benchmarks/RESULTS.md")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    h, kvh, d = SHAPES[args.shape]
    print(f"# {device_name()}, torch {torch.__version__}, triton {triton.__version__}, {args.shape} "
          f"(heads {h}, kv heads {kvh}, head_dim {d}), {args.dtype}, block_size {args.block_size}")
    cmd = "python benchmarks/kernels.py " + " ".join(sys.argv[1:])
    if args.check:
        rows = check(dtype) + check_fused(dtype)
        print_table(rows)
        worst = max(float(r["max_abs_err"]) for r in rows)
        print(f"# worst max abs error {worst:.2e} ({'ok' if worst < 3e-2 else 'TOO LARGE'})")
        if args.record:
            append_results(f"{args.record}: correctness", cmd, rows)
    if args.decode:
        rows = bench_decode(h, kvh, d, dtype, args.batches, args.contexts, args.block_size)
        print_table(rows)
        if args.record:
            append_results(f"{args.record}: decode", cmd, rows)
    if args.sweep:
        print_table(sweep_decode(h, kvh, d, dtype, args.batches, args.contexts, args.block_size, args.ragged))
    if args.sweep_prefill:
        print_table(sweep_prefill(h, kvh, d, dtype, args.lengths, args.block_size))
    if args.prefill:
        rows = bench_prefill(h, kvh, d, dtype, args.lengths, args.block_size)
        print_table(rows)
        if args.record:
            append_results(f"{args.record}: prefill", cmd, rows)
    if not (args.check or args.decode or args.prefill or args.sweep or args.sweep_prefill):
        ap.error("choose at least one of --check, --decode, --prefill")


if __name__ == "__main__":
    main()
