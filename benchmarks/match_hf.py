"""How many greedy tokens kvgate shares with transformers on the same weights, per architecture and dtype.

In float32 they must be equal; in bf16 rounding can make them diverge once a near-tie is hit, after which the
continuations differ. Reports matched tokens (the common prefix) out of all generated tokens.

  python benchmarks/match_hf.py --dtype bfloat16
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from common import append_results, device_name, matched, print_table  # noqa: E402
from tiny_models import ARCHS, build_tiny_model, random_prompts  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from kvgate.engine import LLM, SamplingParams  # noqa: E402


def hf_generate(model_dir: str, prompts: list[list[int]], dtype: torch.dtype, n: int, dev: str) -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(dev).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            seq = hf.generate(torch.tensor([p], device=dev), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
            out.append(seq[0, len(p):].tolist())
    return out


def kvgate_generate(model_dir: str, prompts: list[list[int]], dtype: str, n: int, backend: str | None,
                    enforce_eager: bool = False) -> tuple[list[list[int]], str]:
    llm = LLM(model_dir, dtype=dtype, attention_backend=backend, max_num_seqs=len(prompts),
              enforce_eager=enforce_eager)
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)], llm.engine.config.attention_backend
    del llm  # free its KV cache before the next engine sizes its own from the free memory
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--archs", nargs="+", default=list(ARCHS), choices=list(ARCHS))
    ap.add_argument("--attention-backend", default=None, help="default: triton on CUDA, torch on CPU")
    ap.add_argument("--record", default=None)
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    prompts = random_prompts(args.num_prompts, seed=7, min_len=4, max_len=200)
    total = args.new_tokens * len(prompts)
    rows = []
    for arch in args.archs:
        d = build_tiny_model(tempfile.mkdtemp(), arch, num_hidden_layers=args.layers)
        truth = hf_generate(d, prompts, torch.float32, args.new_tokens, dev)
        hf_low = hf_generate(d, prompts, getattr(torch, args.dtype), args.new_tokens, dev)
        ours_low, backend = kvgate_generate(d, prompts, args.dtype, args.new_tokens, args.attention_backend)
        ours_fp32, _ = kvgate_generate(d, prompts, "float32", args.new_tokens, args.attention_backend)
        eager_low, _ = kvgate_generate(d, prompts, args.dtype, args.new_tokens, args.attention_backend, True)
        rows.append({"arch": arch, "backend": backend,
                     "kvgate_fp32=hf_fp32": f"{matched(ours_fp32, truth)}/{total}",
                     f"kvgate_{args.dtype}=hf_{args.dtype}": f"{matched(ours_low, hf_low)}/{total}",
                     f"kvgate_{args.dtype}=hf_fp32": f"{matched(ours_low, truth)}/{total}",
                     f"hf_{args.dtype}=hf_fp32": f"{matched(hf_low, truth)}/{total}",
                     "kvgate_eager=kvgate": f"{matched(eager_low, ours_low)}/{total}"})
        print(rows[-1], flush=True)
    print(f"# greedy tokens in common (prefix up to the first divergence) on {device_name()}, "
          f"{args.num_prompts} prompts x {args.new_tokens} tokens, {args.layers}-layer tiny models")
    print_table(rows)
    if args.record:
        append_results(args.record, " ".join(sys.argv), rows)


if __name__ == "__main__":
    main()
