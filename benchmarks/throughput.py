"""Offline throughput: the nano-vllm workload (random prompts, ignore_eos) through kvgate's engine,
optionally next to transformers' batched `generate` on the same model and requests (--compare-hf).

  python benchmarks/throughput.py                                 # 256 seqs, lengths U[100, 1024]
  python benchmarks/throughput.py --num-seqs 16 --min-input 100 --max-input 200 --min-output 128 --max-output 128
  python benchmarks/throughput.py --model benchmarks/configs/qwen3-0.6b --load-format dummy --compare-hf
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import append_results, device_name, print_table  # noqa: E402

from kvgate.engine import LLM, SamplingParams  # noqa: E402


def workload(args: argparse.Namespace, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    return [([rng.randrange(0, min(vocab, 10000)) for _ in range(rng.randint(args.min_input, args.max_input))],
             rng.randint(args.min_output, args.max_output)) for _ in range(args.num_seqs)]


def run_kvgate(args: argparse.Namespace) -> tuple[dict, list[tuple[list[int], int]]]:
    kw = dict(load_format=args.load_format, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              enable_prefix_caching=not args.no_prefix_caching, skip_tokenizer_init=args.load_format == "dummy")
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.attention_backend:
        kw["attention_backend"] = args.attention_backend
    if args.max_model_len:
        kw["max_model_len"] = args.max_model_len
    t0 = time.perf_counter()
    llm = LLM(args.model, **kw)
    load_s = time.perf_counter() - t0
    reqs = workload(args, llm.engine.config.model_config.vocab_size)
    params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True, seed=i) for i, (_, n) in enumerate(reqs)]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))  # warm-up
    if llm.engine.config.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params)
    if llm.engine.config.device.type == "cuda":
        torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert out_tokens == sum(n for _, n in reqs), "every request must produce exactly its max_tokens"
    cfg = llm.engine.config
    return {"engine": f"kvgate ({cfg.attention_backend})", "dtype": str(cfg.dtype).replace("torch.", ""),
            "requests": len(reqs), "output_tokens": out_tokens, "seconds": round(secs, 2),
            "output_tok_s": round(out_tokens / secs, 1),
            "total_tok_s": round((out_tokens + sum(len(p) for p, _ in reqs)) / secs, 1),
            "load_s": round(load_s, 1)}, reqs


def run_hf(args: argparse.Namespace, reqs: list[tuple[list[int], int]], dtype: torch.dtype) -> dict:
    """transformers generate in batches of --hf-batch-size (left-padded, each batch runs to its longest output)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = args.model
    if path is None:
        from kvgate.engine.models.gguf import default_model_path

        path = default_model_path()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if args.load_format == "dummy":
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model = model.to(dev).eval()
    pad = 0
    t0 = time.perf_counter()
    useful = 0
    for i in range(0, len(reqs), args.hf_batch_size):
        batch = reqs[i:i + args.hf_batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch], device=dev)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=dev)
        new = max(n for _, n in batch)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=True, temperature=0.6, pad_token_id=pad)
        useful += sum(n for _, n in batch)
    if dev == "cuda":
        torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    return {"engine": f"transformers (batch {args.hf_batch_size})", "dtype": str(dtype).replace("torch.", ""),
            "requests": len(reqs), "output_tokens": useful, "seconds": round(secs, 2),
            "output_tok_s": round(useful / secs, 1), "total_tok_s": round((useful + sum(len(p) for p, _ in reqs)) / secs, 1),
            "load_s": 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF dir, .gguf, or a config dir with --load-format dummy")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--min-input", type=int, default=100)
    ap.add_argument("--max-input", type=int, default=1024)
    ap.add_argument("--min-output", type=int, default=100)
    ap.add_argument("--max-output", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--attention-backend", default=None)
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--compare-hf", action="store_true")
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--record", default=None, help="a label: append the rows to benchmarks/RESULTS.md")
    args = ap.parse_args()
    row, reqs = run_kvgate(args)
    rows = [row]
    if args.compare_hf:
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[row["dtype"]]
        rows.append(run_hf(args, reqs, dtype))
    print(f"# throughput on {device_name()}, torch {torch.__version__}, python {platform.python_version()}")
    print(f"# workload: {args.num_seqs} seqs, input U[{args.min_input},{args.max_input}], "
          f"output U[{args.min_output},{args.max_output}], model {args.model or 'default'} ({args.load_format})")
    print_table(rows)
    if args.record:
        append_results(args.record, " ".join(sys.argv), rows)


if __name__ == "__main__":
    main()
