"""The engine core's host work per step, the model stubbed: N streaming requests kept in flight (a finished one is
replaced at once, as a closed-loop load client does), each step's outputs pickled as the core process sends them.

What a GPU server at 200 clients is bound by (benchmarks/RESULTS.md: scheduling, building the step, completing it,
detokenizing, building and pickling the outputs), measured on any CPU: the model is a one-layer Qwen3 shape with a
4,096-token byte-level dummy tokenizer (benchmarks/dummy_tokenizer.py), its forward returns zeros and its logits are
one fixed random table, so the step is the engine's Python and little else. Greedy, ignore_eos, DELTA outputs.

  python benchmarks/host_step.py                          # 200 streams, 128 in / 128 out: ms a step
  python benchmarks/host_step.py --streams 64 --profile   # cProfile of the timed steps
  python benchmarks/host_step.py --objects                # the outputs as RequestOutput objects, not tuples
  python benchmarks/host_step.py --final                  # final outputs only, as the offline engine asks: what
                                                          # streaming costs the core a step is the difference
  python benchmarks/host_step.py --no-detokenize          # requests sent with detokenize=False, as API processes
                                                          # that share a core send those without stop strings
"""
from __future__ import annotations

import argparse
import os
import pickle
import random
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import dummy_tokenizer  # noqa: E402
from common import device_name  # noqa: E402

from kvgate.engine import EngineArgs, LLMEngine, SamplingParams  # noqa: E402
from kvgate.engine.sampling_params import RequestOutputKind  # noqa: E402

STUB = os.path.join(HERE, "configs", "qwen3-stub")  # Qwen3-0.6B's config with one layer of width 64, 4,096 tokens


def stub_model_dir(root: str) -> str:
    """benchmarks/configs/qwen3-stub with a byte-level dummy tokenizer of its vocabulary."""
    model_dir = os.path.join(root, "model")
    dummy_tokenizer.main(STUB, model_dir, byte_level=True)
    return model_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=200)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=300, help="timed steps per run (after as many untimed)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="cProfile one run of the timed steps")
    ap.add_argument("--objects", action="store_true", help="outputs as RequestOutput objects (before DeltaTuple)")
    ap.add_argument("--final", action="store_true", help="final outputs only (the offline engine's), not deltas")
    ap.add_argument("--no-detokenize", action="store_true",
                    help="detokenize=False (API processes sharing a core make the text of such requests)")
    args = ap.parse_args()
    seats = max(256, args.streams)
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=stub_model_dir(tempfile.mkdtemp(prefix="kvgate-host-")), load_format="dummy", dtype="float32",
        kv_cache_memory_bytes=1 << 27, max_num_seqs=seats, async_scheduling=False))
    engine.output_prompts, engine.delta_tuples = False, not args.objects  # as in the core's process
    mc = engine.config.model_config
    runner, vocab, hidden = engine.runner, mc.vocab_size, mc.hidden_size
    logits = torch.randn((seats, vocab), generator=torch.Generator().manual_seed(0))
    runner.model.forward = lambda ids, positions, intermediate=None: torch.zeros((ids.shape[0], hidden))
    runner.model.compute_logits = lambda h: logits[:h.shape[0]]
    rng = random.Random(0)
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, detokenize=not args.no_detokenize,
                        output_kind=RequestOutputKind.FINAL_ONLY if args.final else RequestOutputKind.DELTA)
    added = 0

    def add() -> None:
        nonlocal added
        engine.add_request(f"r{added}", {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(args.input_len)]},
                           sp)
        added += 1

    def run(steps: int) -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            outs = engine.step()
            pickle.dumps(outs)
            for o in outs:
                if (o[6] if isinstance(o, tuple) else o.finished):  # (DeltaTuple: engine/outputs.py)
                    add()
        return (time.perf_counter() - t0) / steps * 1e3

    for _ in range(args.streams):
        add()
    run(args.steps)
    print(f"# {device_name()}, torch {torch.__version__}: {args.streams} streams, {args.input_len} in / "
          f"{args.output_len} out, the model stubbed{', not detokenized' if args.no_detokenize else ''}")
    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.runcall(run, args.steps)
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)
        return
    times = [run(args.steps) for _ in range(args.runs)]
    print("ms a step: " + ", ".join(f"{t:.2f}" for t in times))


if __name__ == "__main__":
    main()
