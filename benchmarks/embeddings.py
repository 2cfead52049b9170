"""Offline embedding throughput (the pooling runner) next to transformers, and how closely the vectors agree.

  python benchmarks/embeddings.py --model benchmarks/configs/qwen3-0.6b       # Qwen3-Embedding-0.6B shapes
  python benchmarks/embeddings.py --model benchmarks/configs/qwen3-0.6b --num-inputs 2000 --input-len 256
  python benchmarks/embeddings.py ... --dtype float32 --record "embeddings, fp32"

The weights are random, drawn by transformers (AutoModel.from_config: the decoder without an LM head, as an
embedding checkpoint is saved) into a temporary directory that both engines load. Inputs are random token ids
of --input-len tokens; kvgate embeds them all at once (LAST pooling, normalized: Qwen3-Embedding's pooling), and
transformers runs padded batches of --hf-batch-size, taking each input's last-token state. Agreement: the lowest
cosine similarity between the two engines' vectors of one input, and the largest absolute difference.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import append_results, print_table  # noqa: E402

from kvgate.engine import LLM  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def save_random_model(config_dir: str, out: str, dtype: torch.dtype, device: str, seed: int) -> None:
    from transformers import AutoConfig, AutoModel

    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(config_dir)
    with torch.device(device):
        model = AutoModel.from_config(config, dtype=dtype)
    model.save_pretrained(out)


def run_kvgate(model_dir: str, inputs: list[list[int]], args: argparse.Namespace) -> tuple[dict, torch.Tensor]:
    llm = LLM(model_dir, dtype=args.dtype, skip_tokenizer_init=True, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.input_len + 16)
    assert llm.engine.config.runner == "pooling", llm.engine.config.runner
    llm.embed(inputs[:8])  # warm-up: kernels compile outside the timed run
    sync()
    t0 = time.perf_counter()
    outs = llm.embed(inputs)
    sync()
    secs = time.perf_counter() - t0
    vectors = torch.tensor([o.outputs.embedding for o in outs])
    return row("kvgate", inputs, secs), vectors


@torch.inference_mode()
def run_hf(model_dir: str, inputs: list[list[int]], args: argparse.Namespace) -> tuple[dict, torch.Tensor]:
    from transformers import AutoModel

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModel.from_pretrained(model_dir, dtype=DTYPES[args.dtype]).to(device).eval()

    def batch(chunk: list[list[int]]) -> torch.Tensor:
        width = max(len(x) for x in chunk)
        ids = torch.tensor([x + [0] * (width - len(x)) for x in chunk], device=device)
        mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in chunk], device=device)
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
        last = hidden[torch.arange(len(chunk), device=device), mask.sum(1) - 1]
        return torch.nn.functional.normalize(last.float(), dim=-1).cpu()

    batch(inputs[:8])
    sync()
    t0 = time.perf_counter()
    vectors = torch.cat([batch(inputs[i:i + args.hf_batch_size]) for i in range(0, len(inputs), args.hf_batch_size)])
    sync()
    return row(f"transformers (batch {args.hf_batch_size})", inputs, time.perf_counter() - t0), vectors


def row(engine: str, inputs: list[list[int]], secs: float) -> dict:
    tokens = sum(len(x) for x in inputs)
    return {"engine": engine, "inputs": len(inputs), "tokens": tokens, "seconds": f"{secs:.2f}",
            "inputs/s": f"{len(inputs) / secs:.1f}", "tokens/s": f"{tokens / secs:.0f}"}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="benchmarks/configs/qwen3-0.6b", help="a directory with a config.json")
    ap.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32", choices=DTYPES)
    ap.add_argument("--num-inputs", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--no-hf", action="store_true", help="kvgate only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--record", default=None, help="a label: append the rows to benchmarks/RESULTS.md")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    inputs = [[rng.randrange(0, 10000) for _ in range(args.input_len)] for _ in range(args.num_inputs)]
    with tempfile.TemporaryDirectory() as model_dir:
        save_random_model(args.model, model_dir, DTYPES[args.dtype], "cuda" if torch.cuda.is_available() else "cpu",
                          args.seed)
        rows = []
        ours, vectors = run_kvgate(model_dir, inputs, args)
        rows.append(ours)
        if not args.no_hf:
            theirs, reference = run_hf(model_dir, inputs, args)
            cos = torch.nn.functional.cosine_similarity(vectors, reference, dim=-1)
            ours["min cosine vs transformers"] = f"{cos.min().item():.6f}"
            ours["max abs diff"] = f"{(vectors - reference).abs().max().item():.2e}"
            rows.append(theirs)
    print_table(rows)
    if args.record:
        append_results(args.record, " ".join(sys.argv), rows)


if __name__ == "__main__":
    main()
