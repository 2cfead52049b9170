"""Sampling and stopping through LLM / LLMEngine on a tiny model, checked against transformers' logits:
greedy, seeds, top-k/top-p/min-p, the sampled distribution, penalties, logprobs, n, stop conditions, output
kinds and abort."""
from __future__ import annotations

import functools
import json
import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tiny_models import assert_greedy_close, hf_greedy_with_logits, load_hf_model, random_prompts
from transformers import AutoTokenizer

from kvgate.engine import LLM, LLMEngine, RequestOutput, RequestOutputKind, SamplingParams

KV_BYTES = 1 << 24
PROMPT = [100, 200, 300, 400, 500, 150, 250]  # a prompt whose greedy continuation has clear winners
PROMPTS = random_prompts(5, seed=21, min_len=3, max_len=40)


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny models run much faster on one thread when other processes share the CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def llm(tiny_llama: str) -> LLM:
    return LLM(tiny_llama, kv_cache_memory_bytes=KV_BYTES)


# ---- helpers -----------------------------------------------------------------------------------------------------
@torch.no_grad()
def hf_step_logits(model_dir: str, prompt: list[int], output: list[int]) -> torch.Tensor:
    """transformers' raw logits for each generated position: row j predicts output[j]. [len(output), vocab]."""
    model = load_hf_model(model_dir)
    ids = torch.tensor([prompt + output])
    return model(ids).logits[0, len(prompt) - 1: len(prompt) + len(output) - 1].float()


@functools.lru_cache(maxsize=None)
def hf_first_logits(model_dir: str, prompt: tuple[int, ...]) -> torch.Tensor:
    return hf_step_logits(model_dir, list(prompt), [0])[0]


@torch.no_grad()
def hf_penalized_greedy(model_dir: str, prompt: list[int], steps: int, rep: float = 1.0, freq: float = 0.0,
                        pres: float = 0.0) -> tuple[list[int], torch.Tensor]:
    """vLLM's penalties applied by hand to transformers' logits, greedy; returns ids and penalized logits."""
    model = load_hf_model(model_dir)
    out: list[int] = []
    rows = []
    for _ in range(steps):
        logits = model(torch.tensor([prompt + out])).logits[0, -1].float().clone()
        counts = torch.zeros_like(logits)
        for t in out:
            counts[t] += 1
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[torch.tensor(prompt + out)] = True
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        logits -= freq * counts + pres * (counts > 0).float()
        rows.append(logits)
        out.append(int(logits.argmax()))
    return out, torch.stack(rows)


@functools.lru_cache(maxsize=None)
def load_tokenizer(model_dir: str):
    return AutoTokenizer.from_pretrained(model_dir)


