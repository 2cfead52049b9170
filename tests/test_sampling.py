"""Sampling through LLM / LLMEngine on a tiny model, checked against transformers' logits: greedy, seeds,
top-k/top-p/min-p and the sampled distribution."""
from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sampling_helpers import _one_thread, llm  # noqa: F401  (module fixtures)
from sampling_helpers import PROMPTS, greedy_sp, hf_first_logits, token_ids, total_variation
from tiny_models import assert_engine_idle, assert_greedy_close, hf_greedy_with_logits, random_prompts

from kvgate.engine import LLM, SamplingParams
from kvgate.engine.sampler import argmax


# ---- greedy ------------------------------------------------------------------------------------------------------
def test_temperature_zero_is_greedy(llm: LLM, tiny_llama: str) -> None:
    ref_ids, ref_logits = hf_greedy_with_logits(tiny_llama, PROMPTS, 10)
    outs = llm.generate(PROMPTS, greedy_sp(10, logprobs=1))
    assert_greedy_close(token_ids(outs), ref_ids, ref_logits)
    for prompt, out, logits in zip(PROMPTS, outs, ref_logits):
        comp = out.outputs[0]
        assert comp.token_ids[0] == int(logits[0].argmax()), "the first greedy token is the argmax"
        for tid, entry in zip(comp.token_ids, comp.logprobs):
            assert entry[tid].rank == 1, "a greedy token is always rank 1 in the raw logits"
    assert_engine_idle(llm)


def test_top_k_1_tiny_top_p_and_min_p_1_equal_greedy(llm: LLM) -> None:
    greedy = token_ids(llm.generate(PROMPTS, greedy_sp(12)))
    variants = [
        SamplingParams(temperature=1.0, top_k=1, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.5, top_k=1, seed=3, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=1e-4, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=1e-4, seed=4, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, min_p=1.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=2.0, min_p=1.0, seed=5, max_tokens=12, ignore_eos=True),
    ]
    for sp in variants:
        assert token_ids(llm.generate(PROMPTS, sp)) == greedy, sp
    # and the sampled rows stay greedy when mixed in one batch with unrestricted sampled rows
    mixed = llm.generate(PROMPTS * 2, variants[:len(PROMPTS)] + [
        SamplingParams(temperature=1.0, seed=i, max_tokens=12, ignore_eos=True) for i in range(len(PROMPTS))])
    assert token_ids(mixed)[:len(PROMPTS)] == greedy
    assert token_ids(mixed)[len(PROMPTS):] != greedy, "temperature 1 without restrictions should sample"
    assert_engine_idle(llm)


# ---- seeds -------------------------------------------------------------------------------------------------------
def test_seed_is_reproducible_across_runs_and_batches(llm: LLM, tiny_llama: str) -> None:
    prompt = PROMPTS[2]
    sp = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate([prompt], sp)[0].outputs[0].token_ids
    assert len(alone) == 24
    assert llm.generate([prompt], sp)[0].outputs[0].token_ids == alone, "same seed, second run"
    others = [SamplingParams(temperature=1.0, seed=1, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.8, max_tokens=7, ignore_eos=True),  # unseeded: the global RNG
              greedy_sp(5),
              SamplingParams(temperature=1.0, n=3, max_tokens=20, ignore_eos=True, presence_penalty=1.0)]
    batch = llm.generate([PROMPTS[0], PROMPTS[1], prompt, PROMPTS[3], PROMPTS[4]],
                         [others[0], others[1], sp, others[2], others[3]])
    assert batch[2].outputs[0].token_ids == alone, "same seed inside a mixed batch"
    torch.manual_seed(987)  # the global RNG state must not matter for a seeded request
    fresh = LLM(tiny_llama, kv_cache_memory_bytes=1 << 22, enable_prefix_caching=False, dtype="float32")
    assert fresh.generate([prompt], sp)[0].outputs[0].token_ids == alone, "same seed, another engine"
    greedy = llm.generate([prompt], greedy_sp(24))[0].outputs[0].token_ids
    assert alone != greedy, "temperature 1 should not be greedy over 24 tokens"
    seeds = {tuple(llm.generate([prompt], SamplingParams(temperature=1.0, seed=s, max_tokens=24, ignore_eos=True))[0]
                   .outputs[0].token_ids) for s in (1, 2, 3)}
    assert len(seeds | {tuple(alone)}) == 4, "different seeds give different samples"
    assert_engine_idle(llm)


def test_seeded_samples_survive_preemption_and_chunked_prefill(llm: LLM, tiny_llama: str) -> None:
    """Seeded samples (n up to 3, with penalties and logprobs) are the same on a KV cache so small that sequences
    are preempted and recomputed, with prompts prefilled in small chunks."""
    prompts = random_prompts(6, seed=3, min_len=20, max_len=60)
    sps = [SamplingParams(temperature=1.0, seed=i, max_tokens=40, ignore_eos=True, logprobs=2, n=1 + i % 3,
                          frequency_penalty=0.5) for i in range(6)]
    roomy = llm.generate(prompts, sps)
    tight = LLM(tiny_llama, num_gpu_blocks_override=12, max_num_batched_tokens=32, dtype="float32")
    cramped = tight.generate(prompts, sps)
    assert tight.engine.scheduler.num_preemptions > 0
    for a, b in zip(roomy, cramped):
        assert len(a.outputs) == len(b.outputs)
        for ca, cb in zip(a.outputs, b.outputs):
            assert (cb.token_ids, cb.text) == (ca.token_ids, ca.text)
            assert cb.cumulative_logprob == pytest.approx(ca.cumulative_logprob, abs=1e-3)
    assert_engine_idle(tight)
    assert_engine_idle(llm)


