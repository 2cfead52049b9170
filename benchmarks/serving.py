"""Online serving benchmark, the measures of `vllm bench serve`: an asyncio load generator against a running
OpenAI-compatible server (kvgate or any other), streaming completions with random token-id prompts.

  kvgate serve --port 8000 &
  python benchmarks/serving.py --base-url http://127.0.0.1:8000/v1 --model SmolLM2-135M-Instruct \\
      --input-len 128 --output-len 128 --concurrency 1 8 32 --num-prompts 64
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import statistics
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import append_results, print_table  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], out_len: int,
                      key: str | None) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": out_len, "stream": True, "ignore_eos": True,
            "temperature": 0.0, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    t0 = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    async with client.stream("POST", url, json=body, headers=headers) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0].get("text"):
                stamps.append(time.perf_counter())
    end = time.perf_counter()
    ttft = (stamps[0] - t0) if stamps else end - t0
    itl = [b - a for a, b in zip(stamps, stamps[1:])]
    tpot = (end - t0 - ttft) / max(tokens - 1, 1)
    return {"ttft": ttft, "itl": itl, "tpot": tpot, "tokens": tokens, "latency": end - t0}


async def run_requests(args: argparse.Namespace, concurrency: int, prompts: list[list[int]], start_at: float
                       ) -> tuple[list[dict], float]:
    """Send the prompts from wall-clock time `start_at` on (every load-generator process starts together);
    returns the results and the wall-clock time the last one finished."""
    url = args.base_url.rstrip("/") + "/completions"
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        async def guarded(p: list[int]) -> dict:
            async with sem:
                return await one_request(client, url, args.model, p, args.output_len, args.api_key)

        await client.get(args.base_url.rstrip("/") + "/models")  # connect and import before the clock starts
        await asyncio.sleep(max(0.0, start_at - time.time()))
        results = await asyncio.gather(*(guarded(p) for p in prompts))
        return list(results), time.time()


def _worker(job: tuple[argparse.Namespace, int, list[list[int]], float]) -> tuple[list[dict], float]:
    return asyncio.run(run_requests(*job))


def run_level(args: argparse.Namespace, concurrency: int, prompts: list[list[int]]) -> dict:
    """One concurrency level; with --workers N the clients are split over N processes (so that the load
    generator's own Python is not what limits a fast server)."""
    n = max(1, min(args.workers, concurrency))
    start_at = time.time() + (0.2 if n == 1 else 5.0)  # time for the worker processes to start and import
    if n == 1:
        results, end = _worker((args, concurrency, prompts, start_at))
    else:
        jobs = [(args, concurrency // n + (1 if i < concurrency % n else 0), prompts[i::n], start_at)
                for i in range(n)]
        with multiprocessing.get_context("spawn").Pool(n) as pool:
            parts = pool.map(_worker, jobs, chunksize=1)
        results = [r for part, _ in parts for r in part]
        end = max(t for _, t in parts)
    secs = end - start_at  # from the common start to the last response
    ttft = [r["ttft"] * 1e3 for r in results]
    tpot = [r["tpot"] * 1e3 for r in results]
    itl = [x * 1e3 for r in results for x in r["itl"]]
    out = sum(r["tokens"] for r in results)
    return {"concurrency": concurrency, "requests": len(results), "req_s": round(len(results) / secs, 2),
            "output_tok_s": round(out / secs, 1), "ttft_p50_ms": round(statistics.median(ttft), 1),
            "ttft_p99_ms": round(pct(ttft, 99), 1), "tpot_p50_ms": round(statistics.median(tpot), 2),
            "tpot_p99_ms": round(pct(tpot, 99), 2), "itl_p50_ms": round(pct(itl, 50), 2),
            "itl_p99_ms": round(pct(itl, 99), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--vocab", type=int, default=10000, help="prompt token ids are drawn from [100, vocab)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=1, help="load-generator processes (clients split evenly)")
    ap.add_argument("--record", default=None, help="a label: append the rows to benchmarks/RESULTS.md")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    rows = []
    for c in args.concurrency:
        prompts = [[rng.randrange(100, args.vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
        rows.append(run_level(args, c, prompts))
    print(f"# serving: {args.model} at {args.base_url}, input {args.input_len}, output {args.output_len}, "
          f"{args.num_prompts} requests per level, {args.workers} load-generator process(es)")
    print_table(rows)
    if args.record:
        append_results(args.record, " ".join(sys.argv), rows)


if __name__ == "__main__":
    main()