def greedy_sp(max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def token_ids(outs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def assert_all_free(llm: LLM) -> None:
    engine = llm.engine
    bm = engine.block_manager
    assert engine.requests == {}
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


Requests = list[tuple[str, list[int], SamplingParams]]


def run_engine(engine: LLMEngine, requests: Requests) -> dict[str, list[RequestOutput]]:
    """Add the requests, step to completion; every output of each request, in order."""
    for rid, prompt, sp in requests:
        engine.add_request(rid, prompt, sp)
    got: dict[str, list[RequestOutput]] = {rid: [] for rid, _, _ in requests}
    steps = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            got[o.request_id].append(o)
        steps += 1
        assert steps < 10_000
    return got


def total_variation(counts: Counter, probs: torch.Tensor) -> float:
    n = sum(counts.values())
    emp = torch.zeros_like(probs)
    for t, c in counts.items():
        emp[t] = c / n
    return 0.5 * float((emp - probs).abs().sum())


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
    assert_all_free(llm)


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
    assert_all_free(llm)


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
    fresh = LLM(tiny_llama, kv_cache_memory_bytes=1 << 22, enable_prefix_caching=False)
    assert fresh.generate([prompt], sp)[0].outputs[0].token_ids == alone, "same seed, another engine"
    greedy = llm.generate([prompt], greedy_sp(24))[0].outputs[0].token_ids
    assert alone != greedy, "temperature 1 should not be greedy over 24 tokens"
    seeds = {tuple(llm.generate([prompt], SamplingParams(temperature=1.0, seed=s, max_tokens=24, ignore_eos=True))[0]
                   .outputs[0].token_ids) for s in (1, 2, 3)}
    assert len(seeds | {tuple(alone)}) == 4, "different seeds give different samples"
    assert_all_free(llm)


def test_seeded_samples_survive_preemption_and_chunked_prefill(llm: LLM, tiny_llama: str) -> None:
    """Seeded samples (n up to 3, with penalties and logprobs) are the same on a KV cache so small that sequences
    are preempted and recomputed, with prompts prefilled in small chunks."""
    prompts = random_prompts(6, seed=3, min_len=20, max_len=60)
    sps = [SamplingParams(temperature=1.0, seed=i, max_tokens=40, ignore_eos=True, logprobs=2, n=1 + i % 3,
                          frequency_penalty=0.5) for i in range(6)]
    roomy = llm.generate(prompts, sps)
    tight = LLM(tiny_llama, num_gpu_blocks_override=12, max_num_batched_tokens=32)
    cramped = tight.generate(prompts, sps)
    assert tight.engine.scheduler.num_preemptions > 0
    for a, b in zip(roomy, cramped):
        assert len(a.outputs) == len(b.outputs)
        for ca, cb in zip(a.outputs, b.outputs):
            assert (cb.token_ids, cb.text) == (ca.token_ids, ca.text)
            assert cb.cumulative_logprob == pytest.approx(ca.cumulative_logprob, abs=1e-3)
    assert_all_free(tight)
    assert_all_free(llm)


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
    assert_all_free(llm)


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
    assert_all_free(llm)


# ---- stopping ----------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def greedy_of(model_dir: str, prompt: tuple[int, ...], steps: int = 16) -> list[int]:
    ids, logits = hf_greedy_with_logits(model_dir, [list(prompt)], steps)
    gaps = logits[0].topk(2, dim=-1).values
    assert float((gaps[:, 0] - gaps[:, 1]).min()) > 1e-3, "pick a prompt without near-ties"
    return ids[0]


def first_new_index(ids: list[int], start: int, tokenizer) -> int:
    """The first index >= start whose token has not appeared before it and where the text of the tokens before
    it ends with a whole character."""
    return next(i for i in range(start, len(ids))
                if ids[i] not in ids[:i] and not tokenizer.decode(ids[:i]).endswith("\ufffd"))


def test_max_tokens_gives_length(llm: LLM, tiny_llama: str) -> None:
    expected = greedy_of(tiny_llama, tuple(PROMPT))
    for n in (1, 5, 16):
        comp = llm.generate([PROMPT], greedy_sp(n))[0].outputs[0]
        assert comp.token_ids == expected[:n]
        assert comp.finish_reason == "length" and comp.stop_reason is None
    out = llm.generate([PROMPT], greedy_sp(5))[0]
    assert out.num_prompt_tokens == len(PROMPT) and out.num_completion_tokens == 5
    assert_all_free(llm)


def test_max_model_len_gives_length(tiny_llama: str) -> None:
    llm = LLM(tiny_llama, max_model_len=40, kv_cache_memory_bytes=1 << 22)
    prompt = random_prompts(1, seed=8, min_len=30, max_len=30)[0]
    for sp in (SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True),
               SamplingParams(temperature=1.0, seed=2, max_tokens=None, ignore_eos=True),
               SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)):
        comp = llm.generate([prompt], sp)[0].outputs[0]
        assert len(comp.token_ids) == 10, (sp, comp)
        assert comp.finish_reason == "length"
    comp = llm.generate([[5] * 39], SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))[0].outputs[0]
    assert len(comp.token_ids) == 1 and comp.finish_reason == "length"
    assert_all_free(llm)


def test_stop_token_ids(llm: LLM, tiny_llama: str) -> None:
    expected = greedy_of(tiny_llama, tuple(PROMPT))
    tok = llm.get_tokenizer()
    k = first_new_index(expected, 3, tok)
    stop = expected[k]
    comp = llm.generate([PROMPT], greedy_sp(16, stop_token_ids=[stop, 511 if stop != 511 else 510]))[0].outputs[0]
    assert comp.token_ids == expected[:k + 1], "the stop token ends the output and is included in token_ids"
    assert comp.finish_reason == "stop" and comp.stop_reason == stop
    assert comp.text == tok.decode(expected[:k]), "the stop token's text is not part of the output text"
    # stop token ids are honoured per request inside a batch
    outs = llm.generate([PROMPT, PROMPT], [greedy_sp(16, stop_token_ids=[stop]), greedy_sp(16)])
    assert outs[0].outputs[0].token_ids == expected[:k + 1] and outs[1].outputs[0].token_ids == expected
    assert outs[1].outputs[0].finish_reason == "length"
    assert_all_free(llm)


