"""Online serving benchmark, the measures of `vllm bench serve`: an asyncio load generator against a running
OpenAI-compatible server (kvgate or any other), streaming completions with random token-id prompts.
ttft_p99_later_ms leaves out the first `concurrency` requests (they start together, each opening its connection).
client_cpu_pct_max: the busiest load-generator process's CPU over the level (near 100: the client limits, not the
server; add --workers).

  kvgate serve --port 8000 &
  python benchmarks/serving.py --base-url http://127.0.0.1:8000/v1 --model SmolLM2-135M-Instruct \\
      --input-len 128 --output-len 128 --concurrency 1 8 32 --num-prompts 64

With --engine-metrics (a kvgate server), each level also says where the engine loop's time went, from the server's
/metrics before and after it: steps, busy ms a step (scheduling, the forward and the wait for it, sampling, outputs),
emit ms a step (outputs handed over: pickled into the engine core's pipe), the share of the time the loop was busy,
tokens a step, and the engine's own time to first token (its p50 and p99 as histogram bucket bounds).
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
    start = time.time()
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
    return {"ttft": ttft, "itl": itl, "tpot": tpot, "tokens": tokens, "latency": end - t0, "start": start}


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
                try:
                    return await one_request(client, url, args.model, p, args.output_len, args.api_key)
                except httpx.HTTPError as e:  # counted and reported (vLLM's benchmark too), not the level's end
                    return {"error": f"{type(e).__name__}: {e}"}

        await client.get(args.base_url.rstrip("/") + "/models")  # connect and import before the clock starts
        await asyncio.sleep(max(0.0, start_at - time.time()))
        results = await asyncio.gather(*(guarded(p) for p in prompts))
        return list(results), time.time()


def _worker(job: tuple[argparse.Namespace, int, list[list[int]], float]) -> tuple[list[dict], float, float]:
    """(results, when the last finished, this process's CPU seconds while sending them)."""
    cpu = time.process_time()
    results, end = asyncio.run(run_requests(*job))
    return results, end, time.process_time() - cpu


LOOP_METRICS = ("kvgate:engine_steps_total", "kvgate:engine_loop_busy_seconds_total",
                "kvgate:engine_loop_emit_seconds_total", "vllm:iteration_tokens_total_sum",
                "vllm:iteration_tokens_total_count")
TTFT = "vllm:time_to_first_token_seconds_bucket"


def loop_metrics(base_url: str) -> dict:
    """The engine loop's counters and its TTFT histogram (le -> count) from a kvgate server's /metrics (summed over
    its models), and when they were read."""
    text = httpx.get(base_url.rstrip("/").removesuffix("/v1") + "/metrics", timeout=10).text
    totals: dict = dict.fromkeys(LOOP_METRICS, 0.0)
    ttft: dict[float, float] = {}
    for line in text.splitlines():
        name, _, rest = line.partition("{")
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
        elif name == TTFT:
            le = float(rest.split('le="', 1)[1].split('"', 1)[0])
            ttft[le] = ttft.get(le, 0.0) + float(line.rsplit(" ", 1)[1])
    return {**totals, "ttft": ttft, "time": time.time()}


def bucket_pct(cumulative: dict[float, float], q: float) -> float:
    """The upper bound of the histogram bucket holding the q-th percentile."""
    total = max(cumulative.values(), default=0.0)
    return next((le for le, n in sorted(cumulative.items()) if n >= q / 100 * total), float("nan"))


def loop_columns(before: dict, after: dict) -> dict:
    """The engine loop between two readings: steps, busy and emit ms a step, the share of the wall time it was busy
    (the counters move at the end of each turn), tokens a step, and the engine's own TTFT p50 / p99 (from its
    arrival in the engine to the first token's step; histogram bucket bounds)."""
    d = {k: after[k] - before[k] for k in LOOP_METRICS}
    steps = max(d["kvgate:engine_steps_total"], 1)
    busy, emit = d["kvgate:engine_loop_busy_seconds_total"], d["kvgate:engine_loop_emit_seconds_total"]
    ttft = {le: n - before["ttft"].get(le, 0.0) for le, n in after["ttft"].items()}
    return {"steps": int(d["kvgate:engine_steps_total"]), "busy_ms_step": round(busy / steps * 1e3, 2),
            "emit_ms_step": round(emit / steps * 1e3, 3),
            "loop_busy_pct": round(100 * (busy + emit) / max(after["time"] - before["time"], 1e-9), 1),
            "tok_step": round(d["vllm:iteration_tokens_total_sum"] / max(d["vllm:iteration_tokens_total_count"], 1), 1),
            "engine_ttft_p50_le_ms": round(bucket_pct(ttft, 50) * 1e3),
            "engine_ttft_p99_le_ms": round(bucket_pct(ttft, 99) * 1e3)}


def run_level(args: argparse.Namespace, concurrency: int, prompts: list[list[int]]) -> dict:
    """One concurrency level; with --workers N the clients are split over N processes (so that the load
    generator's own Python is not what limits a fast server)."""
    n = max(1, min(args.workers, concurrency))
    start_at = time.time() + (0.2 if n == 1 else 5.0)  # time for the worker processes to start and import
    before = None
    if n == 1:
        before = loop_metrics(args.base_url) if args.engine_metrics else None
        results, end, cpu = _worker((args, concurrency, prompts, start_at))
        cpus = [cpu]
    else:
        jobs = [(args, concurrency // n + (1 if i < concurrency % n else 0), prompts[i::n], start_at)
                for i in range(n)]
        with multiprocessing.get_context("spawn").Pool(n) as pool:
            pending = pool.map_async(_worker, jobs, chunksize=1)
            if args.engine_metrics:  # the engine's counters from the common start on, not the workers' start-up
                time.sleep(max(0.0, start_at - 0.05 - time.time()))
                before = loop_metrics(args.base_url)
            parts = pending.get()
        results = [r for part, _, _ in parts for r in part]
        end = max(t for _, t, _ in parts)
        cpus = [c for _, _, c in parts]
    secs = end - start_at  # from the common start to the last response
    failed = [r["error"] for r in results if "error" in r]
    if failed:
        print(f"# {len(failed)} of {len(results)} requests failed at concurrency {concurrency}; the first: "
              f"{failed[0]}", file=sys.stderr)
        if len(failed) == len(results):
            raise SystemExit(f"every request failed at concurrency {concurrency}: {failed[0]}")
    sent, results = len(results), [r for r in results if "error" not in r]
    ttft = [r["ttft"] * 1e3 for r in results]
    # the requests after the first `concurrency` (those all start together, with their connections): steady state
    steady = [r["ttft"] * 1e3 for r in sorted(results, key=lambda r: r["start"])[concurrency:]]
    tpot = [r["tpot"] * 1e3 for r in results]
    itl = [x * 1e3 for r in results for x in r["itl"]]
    out = sum(r["tokens"] for r in results)
    row = {"concurrency": concurrency, "requests": sent, "failed": len(failed), "req_s": round(len(results) / secs, 2),
           "output_tok_s": round(out / secs, 1), "ttft_p50_ms": round(statistics.median(ttft), 1),
           "ttft_p99_ms": round(pct(ttft, 99), 1), "ttft_p99_later_ms": round(pct(steady, 99), 1),
           "tpot_p50_ms": round(statistics.median(tpot), 2),
           "tpot_p99_ms": round(pct(tpot, 99), 2), "itl_p50_ms": round(pct(itl, 50), 2),
           "itl_p99_ms": round(pct(itl, 99), 2), "client_cpu_pct_max": round(100 * max(cpus) / secs, 1)}
    if before is not None:
        row |= loop_columns(before, loop_metrics(args.base_url))
    return row


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
    ap.add_argument("--engine-metrics", action="store_true",
                    help="a kvgate server: add the engine loop's figures over each level (from its /metrics)")
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