# ---- the sampled distribution ------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def candidate_prompts(model_dir: str) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """Short random prompts with transformers' first-token logits."""
    prompts = random_prompts(300, seed=5, min_len=1, max_len=12)
    return [(tuple(p), hf_first_logits(model_dir, tuple(p))) for p in prompts]


def peaky_prompt(model_dir: str, temperature: float = 1.0) -> tuple[int, ...]:
    """A prompt whose first-token distribution at `temperature` is far from flat (smallest sum of sqrt(p)) without
    being almost deterministic (top p < 0.8), so that a few thousand draws estimate it well: the expected total
    variation of N draws is about sqrt(1 / (2 pi N)) * sum(sqrt(p))."""
    dists = ((pr, (logits / temperature).softmax(-1)) for pr, logits in candidate_prompts(model_dir))
    scored = [(float(p.sqrt().sum()), pr) for pr, p in dists if p.max() < 0.8]
    score, prompt = min(scored)
    assert score < 9.0, f"no prompt is peaky enough ({score})"
    return prompt


def spread_prompt(model_dir: str) -> tuple[int, ...]:
    """A prompt whose top-5 first tokens are the least unequal (largest p5 / p1)."""
    ratio, prompt = max((float(p.topk(5).values[-1] / p.max()), pr) for pr, p in
                        ((pr, logits.softmax(-1)) for pr, logits in candidate_prompts(model_dir)))
    assert ratio > 0.2, ratio
    return prompt


def draw_first_tokens(llm: LLM, prompt: list[int], draws: int, **kw) -> Counter:
    """`draws` samples of the first token: half seeded (n=250 per request), half from the global RNG."""
    per = 250
    sps = [SamplingParams(n=per, max_tokens=1, ignore_eos=True, seed=(1000 + i if i % 2 == 0 else None), **kw)
           for i in range(draws // per)]
    torch.manual_seed(0)
    outs = llm.generate([prompt] * len(sps), sps)
    counts: Counter = Counter()
    for o in outs:
        assert len(o.outputs) == per
        for c in o.outputs:
            assert len(c.token_ids) == 1 and c.finish_reason == "length"
            counts[c.token_ids[0]] += 1
    return counts


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_first_token_distribution_matches_softmax(llm: LLM, tiny_llama: str, temperature: float) -> None:
    prompt = peaky_prompt(tiny_llama, temperature)
    logits = hf_first_logits(tiny_llama, prompt)
    probs = (logits / temperature).softmax(-1)
    draws = 4000
    counts = draw_first_tokens(llm, list(prompt), draws, temperature=temperature)
    tv = total_variation(counts, probs)
    assert tv < 0.15, f"total variation {tv:.3f} between the samples and softmax(logits / {temperature})"
    # the most likely token's frequency is within 5 standard deviations of its probability
    top = int(probs.argmax())
    p = float(probs[top])
    assert abs(counts[top] / draws - p) < 5 * (p * (1 - p) / draws) ** 0.5, (counts[top], p)
    # neither greedy nor a different temperature fits as well
    assert tv < total_variation(counts, (logits / (temperature * 2)).softmax(-1))
    assert tv < total_variation(counts, (logits / (temperature / 2)).softmax(-1))
    assert_engine_idle(llm)


def test_top_k_top_p_min_p_restrict_the_support(llm: LLM, tiny_llama: str) -> None:
    prompt = list(spread_prompt(tiny_llama))
    logits = hf_first_logits(tiny_llama, tuple(prompt))
    probs = logits.softmax(-1)
    sorted_p, order = probs.sort(descending=True)
    top5 = set(order[:5].tolist())
    counts = draw_first_tokens(llm, prompt, 1000, temperature=1.0, top_k=5)
    assert set(counts) <= top5, f"top_k=5 sampled {set(counts) - top5}, outside transformers' top 5 {top5}"
    assert set(counts) == top5, "every top-5 token should show up in 1000 draws"
    renormalized = torch.zeros_like(probs).index_copy(0, order[:5], sorted_p[:5] / sorted_p[:5].sum())
    assert total_variation(counts, renormalized) < 0.1
    # top_p between the cumulative mass of the top 2 and the top 3: exactly the top 3 remain
    cum = sorted_p.cumsum(0)
    top_p = float(cum[1] + cum[2]) / 2
    counts = draw_first_tokens(llm, prompt, 1000, temperature=1.0, top_p=top_p)
    assert set(counts) == set(order[:3].tolist()), (top_p, counts)
    # min_p between the ratios of the 2nd and 3rd token to the 1st: exactly the top 2 remain
    min_p = float(sorted_p[1] + sorted_p[2]) / 2 / float(sorted_p[0])
    counts = draw_first_tokens(llm, prompt, 1000, temperature=1.0, min_p=min_p)
    assert set(counts) == set(order[:2].tolist()), (min_p, counts)
    assert_engine_idle(llm)


# ---- the CPU argmax ----------------------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(rows=st.integers(0, 5), chunks=st.integers(8, 20), seed=st.integers(0, 2**32 - 1),
       specials=st.lists(st.sampled_from([float("nan"), float("inf"), float("-inf"), 3.0]), max_size=6))
def test_cpu_argmax_equals_torch_argmax(rows: int, chunks: int, seed: int, specials: list[float]) -> None:
    """Ties (a few distinct values), infinities and NaNs anywhere: the same index as torch.argmax."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (rows, chunks * 128), generator=g).float()
    for i, value in enumerate(specials):
        if rows:
            x[i % rows, int(torch.randint(0, x.shape[1], (1,), generator=g))] = value
    assert torch.equal(argmax(x), x.argmax(dim=-1))
    flipped = x.flip(-1)  # the maxima in other chunks
    assert torch.equal(argmax(flipped), flipped.argmax(dim=-1))