def test_include_stop_str_in_output_keeps_the_stop_token_text(llm: LLM, tiny_llama: str) -> None:
    """As in vLLM: with include_stop_str_in_output=True the text of a stop token (stop_token_ids) is part of the
    output text; without it, it is not."""
    tok = llm.get_tokenizer()
    expected = greedy_of(tiny_llama, tuple(PROMPT))
    k = first_new_index(expected, 3, tok)
    stop = expected[k]
    assert tok.decode(expected[:k + 1]) != tok.decode(expected[:k]), "the stop token has text of its own"
    comp = llm.generate([PROMPT], greedy_sp(16, stop_token_ids=[stop], include_stop_str_in_output=True))[0].outputs[0]
    assert comp.token_ids == expected[:k + 1] and comp.finish_reason == "stop" and comp.stop_reason == stop
    assert comp.text == tok.decode(expected[:k + 1])
    assert_all_free(llm)


def test_min_tokens_defers_stop_token(llm: LLM, tiny_llama: str) -> None:
    expected = greedy_of(tiny_llama, tuple(PROMPT))
    stop = expected[0]  # without min_tokens the request would stop at once
    comp = llm.generate([PROMPT], greedy_sp(16, stop_token_ids=[stop]))[0].outputs[0]
    assert comp.token_ids == [stop] and comp.finish_reason == "stop"
    for min_tokens in (1, 4, 9):
        comp = llm.generate([PROMPT], greedy_sp(16, stop_token_ids=[stop], min_tokens=min_tokens))[0].outputs[0]
        assert len(comp.token_ids) >= min_tokens, (min_tokens, comp)
        assert stop not in comp.token_ids[:min_tokens], "a stop token is banned before min_tokens"
        banned = hf_first_logits(tiny_llama, tuple(PROMPT)).clone()
        banned[stop] = float("-inf")
        assert comp.token_ids[0] == int(banned.argmax()), "the first token is the best one that is not banned"
        if comp.finish_reason == "stop":
            assert comp.token_ids[-1] == stop and comp.stop_reason == stop
        else:
            assert comp.finish_reason == "length" and len(comp.token_ids) == 16
    assert_all_free(llm)


@pytest.fixture(scope="module")
def eos_model(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, int, int]:
    """A copy of the tiny Llama whose eos is a token its greedy continuation of PROMPT emits (same weights).
    Returns (model dir, eos id, index of its first appearance in the greedy continuation)."""
    expected = greedy_of(tiny_llama, tuple(PROMPT))
    k = first_new_index(expected, 3, load_tokenizer(tiny_llama))
    eos = expected[k]
    out = tmp_path_factory.mktemp("eos_model") / "llama_eos"
    shutil.copytree(tiny_llama, out)
    for name in ("config.json", "generation_config.json"):
        path = Path(out) / name
        cfg = json.loads(path.read_text())
        cfg["eos_token_id"] = eos
        path.write_text(json.dumps(cfg))
    return str(out), eos, k


def test_eos_stops_unless_ignored(eos_model: tuple[str, int, int], tiny_llama: str) -> None:
    model_dir, eos, k = eos_model
    expected = greedy_of(tiny_llama, tuple(PROMPT))
    llm = LLM(model_dir, kv_cache_memory_bytes=1 << 22)
    assert eos in llm.engine.eos_token_ids
    tok = llm.get_tokenizer()
    comp = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=16))[0].outputs[0]
    assert comp.token_ids == expected[:k + 1], "eos ends the output (and is included in token_ids)"
    assert comp.finish_reason == "stop" and comp.stop_reason is None
    assert comp.text == tok.decode(expected[:k])
    comp = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    assert comp.token_ids == expected and comp.finish_reason == "length"
    comp = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=16, min_tokens=k + 3))[0].outputs[0]
    assert comp.token_ids[:k] == expected[:k] and len(comp.token_ids) >= k + 3
    assert eos not in comp.token_ids[:k + 3], "eos is banned before min_tokens"
    # a seeded sample stops at eos as well, wherever it draws it
    for seed in range(6):
        comp = llm.generate([PROMPT], SamplingParams(temperature=1.0, top_k=3, seed=seed, max_tokens=16))[0].outputs[0]
        assert (eos in comp.token_ids) == (comp.finish_reason == "stop")
        if eos in comp.token_ids:
            assert comp.token_ids.index(eos) == len(comp.token_ids) - 1
    assert_all_free(llm)


