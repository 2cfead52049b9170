"""Multi-turn conversations over long shared prefixes, with the KV offload tier off and on (issue 18's benchmark).

N users, each with a long prefix of their own (a system prompt and a document), take T turns: every turn resends
the prefix and the conversation so far with a new question. Users take their turns in rounds (all N users' turn 1,
then all turn 2, ...), so between two turns of a user the others' prefixes pass through the device's KV cache.
The device pool is shrunk (--device-blocks) so that the prefixes together are several times its size: without
the tier, a user's prefix is evicted before their next turn and prefilled again; with it, it comes back from CPU
memory. Reported per mode: TTFT p50/p99 of turns 2.. (turn 1 always prefills), throughput, prefix-cache hits.
With --disk-gib a third run puts a disk tier below a smaller CPU tier: the prefixes the CPU tier cannot hold come
back from files.

  python benchmarks/multiturn.py                                       # CPU: the default model, 8 users x 1024
  python benchmarks/multiturn.py --model benchmarks/configs/qwen3-0.6b --load-format dummy --prefix-len 4096 \\
      --users 16 --device-blocks 1024 --tier-gib 8                      # GPU
  python benchmarks/multiturn.py --disk-gib 1                          # CPU tier 1 GiB, then 0.25 GiB + disk
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import append_results, device_name, print_table  # noqa: E402

from kvgate.engine import LLM, SamplingParams  # noqa: E402

SECTION = "## Multi-turn conversations and the KV offload tier (`benchmarks/multiturn.py`)"


def conversations(args: argparse.Namespace, vocab: int) -> list[list[list[int]]]:
    """users x turns prompts: each user's prefix, then per turn the earlier turns' questions and answers (made-up
    ids standing for the replies) and a new question."""
    rng = random.Random(args.seed)
    ids = lambda n: [rng.randrange(3, min(vocab, 30000)) for _ in range(n)]  # noqa: E731
    out = []
    for _ in range(args.users):
        history, turns = ids(args.prefix_len), []
        for _ in range(args.turns):
            history = history + ids(args.question_len)
            turns.append(list(history))
            history = history + ids(args.output_len)
        out.append(turns)
    return out


def run(args: argparse.Namespace, tier_gib: float, disk_gib: float = 0.0) -> dict:
    kw = dict(load_format=args.load_format, num_gpu_blocks_override=args.device_blocks,
              max_num_seqs=args.max_num_seqs, kv_offloading_size=tier_gib, kv_offloading_eviction=args.eviction,
              skip_tokenizer_init=args.load_format == "dummy")
    if disk_gib:
        kw.update(kv_offloading_disk_dir=args.disk_dir or tempfile.mkdtemp(prefix="kvgate-disk-"),
                  kv_offloading_disk_size=disk_gib)
    if args.model:
        kw["model"] = args.model
    t0 = time.perf_counter()
    llm = LLM(**kw)
    start = time.perf_counter() - t0
    convs = conversations(args, llm.engine.config.model_config.vocab_size)
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    ttft: list[float] = []
    tokens, t0 = 0, time.perf_counter()
    for turn in range(args.turns):  # one round: every user's next turn, submitted together
        outs = llm.generate([{"prompt_token_ids": c[turn]} for c in convs], sp)
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
        if turn > 0:
            ttft += [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outs]
    seconds = time.perf_counter() - t0
    bm = llm.engine.block_manager
    tier = bm.offload
    llm.engine.shutdown()
    q = statistics.quantiles(ttft, n=100) if len(ttft) > 1 else ttft * 99
    label = f"CPU {tier_gib:g} GiB ({args.eviction})" if tier_gib else "off"
    return {"tier": label + (f" + disk {disk_gib:g} GiB" if disk_gib else ""),
            "TTFT p50 ms": f"{q[49] * 1e3:,.0f}", "TTFT p99 ms": f"{q[98] * 1e3:,.0f}",
            "output tok/s": f"{tokens / seconds:,.1f}", "seconds": f"{seconds:.1f}",
            "prefix hit rate": f"{bm.prefix_cache_hit_rate:.1%}",
            "tier blocks loaded": tier.stats.loaded_blocks if tier else 0,
            "of them from disk": tier.stats.fetched_blocks if tier else 0, "start s": f"{start:.1f}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a local model (default: the default model)")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--prefix-len", type=int, default=1024, help="tokens of each user's system prompt + document")
    ap.add_argument("--question-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--device-blocks", type=int, default=128, help="KV blocks on the device (16 tokens each)")
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--tier-gib", type=float, default=1.0, help="the CPU tier's size for the run with it")
    ap.add_argument("--disk-gib", type=float, default=0.0, help="a third run with a disk tier of this size")
    ap.add_argument("--disk-tier-gib", type=float, default=None,
                    help="the CPU tier above the disk in that run (default: a quarter of --tier-gib)")
    ap.add_argument("--disk-dir", default=None, help="the disk tier's directory (default: a new temporary one)")
    ap.add_argument("--eviction", default="arc", choices=("arc", "lru"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--record", metavar="LABEL", help="append the table to benchmarks/RESULTS.md")
    args = ap.parse_args()
    working = args.users * (args.prefix_len + args.turns * (args.question_len + args.output_len))
    ratio = working / (args.device_blocks * 16)
    print(f"{device_name()}: {args.users} users x {args.turns} turns, prefixes of {args.prefix_len} tokens; "
          f"working set {working:,} tokens = {ratio:.1f}x the device's {args.device_blocks * 16:,}")
    rows = [run(args, 0.0), run(args, args.tier_gib)]
    if args.disk_gib:
        rows.append(run(args, args.disk_tier_gib or args.tier_gib / 4, args.disk_gib))
    print_table(rows)
    off, on = (float(r["TTFT p50 ms"].replace(",", "")) for r in rows[:2])
    print(f"TTFT p50: {off / on:.2f}x lower with the tier")
    if args.disk_gib:
        print(f"TTFT p50: {off / float(rows[2]['TTFT p50 ms'].replace(',', '')):.2f}x lower with CPU + disk")
    if args.record:
        append_results(args.record, "python " + " ".join(sys.argv), rows, SECTION,
                       note=f"Working set {ratio:.1f}x the device pool; TTFT of turns 2-{args.turns} "
                            f"(turn 1 always prefills): p50 {off / on:.2f}x lower with the tier.")


if __name__ == "__main__":
    main()
