"""Offline throughput: the nano-vllm workload (random prompts, ignore_eos) through kvgate's engine,
optionally next to transformers' batched `generate` on the same model and requests (--compare-hf).

  python benchmarks/throughput.py                                 # 256 seqs, lengths U[100, 1024]
  python benchmarks/throughput.py --num-seqs 16 --min-input 100 --max-input 200 --min-output 128 --max-output 128
  python benchmarks/throughput.py --model benchmarks/configs/qwen3-0.6b --load-format dummy --compare-hf
  python benchmarks/throughput.py ... --concurrency 200   # 200 in flight, the next one added as one finishes

--concurrency C keeps C requests in the engine and adds the next as one finishes (the arrivals an online server
with C clients sees, without HTTP): steps then mix new prompts with decodes, which the all-at-once run rarely does.
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import append_results, device_name, print_table  # noqa: E402

from kvgate.engine import LLM, RequestOutputKind, SamplingParams  # noqa: E402


def workload(args: argparse.Namespace, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    return [([rng.randrange(0, min(vocab, 10000)) for _ in range(rng.randint(args.min_input, args.max_input))],
             rng.randint(args.min_output, args.max_output)) for _ in range(args.num_seqs)]


def run_kvgate(args: argparse.Namespace) -> tuple[dict, list[tuple[list[int], int]]]:
    kw = dict(load_format=args.load_format, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              enable_prefix_caching=not args.no_prefix_caching,
              skip_tokenizer_init=args.load_format == "dummy" and not args.detokenize)
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.attention_backend:
        kw["attention_backend"] = args.attention_backend
    if args.max_model_len:
        kw["max_model_len"] = args.max_model_len
    if args.enforce_eager:
        kw["enforce_eager"] = True
    kw["tensor_parallel_size"], kw["pipeline_parallel_size"] = args.tensor_parallel_size, args.pipeline_parallel_size
    t0 = time.perf_counter()
    llm = LLM(args.model, **kw)
    load_s = time.perf_counter() - t0
    reqs = workload(args, llm.engine.config.model_config.vocab_size)
    # unseeded, as vLLM's and nano-vllm's benchmarks sample (a seeded request draws its own noise row by row)
    params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True) for _, n in reqs]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))  # warm-up
    timers = attach_step_timers(llm.engine) if args.profile else None
    if llm.engine.config.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    if args.concurrency:
        outs = closed_loop(llm.engine, reqs, params, args.concurrency)
    else:
        outs = llm.generate([p for p, _ in reqs], params)
    if llm.engine.config.device.type == "cuda":
        torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert out_tokens == sum(n for _, n in reqs), "every request must produce exactly its max_tokens"
    cfg = llm.engine.config
    if timers is not None:
        print_step_profile(timers, secs)
    if args.torch_profile:
        torch_profile(llm, reqs)
    mode = ["eager" if getattr(llm.engine.runner, "graphs", None) is None else "cuda graphs"]
    if args.concurrency:
        mode.append(f"{args.concurrency} in flight")
    if args.tensor_parallel_size > 1 or args.pipeline_parallel_size > 1:
        mode.append(f"TP={args.tensor_parallel_size} PP={args.pipeline_parallel_size}")
    if llm.engine.tokenizer is not None:
        mode.append("detokenized")
    if any(getattr(m, "fused", False) for m in llm.engine.runner.model.modules()):
        mode.append("fused ops")
    row = {"engine": f"kvgate ({cfg.attention_backend}, {', '.join(mode)})", "dtype": str(cfg.dtype).replace("torch.", ""),
           "requests": len(reqs), "output_tokens": out_tokens, "seconds": round(secs, 2),
           "output_tok_s": round(out_tokens / secs, 1),
           "total_tok_s": round((out_tokens + sum(len(p) for p, _ in reqs)) / secs, 1),
           "load_s": round(load_s, 1)}
    llm.engine.shutdown()  # the parallel ranks' workers, if any
    return row, reqs


def closed_loop(engine, reqs: list[tuple[list[int], int]], params: list[SamplingParams], concurrency: int) -> list:
    """Keep `concurrency` requests in the engine, adding the next one as soon as one finishes."""
    params = [replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params]
    todo = list(range(len(reqs)))[::-1]
    done: dict[int, object] = {}

    def add() -> None:
        i = todo.pop()
        engine.add_request(str(i), {"prompt_token_ids": reqs[i][0]}, params[i])

    for _ in range(min(concurrency, len(reqs))):
        add()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out
                if todo:
                    add()
    return [done[i] for i in range(len(reqs))]


class _Timed:
    """Wraps a callable and adds its (GPU-synchronised) wall time to timers[name]."""

    def __init__(self, fn, timers: dict, name: str, sync: bool) -> None:
        self.fn, self.timers, self.name, self.sync = fn, timers, name, sync

    def __call__(self, *a, **kw):
        t0 = time.perf_counter()
        out = self.fn(*a, **kw)
        if self.sync:
            torch.cuda.synchronize()
        self.timers[self.name] = self.timers.get(self.name, 0.0) + time.perf_counter() - t0
        return out


def attach_step_timers(engine) -> dict:
    """Time the phases of every step: schedule, prepare (host tensors), forward (+ logits), sample, and the
    step as a whole (the rest is output handling). Synchronises the GPU after each phase (a little slower)."""
    timers: dict = {}
    sync = engine.config.device.type == "cuda"
    engine.scheduler.schedule = _Timed(engine.scheduler.schedule, timers, "schedule", False)
    engine.runner.prepare = _Timed(engine.runner.prepare, timers, "prepare", sync)
    engine.runner.execute = _Timed(engine.runner.execute, timers, "execute", sync)
    engine.sampler = _Timed(engine.sampler, timers, "sample", sync)
    engine.step = _Timed(engine.step, timers, "step", False)
    prepare = engine.runner.prepare

    def counted(step):  # steps of decodes only (CUDA graphs where there are some) and the others (eager)
        out = prepare(step)
        key = "decode-only steps" if out[2].num_decodes == out[2].num_seqs else "steps with prompt tokens"
        timers[key] = timers.get(key, 0) + 1
        return out

    engine.runner.prepare = counted
    return timers


def print_step_profile(timers: dict, secs: float) -> None:
    step = timers.get("step", 0.0)
    parts = {"schedule": timers.get("schedule", 0.0), "prepare": timers.get("prepare", 0.0),
             "forward": timers.get("execute", 0.0) - timers.get("prepare", 0.0), "sample": timers.get("sample", 0.0)}
    parts["outputs"] = step - sum(parts.values())
    parts["outside step"] = secs - step
    print("# where the time goes (s): " + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()))
    print("# steps: " + ", ".join(f"{timers.get(k, 0)} {k}" for k in ("decode-only steps", "steps with prompt tokens")))


def torch_profile(llm, reqs: list[tuple[list[int], int]]) -> None:
    """The GPU kernels of a short run (the first 64 requests, 32 output tokens each), by total CUDA time."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(temperature=0.6, max_tokens=32, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate([p for p, _ in reqs[:64]], params)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))


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
    ap.add_argument("--concurrency", type=int, default=None, help="requests in flight (default: all at once)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--attention-backend", default=None)
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--pipeline-parallel-size", type=int, default=1)
    ap.add_argument("--detokenize", action="store_true",
                    help="with dummy weights, still load the model dir's tokenizer and detokenize, as a server does")
    ap.add_argument("--profile", action="store_true", help="print where the step time goes")
    ap.add_argument("--torch-profile", action="store_true", help="print the top GPU kernels of a short run")
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