# ---- penalties ---------------------------------------------------------------------------------------------------
def repeats(ids: list[int]) -> int:
    return len(ids) - len(set(ids))


PENALTIES = [dict(rep=2.0), dict(freq=2.0), dict(pres=2.0), dict(rep=1.3, freq=0.5, pres=0.4), dict(rep=0.6),
             dict(pres=-1.0)]


@pytest.fixture(scope="module")
def repetitive_prompt(tiny_llama: str) -> list[int]:
    """A prompt whose greedy continuation repeats tokens a lot."""
    cands = random_prompts(12, seed=9, min_len=4, max_len=20)
    ids, _ = hf_greedy_with_logits(tiny_llama, cands, 16)
    best = max(range(len(cands)), key=lambda i: repeats(ids[i]))
    assert repeats(ids[best]) >= 4, [repeats(x) for x in ids]
    return cands[best]


def test_penalties_match_a_manual_computation(llm: LLM, tiny_llama: str, repetitive_prompt: list[int]) -> None:
    prompts = [repetitive_prompt, PROMPT]
    steps = 14
    requests, refs = [], []
    for prompt in prompts:
        for pen in PENALTIES:
            sp = greedy_sp(steps, repetition_penalty=pen.get("rep", 1.0), frequency_penalty=pen.get("freq", 0.0),
                           presence_penalty=pen.get("pres", 0.0))
            requests.append((prompt, sp))
            refs.append(hf_penalized_greedy(tiny_llama, prompt, steps, **pen))
        requests.append((prompt, greedy_sp(steps)))  # an unpenalized row in the same batch
        refs.append(hf_penalized_greedy(tiny_llama, prompt, steps))
    # one batch: penalties are per row and must not leak between rows
    outs = llm.generate([p for p, _ in requests], [sp for _, sp in requests])
    assert_greedy_close(token_ids(outs), [r[0] for r in refs], [r[1] for r in refs])
    # the first token with repetition_penalty=2 is the argmax of the penalized logits
    logits = hf_first_logits(tiny_llama, tuple(repetitive_prompt)).clone()
    seen = torch.tensor(repetitive_prompt)
    logits[seen] = torch.where(logits[seen] > 0, logits[seen] / 2.0, logits[seen] * 2.0)
    assert outs[0].outputs[0].token_ids[0] == int(logits.argmax())
    # strong repetition / frequency penalties change a repetitive greedy output and repeat less
    plain = outs[len(PENALTIES)].outputs[0].token_ids
    for i in (0, 1):
        penalized = outs[i].outputs[0].token_ids
        assert penalized != plain and repeats(penalized) < repeats(plain), (PENALTIES[i], penalized, plain)
    assert_all_free(llm)


def test_penalties_with_sampling_are_per_sequence(llm: LLM) -> None:
    """A penalized seeded request gives the same tokens alone and next to unpenalized requests."""
    sp = SamplingParams(temperature=0.7, seed=11, max_tokens=16, ignore_eos=True, frequency_penalty=1.5,
                        repetition_penalty=1.5)
    alone = llm.generate([PROMPT], sp)[0].outputs[0].token_ids
    batch = llm.generate([PROMPTS[0], PROMPT, PROMPT],
                         [greedy_sp(16), sp, SamplingParams(temperature=0.7, seed=11, max_tokens=16, ignore_eos=True)])
    assert batch[1].outputs[0].token_ids == alone
    assert batch[2].outputs[0].token_ids != alone, "the penalties changed the seeded sample"
    assert_all_free(llm)


