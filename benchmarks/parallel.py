"""Tensor and pipeline parallelism side by side on one host's GPUs: for each layout (TP x PP), in a process of its
own, the engine's greedy tokens on fixed prompts, compared with the first layout's (the matched tokens: the common
prefix of each prompt's continuation, as match_hf.py counts them; in bf16 a different order of the sums can turn a
near-tie), then the nano-vllm throughput workload (throughput.py's: random prompts, ignore_eos), and the KV blocks
the layout has.

  python benchmarks/parallel.py --model benchmarks/configs/llama-3-8b --load-format dummy --layouts 1x1 2x1 1x2
  python benchmarks/parallel.py --model benchmarks/configs/llama-3-70b --load-format dummy --layouts 2x1 \\
      --max-model-len 2048 --greedy-prompts 0
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import append_results, device_name, matched, print_table  # noqa: E402


def run_layout(args: argparse.Namespace) -> dict:
    """One layout in this process: greedy tokens, throughput, KV blocks."""
    import torch

    from kvgate.engine import LLM, SamplingParams
    from throughput import workload

    tp, pp = (int(x) for x in args.run.split("x"))
    kw = dict(load_format=args.load_format, dtype=args.dtype, tensor_parallel_size=tp, pipeline_parallel_size=pp,
              max_num_seqs=args.max_num_seqs, skip_tokenizer_init=args.load_format == "dummy",
              enforce_eager=args.enforce_eager)
    if args.max_model_len:
        kw["max_model_len"] = args.max_model_len
    t0 = time.perf_counter()
    llm = LLM(args.model, **kw)
    load_s = time.perf_counter() - t0
    try:
        vocab = llm.engine.config.model_config.vocab_size
        rng = random.Random(7)
        prompts = [[rng.randrange(100, min(vocab, 10000)) for _ in range(rng.randint(4, 200))]
                   for _ in range(args.greedy_prompts)]
        greedy = SamplingParams(temperature=0.0, max_tokens=args.greedy_tokens, ignore_eos=True)
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] if prompts else []
        row = {"tokens": tokens, "load_s": round(load_s, 1), "kv_blocks": llm.engine.runner.num_blocks,
               "graphs": llm.engine.runner.graphs is not None, "dtype": str(llm.engine.config.dtype)}
        if args.num_seqs:
            reqs = workload(args, vocab)
            params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True) for _, n in reqs]
            sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
            sync()
            t0 = time.perf_counter()
            outs = llm.generate([p for p, _ in reqs], params)
            sync()
            secs = time.perf_counter() - t0
            out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            assert out_tokens == sum(n for _, n in reqs), "every request must produce exactly its max_tokens"
            row.update(seconds=round(secs, 2), output_tok_s=round(out_tokens / secs, 1))
        return row
    finally:
        llm.engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(HERE, "configs", "llama-3-8b"))
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--layouts", nargs="+", default=["1x1", "2x1", "1x2"], help="TPxPP, the first is the reference")
    ap.add_argument("--greedy-prompts", type=int, default=16)
    ap.add_argument("--greedy-tokens", type=int, default=64)
    ap.add_argument("--num-seqs", type=int, default=256, help="the throughput workload (0: none)")
    ap.add_argument("--min-input", type=int, default=100)
    ap.add_argument("--max-input", type=int, default=1024)
    ap.add_argument("--min-output", type=int, default=100)
    ap.add_argument("--max-output", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=900, help="seconds for each layout")
    ap.add_argument("--record", default=None, help="a label: append the rows to benchmarks/RESULTS.md")
    ap.add_argument("--run", default=None, help=argparse.SUPPRESS)  # internal: one layout, JSON to --out
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run:
        logging.basicConfig(level=os.environ.get("LOG_LEVEL", "WARNING"),
                            format="%(asctime)s rank 0 %(levelname)s %(message)s")
        with open(args.out, "w") as f:
            json.dump(run_layout(args), f)
        return
    rows, ref, ref_tps = [], None, None
    for layout in args.layouts:
        out = os.path.join(tempfile.mkdtemp(), "layout.json")
        cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--run", layout, "--out", out]
        try:
            code = subprocess.run(cmd, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
        if code != 0 or not os.path.exists(out):
            rows.append({"TPxPP": layout, "status": f"failed ({code})"})
            print(f"# {layout} failed ({code})", flush=True)
            continue
        with open(out) as f:
            r = json.load(f)
        if ref is None:
            ref = r["tokens"]
        total = sum(len(t) for t in ref)
        same = matched(r["tokens"], ref)
        tps = r.get("output_tok_s")
        ref_tps = ref_tps or tps
        rows.append({"TPxPP": layout, "status": "ok", "dtype": r["dtype"].replace("torch.", ""),
                     "graphs": r["graphs"], "kv_blocks": r["kv_blocks"],
                     "greedy_matched": f"{same}/{total}" if total else "-",
                     "output_tok_s": tps if tps is not None else "-",
                     "vs_first": round(tps / ref_tps, 2) if tps and ref_tps else "-", "load_s": r["load_s"]})
        print(f"# {layout}: {rows[-1]}", flush=True)
    import torch

    print(f"# parallel layouts on {torch.cuda.device_count()} x {device_name()}, torch {torch.__version__}, "
          f"model {args.model} ({args.load_format}); workload {args.num_seqs} seqs, input U[{args.min_input},"
          f"{args.max_input}], output U[{args.min_output},{args.max_output}]")
    print_table(rows)
    if args.record:
        append_results(args.record, " ".join(sys.argv), rows)


if __name__ == "__main__":
    main()
