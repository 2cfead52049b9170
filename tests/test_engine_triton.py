"""The engine with attention_backend="triton" (run by Triton's interpreter on the CPU) generates the same
greedy tokens as with "torch": plain batches, prefix-cache hits, small chunked-prefill budgets, split-K decode.

TRITON_INTERPRET=1 is set before anything imports a kvgate.kernels.triton_* module (see
test_kernels_triton.py); only attention differs between the two engines (linears are the same oneDNN path).
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import functools  # noqa: E402

import pytest  # noqa: E402
from tiny_models import random_prompts  # noqa: E402

from kvgate.engine import LLM, SamplingParams  # noqa: E402
from kvgate.kernels import triton_decode  # noqa: E402
from kvgate.kernels.triton_attention import triton_attention_backend  # noqa: E402

# the interpreter itself uses a numpy idiom that numpy >= 1.25 deprecates
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

NEW_TOKENS = 8
LONG = random_prompts(1, seed=12, min_len=40, max_len=40)[0]
PROMPTS = random_prompts(4, seed=11, min_len=1, max_len=30) + [LONG, LONG[:34] + [7, 8, 9]]  # 2 blocks shared


def greedy(llm: LLM) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, sp)]


@functools.lru_cache(maxsize=None)
def torch_greedy(model_dir: str) -> list[list[int]]:
    return greedy(LLM(model_dir, attention_backend="torch", kv_cache_memory_bytes=1 << 24))


def triton_llm(model_dir: str, **kwargs) -> LLM:
    llm = LLM(model_dir, attention_backend="triton", kv_cache_memory_bytes=1 << 24, **kwargs)
    assert llm.engine.runner.attention_fn is triton_attention_backend
    return llm


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_matches_torch_with_prefix_hits(tiny_model_dirs: dict[str, str], arch: str) -> None:
    want = torch_greedy(tiny_model_dirs[arch])
    llm = triton_llm(tiny_model_dirs[arch])
    assert greedy(llm) == want
    hits = llm.engine.block_manager.prefix_cache_hits
    assert greedy(llm) == want  # every prompt again: its full blocks come from the prefix cache
    assert llm.engine.block_manager.prefix_cache_hits - hits >= 32


@pytest.mark.parametrize("budget", [7])
def test_triton_chunked_prefill_and_split_k_match_torch(tiny_model_dirs: dict[str, str], budget: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts cut into chunks of a few tokens (each chunk attends to the earlier ones through the cache),
    and decode split into 16-token partitions merged by the reduce kernel."""
    monkeypatch.setattr(triton_decode, "MIN_PARTITION_TOKENS", 16)
    monkeypatch.setattr(triton_decode, "DECODE_TILE_N", 16)
    want = torch_greedy(tiny_model_dirs["qwen3"])
    llm = triton_llm(tiny_model_dirs["qwen3"], max_num_batched_tokens=budget, enable_prefix_caching=False)
    assert greedy(llm) == want
