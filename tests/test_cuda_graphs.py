"""CUDA graphs on a GPU: with decode graphs only and with mixed-step graphs too (KVGATE_CUDAGRAPH_MODE), the greedy
tokens in float32 equal transformers', through chunked prefill and new requests joining decoding ones (async
scheduling on, as on CUDA by default), and the graphs were replayed. Skipped without CUDA: capturing needs a GPU.
The padded layouts that the graphs replay are checked on the CPU too (tests/test_cuda_graph_layout.py).
"""
from __future__ import annotations

import collections

import pytest
import torch
from tiny_models import assert_engine_idle, assert_greedy_close, hf_greedy_with_logits, random_prompts

from kvgate.engine import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="capturing CUDA graphs needs a GPU")

PROMPTS = random_prompts(12, seed=5, min_len=1, max_len=90)
NEW_TOKENS = 16


@pytest.mark.parametrize("mode", ["decode", "full"])
def test_graphs_give_transformers_tokens(tiny_model_dirs: dict[str, str], mode: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_CUDAGRAPH_MODE", mode)
    model = tiny_model_dirs["qwen3"]
    ids, logits = hf_greedy_with_logits(model, PROMPTS, NEW_TOKENS)
    # 8 seats for 12 prompts: the last ones join while others decode; a 64-token budget cuts the long prompts
    llm = LLM(model, dtype="float32", kv_cache_memory_bytes=1 << 26, max_num_seqs=8, max_num_batched_tokens=64)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and all(g is not None for g in graphs.graphs.values())
    assert bool(graphs.mixed) == (mode == "full")
    replayed: collections.Counter = collections.Counter()
    run = graphs.run

    def counting(bucket, *args, **kwargs):
        replayed["mixed" if bucket[1] else "decode"] += 1
        return run(bucket, *args, **kwargs)

    graphs.run = counting
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    assert_greedy_close([o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)], ids, logits)
    assert_engine_idle(llm)
    assert replayed["decode"] > 0 and (replayed["mixed"] > 0) == (mode == "full"), replayed
