"""Guided decoding (structured outputs): what it costs.

1. Decode throughput of the same requests with and without a JSON schema, at 64 requests in flight (max_num_seqs 64,
   all submitted at once): output tok/s of each and their ratio (target: guided >= 90% of unguided). With random
   weights the model never closes a document by itself, so every guided request runs into its budget-aware finish
   (the last ~L+32 tokens are checked one by one): the worst case for the guided path.
2. Time to first token of one request, alone in the engine, with a 50-property schema (each with a pattern) never
   seen before (compiled on the worker while the request waits) against the same schema again (cached), and
   without a schema.

  python benchmarks/structured.py                       # CPU: the tiny random Llama of tests/tiny_models.py
  python benchmarks/structured.py --model DIR           # any local HF directory with a tokenizer
  python benchmarks/structured.py --model benchmarks/configs/qwen3-0.6b --load-format dummy   # GPU, real shapes
  python benchmarks/structured.py ... --record "H200, Qwen3-0.6B shapes"   # append the table to RESULTS.md

A dummy-weight config directory without a tokenizer gets a byte-level one of the model's vocabulary size
(benchmarks/dummy_tokenizer.py --byte-level) in a temporary copy: a grammar needs tokens that spell JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import append_results, device_name, print_table  # noqa: E402

from kvgate.engine import LLM, SamplingParams  # noqa: E402
from kvgate.engine.structured_output import StructuredOutputsParams  # noqa: E402

SECTION = "## Guided decoding (`benchmarks/structured.py`)"
SCHEMA = {  # a typical API response: strings with lengths and patterns, numbers with ranges, enum, nesting, arrays
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z]+\\.[a-z]{2,3}$"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 5},
        "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
        "active": {"type": "boolean"},
        "score": {"type": "number", "minimum": 0, "maximum": 100},
    },
    "required": ["name", "age", "email", "role", "tags", "address", "active", "score"],
}


def big_schema(salt: str, n: int = 50) -> dict:
    """n required string properties with patterns; `salt` makes the schema new (never cached)."""
    props = {f"field_{i}_{salt}": {"type": "string", "pattern": f"^[a-z]{{1,{i % 9 + 2}}}[0-9]{{0,2}}$"}
             for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props)}


def resolve_model(args: argparse.Namespace) -> tuple[str, str]:
    """(model directory, what it is): the tiny test model by default; a dummy config gets a byte-level tokenizer."""
    if args.model is None:
        sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
        from tiny_models import build_tiny_model

        return build_tiny_model(os.path.join(tempfile.mkdtemp(prefix="kvgate-structured-"), "llama"), "llama"), \
            "tiny random Llama (tests/tiny_models.py)"
    has_tokenizer = any(os.path.exists(os.path.join(args.model, f)) for f in ("tokenizer.json", "tokenizer.model"))
    if args.load_format != "dummy" or has_tokenizer:
        return args.model, os.path.basename(os.path.normpath(args.model))
    from dummy_tokenizer import main as build_tokenizer

    out = os.path.join(tempfile.mkdtemp(prefix="kvgate-structured-"), os.path.basename(os.path.normpath(args.model)))
    build_tokenizer(args.model, out, byte_level=True)
    for name in os.listdir(args.model):  # anything else the config directory holds (generation_config.json, ...)
        if not os.path.exists(os.path.join(out, name)):
            shutil.copy(os.path.join(args.model, name), out)
    return out, f"{os.path.basename(os.path.normpath(args.model))} (dummy weights, byte-level dummy tokenizer)"


def sync(llm: LLM) -> None:
    if llm.engine.config.device.type == "cuda":
        torch.cuda.synchronize()


def throughput(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[int, float, list]:
    sync(llm)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    sync(llm)
    secs = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs), secs, outs


def time_to_first_token(llm: LLM, rid: str, sp: SamplingParams, prompt: list[int]) -> float:
    """Seconds from add_request to the first output token of a request alone in the engine (then aborted)."""
    engine = llm.engine
    sync(llm)
    t0 = time.perf_counter()
    engine.add_request(rid, {"prompt_token_ids": prompt}, sp)
    while True:
        outs = engine.step()
        if any(o.request_id == rid and o.outputs[0].token_ids for o in outs):
            break
    seconds = time.perf_counter() - t0
    engine.abort_request(rid)
    return seconds


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a local HF directory (default: the tiny random test model)")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=64, help="max_num_seqs: requests in flight")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=256, help="max_tokens of every request")
    p.add_argument("--repeats", type=int, default=3, help="throughput runs of each kind (the best counts)")
    p.add_argument("--ttft-repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--record", metavar="LABEL", help="append the table to benchmarks/RESULTS.md")
    args = p.parse_args(argv)

    model, model_desc = resolve_model(args)
    max_model_len = args.input_len + args.output_len + 16
    llm = LLM(model, load_format=args.load_format, dtype=args.dtype, max_num_seqs=args.concurrency,
              max_model_len=max_model_len, seed=args.seed)
    vocab = llm.engine.config.model_config.vocab_size
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, min(vocab, 10000)) for _ in range(args.input_len)] for _ in range(args.num_requests)]
    guide = StructuredOutputsParams(json=SCHEMA)
    plain = [SamplingParams(temperature=1.0, seed=i, max_tokens=args.output_len, ignore_eos=True)
             for i in range(args.num_requests)]
    guided = [SamplingParams(temperature=1.0, seed=i, max_tokens=args.output_len, structured_outputs=guide)
              for i in range(args.num_requests)]

    # warm-up: kernels, the backend (xgrammar's TokenizerInfo) and SCHEMA's compilation are out of the timed runs
    llm.generate([{"prompt_token_ids": prompts[0]}], [plain[0]])
    llm.generate([{"prompt_token_ids": prompts[0]}], [guided[0]])
    plain_s = guided_s = float("inf")
    for _ in range(args.repeats):  # alternated, best of each: a shared machine's noise hits both alike
        plain_tokens, seconds, _ = throughput(llm, prompts, plain)
        plain_s = min(plain_s, seconds)
        guided_tokens, seconds, outs = throughput(llm, prompts, guided)
        guided_s = min(guided_s, seconds)
    valid = sum(1 for o in outs if _validates(o.outputs[0].text))
    plain_tps, guided_tps = plain_tokens / plain_s, guided_tokens / guided_s

    ttft_plain = statistics.median(time_to_first_token(llm, f"p{i}", SamplingParams(max_tokens=4), prompts[i])
                                   for i in range(args.ttft_repeats))
    new, cached = [], []
    for i in range(args.ttft_repeats):
        sp = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
            json=big_schema(f"{args.seed}x{i}x{time.time_ns()}")))
        new.append(time_to_first_token(llm, f"new{i}", sp, prompts[i]))
        cached.append(time_to_first_token(llm, f"cached{i}", sp, prompts[i]))
    ttft_new, ttft_cached = statistics.median(new), statistics.median(cached)

    rows = [
        {"run": "decode, no schema", "requests": args.num_requests, "output tokens": plain_tokens,
         "seconds": f"{plain_s:.2f}", "output tok/s": f"{plain_tps:,.0f}", "vs no schema": "100%", "TTFT ms": ""},
        {"run": f"decode, JSON schema ({valid}/{len(outs)} valid)", "requests": args.num_requests,
         "output tokens": guided_tokens, "seconds": f"{guided_s:.2f}", "output tok/s": f"{guided_tps:,.0f}",
         "vs no schema": f"{guided_tps / plain_tps:.0%}", "TTFT ms": ""},
        {"run": "TTFT, no schema", "TTFT ms": f"{ttft_plain * 1000:.1f}"},
        {"run": "TTFT, new 50-property schema", "TTFT ms": f"{ttft_new * 1000:.1f}"},
        {"run": "TTFT, the same schema cached", "TTFT ms": f"{ttft_cached * 1000:.1f}"},
    ]
    print(f"model: {model_desc}, {device_name()}, {args.concurrency} in flight, prompts {args.input_len} tokens, "
          f"max_tokens {args.output_len}")
    print_table(rows)
    if args.record:
        from importlib.metadata import version

        note = (f"Model: {model_desc}; {args.num_requests} requests of {args.input_len} random prompt tokens, "
                f"max_tokens {args.output_len}, temperature 1.0, {args.concurrency} in flight (max_num_seqs); "
                f"unguided ones ignore_eos; best of {args.repeats} alternated runs each. xgrammar "
                f"{version('xgrammar')}. TTFT: medians of {args.ttft_repeats}, one request alone in the engine, "
                f"prompt {args.input_len} tokens.")
        append_results(args.record, "python benchmarks/structured.py " + " ".join(argv or sys.argv[1:]), rows,
                       section=SECTION, note=note)


def _validates(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


if __name__ == "__main__":
    main()
