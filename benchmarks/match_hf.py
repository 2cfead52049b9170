"""How many greedy tokens kvgate shares with transformers on the same weights, per architecture and dtype.

In float32 they must be equal; in bf16 rounding can make them diverge once a near-tie is hit, after which the
continuations differ. Reports matched tokens (the common prefix) out of all generated tokens.

  python benchmarks/match_hf.py --dtype bfloat16
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from common import append_results, device_name, print_table  # noqa: E402
from tiny_models import ARCHS, build_tiny_model, random_prompts  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from kvgate.engine import LLM, SamplingParams  # noqa: E402


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--record", default=None)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    prompts = random_prompts(args.num_prompts, seed=7, min_len=4, max_len=200)
    rows = []
    for arch in ARCHS:
        d = build_tiny_model(tempfile.mkdtemp(), arch, num_hidden_layers=args.layers)
        llm = LLM(d, dtype=args.dtype)
        sp = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
        ours = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=dtype).to(dev).eval()
        ref = []
        with torch.inference_mode():
            for p in prompts:
                out = hf.generate(torch.tensor([p], device=dev), max_new_tokens=args.new_tokens, do_sample=False,
                                  eos_token_id=None, pad_token_id=0, min_new_tokens=args.new_tokens)
                ref.append(out[0, len(p):].tolist())
        matched = [common_prefix(a, b) for a, b in zip(ours, ref)]
        rows.append({"arch": arch, "dtype": args.dtype, "backend": llm.engine.config.attention_backend,
                     "identical_seqs": f"{sum(m == args.new_tokens for m in matched)}/{len(prompts)}",
                     "matched_tokens": f"{sum(matched)}/{args.new_tokens * len(prompts)}",
                     "first_divergence_min": min(matched)})
        del llm, hf
    print(f"# greedy match vs transformers on {device_name()}, {args.num_prompts} prompts x {args.new_tokens} tokens")
    print_table(rows)
    if args.record:
        append_results(args.record, " ".join(sys.argv), rows)


if __name__ == "__main__":
    main()