# ---- logprobs ----------------------------------------------------------------------------------------------------
def check_logprobs(comp, prompt: list[int], model_dir: str, n: int, tokenizer) -> int:
    """Compare the logprobs of every generated token with transformers' log-softmax along the same path.
    Returns how many sampled tokens ranked below the top n."""
    ref = hf_step_logits(model_dir, prompt, comp.token_ids).log_softmax(-1)
    assert comp.logprobs is not None and len(comp.logprobs) == len(comp.token_ids)
    outside = 0
    total = 0.0
    for step, (tid, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = ref[step]
        assert tid in entry, "the sampled token is always in its logprobs"
        assert len(entry) >= n and len(entry) <= n + 1, entry
        for t, lp in entry.items():
            assert abs(lp.logprob - float(row[t])) < 1e-4, (step, t, lp.logprob, float(row[t]))
            higher_lo = int((row > row[t] + 1e-4).sum())
            higher_hi = int((row > row[t] - 1e-4).sum())
            assert higher_lo + 1 <= lp.rank <= higher_hi + 1, (step, t, lp.rank)
            assert lp.decoded_token == tokenizer.decode([t])
        top_entries = [t for t in entry if entry[t].rank <= n]
        assert sorted(entry[t].rank for t in top_entries) == list(range(1, n + 1)), "the top-n ranks are 1..n"
        if n:
            nth = float(row.topk(n).values[-1])
            assert all(float(row[t]) >= nth - 1e-4 for t in top_entries), "the top-n entries are transformers' top n"
        if entry[tid].rank > n:
            outside += 1
            assert len(entry) == n + 1
        total += entry[tid].logprob
    assert comp.cumulative_logprob == pytest.approx(total, abs=1e-4)
    return outside


def test_logprobs_greedy(llm: LLM, tiny_llama: str) -> None:
    tok = llm.get_tokenizer()
    outs = llm.generate(PROMPTS, greedy_sp(8, logprobs=3))
    for prompt, out in zip(PROMPTS, outs):
        assert check_logprobs(out.outputs[0], prompt, tiny_llama, 3, tok) == 0
        assert all(len(e) == 3 for e in out.outputs[0].logprobs)
    # logprobs=None gives none; logprobs=0 only the sampled token
    comp = llm.generate([PROMPT], greedy_sp(4))[0].outputs[0]
    assert comp.logprobs is None and comp.cumulative_logprob is None
    comp = llm.generate([PROMPT], greedy_sp(4, logprobs=0))[0].outputs[0]
    assert [list(e) for e in comp.logprobs] == [[t] for t in comp.token_ids]
    check_logprobs(comp, PROMPT, tiny_llama, 0, tok)
    assert_all_free(llm)


def test_logprobs_sampled_include_the_sampled_token(llm: LLM, tiny_llama: str) -> None:
    tok = llm.get_tokenizer()
    sps = [SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True, logprobs=3,
                          repetition_penalty=1.2 if s % 2 else 1.0) for s in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, sps)
    outside = sum(check_logprobs(o.outputs[0], p, tiny_llama, 3, tok) for p, o in zip(PROMPTS, outs))
    assert outside > 0, "some sampled tokens should rank below the top 3 (their logprobs are then included)"
    assert_all_free(llm)


# ---- n -----------------------------------------------------------------------------------------------------------
def test_n_samples(llm: LLM) -> None:
    prompt = PROMPTS[4]  # longer than one block: the samples share the prompt's blocks
    out = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True,
                                                logprobs=1))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    samples = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(samples)) == 3, f"three seeded samples should differ: {samples}"
    assert all(len(c.token_ids) == 10 and c.finish_reason == "length" for c in out.outputs)
    assert all(len(c.logprobs) == 10 for c in out.outputs)
    assert out.num_completion_tokens == 30
    again = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True))[0]
    assert [tuple(c.token_ids) for c in again.outputs] == samples, "n samples are reproducible with a seed"
    greedy = llm.generate([prompt], greedy_sp(10))[0].outputs[0].token_ids
    out = llm.generate([prompt], greedy_sp(10, n=3))[0]
    assert [c.token_ids for c in out.outputs] == [greedy] * 3
    # n > 1 with a stop token: each sample stops on its own
    out = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True,
                                                top_k=2, stop_token_ids=[greedy[0]]))[0]
    for c in out.outputs:
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == greedy[0] and greedy[0] not in c.token_ids[:-1]
        else:
            assert len(c.token_ids) == 12 and greedy[0] not in c.token_ids
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert_all_free(llm)


