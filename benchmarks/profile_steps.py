"""Where a step's time goes, on the GPU and on the host: the nano-vllm workload (benchmarks/throughput.py) stepped by
hand, a torch-profiler window over some of its steps.

  python benchmarks/profile_steps.py --model benchmarks/configs/qwen3-0.6b --load-format dummy
  python benchmarks/profile_steps.py ... --window 300 340      # steps 300..339 (decode steps of ~230 sequences)

Prints, for the window: its wall time per step, the GPU's busy time per step (the union of its kernels' intervals),
and so the share of the wall time the GPU sat idle waiting on the host; then the kernels by GPU time. Also replays
the largest decode CUDA graph alone at a few context lengths (the GPU floor of a decode step, without the host).
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import device_name  # noqa: E402

from kvgate.engine import LLM, SamplingParams  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def busy_us(events) -> tuple[float, float]:
    """(union of the kernels' intervals, their summed durations), in microseconds."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    if not spans:
        return 0.0, 0.0
    union, cur_s, cur_e = 0.0, *spans[0]
    for s, e in spans[1:]:
        if s > cur_e:
            union += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    union += cur_e - cur_s
    return union, sum(e - s for s, e in spans)


def profile_window(engine, first: int, last: int) -> None:
    from torch.profiler import DeviceType, ProfilerActivity, profile

    step = 0
    while engine.has_unfinished_requests() and step < first:
        engine.step()
        step += 1
    seqs = len(engine.scheduler.running)
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        n = 0
        while engine.has_unfinished_requests() and step < last:
            engine.step()
            step += 1
            n += 1
        sync()
        wall = (time.perf_counter() - t0) * 1e6
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    union, total = busy_us(kernels)
    if not kernels:  # CPU: the host's time only
        print(f"# window: steps {first}..{step - 1} ({n} steps, {seqs} running): wall {wall / n / 1000:.2f} ms a step")
        return
    print(f"# window: steps {first}..{step - 1} ({n} steps, {seqs} running at its start)")
    print(f"# per step: wall {wall / n / 1000:.2f} ms, GPU busy {union / n / 1000:.2f} ms "
          f"(kernels summed {total / n / 1000:.2f} ms), GPU idle {100 * (1 - union / wall):.0f}% of the wall time")
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e.name] = by_name.get(e.name, 0.0) + e.time_range.elapsed_us()
    print("# kernels by GPU time (ms per step, share)")
    for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:22]:
        print(f"{us / n / 1000:8.3f}  {100 * us / total:5.1f}%  {name[:110]}")
    host = {}
    for e in prof.key_averages():
        if e.key.startswith(("cudaGraphLaunch", "cudaLaunchKernel", "cuLaunchKernel", "cudaMemcpyAsync",
                             "cudaStreamSynchronize", "cudaEventSynchronize", "aten::item", "aten::_local_scalar")):
            host[e.key] = (e.count, e.cpu_time_total)
    print("# host calls in the window: " + ", ".join(f"{k} {c}x {t / 1000:.1f} ms" for k, (c, t) in host.items()))


def replay_floor(engine) -> None:
    """The largest decode graph replayed alone, every sequence at the same context length."""
    graphs = engine.runner.graphs
    if graphs is None:
        return
    bs = graphs.sizes[-1]
    blocks = engine.runner.num_blocks
    for ctx in (128, 512, 1024, 2048):
        nb = -(-ctx // graphs.block_size)
        if bs * nb > blocks:
            continue
        graphs.block_tables[:bs, :nb] = torch.arange(bs * nb, device=graphs.block_tables.device,
                                                     dtype=torch.int32).view(bs, nb)
        graphs.seq_lens[:bs] = ctx
        graphs.slot_mapping[:bs] = -1
        for _ in range(3):
            graphs.graphs[(bs, 0)].replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        reps = 20
        for _ in range(reps):
            graphs.graphs[(bs, 0)].replay()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) / reps * 1000
        print(f"# decode graph alone: batch {bs}, context {ctx}: {ms:.2f} ms ({bs / ms * 1000:,.0f} tok/s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="benchmarks/configs/qwen3-0.6b")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--max-input", type=int, default=1024)
    ap.add_argument("--max-output", type=int, default=1024)
    ap.add_argument("--window", type=int, nargs=2, action="append", default=None,
                    help="profile steps FIRST..LAST-1 (repeatable; default: 2..12 and 300..340)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    llm = LLM(args.model, load_format=args.load_format, skip_tokenizer_init=True, max_num_seqs=256)
    engine = llm.engine
    rng = random.Random(args.seed)
    vocab = min(10000, engine.config.model_config.vocab_size)
    print(f"# {device_name()}, torch {torch.__version__}, model {args.model}")
    replay_floor(engine)
    for first, last in args.window or [(2, 12), (300, 340)]:
        rng.seed(args.seed + first)
        for i in range(args.num_seqs):
            ids = [rng.randrange(0, vocab) for _ in range(rng.randint(100, args.max_input))]
            engine.add_request(str(i), {"prompt_token_ids": ids},
                               SamplingParams(temperature=0.6, max_tokens=rng.randint(100, args.max_output), ignore_eos=True))
        profile_window(engine, first, last)
        engine.abort_request([str(i) for i in range(args.num_seqs)])


if __name__ == "__main__":
    main()
