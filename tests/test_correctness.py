"""The engine's greedy tokens equal transformers' generate on the same weights, whatever the scheduling. On the CPU,
also on a machine with a GPU (there the default dtype is bfloat16; tests/test_cuda_graphs.py covers the GPU)."""
from __future__ import annotations

import functools

import pytest
import torch
from tiny_models import ARCHS, assert_engine_idle, assert_greedy_close, hf_greedy_with_logits, random_prompts

from kvgate.engine import LLM, SamplingParams
from kvgate.kernels.cpu_linear import PackedLinear, can_pack

NEW_TOKENS = 24
PROMPTS = random_prompts(8, seed=3, min_len=1, max_len=70)
PROMPTS.append(PROMPTS[5][:40] + [7, 8, 9])  # shares a 40-token prefix with another prompt


@functools.lru_cache(maxsize=None)
def reference(model_dir: str) -> tuple[list[list[int]], list]:
    return hf_greedy_with_logits(model_dir, PROMPTS, NEW_TOKENS)


def greedy(llm: LLM) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)]


@pytest.mark.parametrize("arch", ARCHS)
def test_matches_transformers(tiny_model_dirs: dict[str, str], arch: str) -> None:
    ids, logits = reference(tiny_model_dirs[arch])
    llm = LLM(tiny_model_dirs[arch], device="cpu", kv_cache_memory_bytes=1 << 24)
    assert_greedy_close(greedy(llm), ids, logits)
    assert_engine_idle(llm)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_prefix_caching_reuses_blocks_and_matches(tiny_model_dirs: dict[str, str], arch: str) -> None:
    ids, logits = reference(tiny_model_dirs[arch])
    llm = LLM(tiny_model_dirs[arch], device="cpu", kv_cache_memory_bytes=1 << 24, enable_prefix_caching=True)
    assert_greedy_close(greedy(llm), ids, logits)
    first_hits = llm.engine.block_manager.prefix_cache_hits  # prompts admitted in one step cannot share yet
    assert_greedy_close(greedy(llm), ids, logits)  # every prompt again: served from cached blocks
    assert llm.engine.block_manager.prefix_cache_hits - first_hits >= sum((len(p) - 1) // 16 * 16 for p in PROMPTS)
    assert_engine_idle(llm)


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
@pytest.mark.parametrize("budget", [1, 7, 16])
def test_small_chunked_prefill_matches(tiny_model_dirs: dict[str, str], arch: str, budget: int) -> None:
    ids, logits = reference(tiny_model_dirs[arch])
    llm = LLM(tiny_model_dirs[arch], device="cpu", kv_cache_memory_bytes=1 << 24, max_num_batched_tokens=budget)
    assert_greedy_close(greedy(llm), ids, logits)
    assert_engine_idle(llm)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("caching", [True, False])
def test_preemption_under_tiny_cache_matches(tiny_model_dirs: dict[str, str], arch: str, caching: bool) -> None:
    ids, logits = reference(tiny_model_dirs[arch])
    llm = LLM(tiny_model_dirs[arch], device="cpu", num_gpu_blocks_override=10, enable_prefix_caching=caching,
              max_num_batched_tokens=32)
    assert_greedy_close(greedy(llm), ids, logits)
    assert llm.engine.scheduler.num_preemptions > 0
    assert_engine_idle(llm)


@pytest.mark.parametrize("block_size", [32, 64])
def test_block_sizes_match(tiny_model_dirs: dict[str, str], block_size: int) -> None:
    ids, logits = reference(tiny_model_dirs["qwen3"])
    llm = LLM(tiny_model_dirs["qwen3"], device="cpu", block_size=block_size, num_gpu_blocks_override=8)
    assert_greedy_close(greedy(llm), ids, logits)
    assert_engine_idle(llm)


def test_parallel_sampling_shares_prompt_blocks(tiny_model_dirs: dict[str, str]) -> None:
    llm = LLM(tiny_model_dirs["llama"], device="cpu", kv_cache_memory_bytes=1 << 24, enable_prefix_caching=False)
    engine = llm.engine
    prompt = PROMPTS[5]  # 50+ tokens: three full blocks
    engine.add_request("r", prompt, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=6))
    engine.step()  # the prompt is computed once, then the other two samples fork from it
    seqs = engine.requests["r"].seqs
    full = len(prompt) // 16
    assert all(s.block_table[:full] == seqs[0].block_table[:full] for s in seqs)
    assert all(engine.block_manager.blocks[b].ref_count == 3 for b in seqs[0].block_table[:full])
    while engine.has_unfinished_requests():
        engine.step()
    assert all(b.ref_count == 0 for b in engine.block_manager.blocks)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bfloat16_on_cpu_matches_float32_transformers(tiny_model_dirs: dict[str, str], arch: str) -> None:
    """bfloat16 on the CPU runs oneDNN's packed linears (kernels/cpu_linear.py, where the CPU has bf16
    instructions): its greedy tokens follow transformers' float32 ones up to bf16 rounding. The tiny models' logits
    have a std of ~2 and bf16 rounding moved a pick by at most 0.32 in a probe (a wrong weight layout picks tokens
    ~5 below transformers' top logit), hence the tolerance."""
    ids, logits = reference(tiny_model_dirs[arch])
    llm = LLM(tiny_model_dirs[arch], device="cpu", kv_cache_memory_bytes=1 << 24, dtype="bfloat16")
    if can_pack(torch.device("cpu"), torch.bfloat16):
        assert any(isinstance(m, PackedLinear) for m in llm.engine.runner.model.modules())
    assert_greedy_close(greedy(llm), ids, logits, tol=0.35)
    assert_engine_idle(llm)