# ---- output kinds and abort --------------------------------------------------------------------------------------
def test_output_kinds(llm: LLM) -> None:
    engine = llm.engine
    base = dict(n=2, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True, logprobs=2)
    got = run_engine(engine, [
        ("cum", PROMPT, SamplingParams(**base, output_kind=RequestOutputKind.CUMULATIVE)),
        ("delta", PROMPT, SamplingParams(**base, output_kind=RequestOutputKind.DELTA)),
        ("final", PROMPT, SamplingParams(**base, output_kind=RequestOutputKind.FINAL_ONLY)),
    ])
    cum, delta, final = got["cum"], got["delta"], got["final"]
    last = cum[-1]
    assert last.finished and all(not o.finished for o in cum[:-1])
    assert len(cum) == 12, "one cumulative output per generated token"
    for a, b in zip(cum, cum[1:]):
        for ca, cb in zip(a.outputs, b.outputs):
            assert cb.text.startswith(ca.text) and cb.token_ids[:len(ca.token_ids)] == ca.token_ids
    assert len(final) == 1 and final[0].finished
    assert delta[-1].finished and all(not o.finished for o in delta[:-1])
    for i in range(2):
        full = last.outputs[i]
        assert len(full.token_ids) == 12 and full.finish_reason == "length"
        assert "".join(o.outputs[i].text for o in delta) == full.text
        assert sum((o.outputs[i].token_ids for o in delta), []) == full.token_ids
        assert sum((o.outputs[i].logprobs for o in delta), []) == full.logprobs
        assert all(len(o.outputs[i].token_ids) == 1 for o in delta), "each delta carries exactly the new token"
        assert delta[-1].outputs[i].finish_reason == "length"
        f = final[0].outputs[i]
        assert (f.text, f.token_ids, f.logprobs, f.finish_reason) == (full.text, full.token_ids, full.logprobs,
                                                                      "length")
        assert f.cumulative_logprob == pytest.approx(full.cumulative_logprob)
    assert_all_free(llm)


def test_abort_mid_generation(llm: LLM) -> None:
    engine = llm.engine
    bm = engine.block_manager
    engine.add_request("a", PROMPTS[4], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    engine.add_request("b", PROMPT, greedy_sp(6))
    engine.add_request("c", PROMPTS[1], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=50, ignore_eos=True,
                                                       output_kind=RequestOutputKind.DELTA))
    engine.add_request("f", PROMPTS[2], SamplingParams(temperature=1.0, max_tokens=50, ignore_eos=True,
                                                       output_kind=RequestOutputKind.FINAL_ONLY))
    streamed: list[list[int]] = [[], [], []]
    for _ in range(4):
        for o in engine.step():
            assert o.request_id != "f", "FINAL_ONLY sends nothing before the end"
            if o.request_id == "c":
                for i, c in enumerate(o.outputs):
                    streamed[i].extend(c.token_ids)
    assert bm.num_free_blocks < bm.num_blocks
    outs = engine.abort_request("a")
    assert len(outs) == 1 and outs[0].request_id == "a" and outs[0].finished
    comp = outs[0].outputs[0]
    assert comp.finish_reason == "abort" and 1 <= len(comp.token_ids) < 50
    generated = len(comp.token_ids)  # every request was admitted in the first step: as many tokens each
    outs = engine.abort_request(["c", "unknown", "f"])
    assert [o.request_id for o in outs] == ["c", "f"] and all(o.finished for o in outs)
    assert [c.index for c in outs[0].outputs] == [0, 1, 2]
    for i, c in enumerate(outs[0].outputs):
        assert c.finish_reason == "abort"
        assert len(streamed[i]) + len(c.token_ids) == generated, "the abort output carries the rest of the delta"
    assert outs[1].outputs[0].finish_reason == "abort" and len(outs[1].outputs[0].token_ids) == generated
    assert engine.abort_request("a") == [], "a second abort is a no-op"
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["b"] and finished[0].outputs[0].finish_reason == "length"
    # abort while still waiting (never scheduled)
    engine.add_request("w", PROMPT, greedy_sp(8))
    outs = engine.abort_request("w")
    assert outs[0].outputs[0].finish_reason == "abort" and outs[0].outputs[0].token_ids == []
    assert not engine.has_unfinished_requests()
    assert bm.num_free_blocks == bm.num_blocks
    assert_all_free(llm)
    # the engine still serves
    assert llm.generate([PROMPT], greedy_sp(6))[0].outputs[0].finish_reason == "length"
