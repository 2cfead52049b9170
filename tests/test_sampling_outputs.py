"""What sampling returns besides tokens, on a tiny model: penalties (against a manual computation on
transformers' logits), logprobs, n samples, output kinds and abort."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # the kernel's path runs in Triton's interpreter here (set before its first import)
    os.environ["TRITON_INTERPRET"] = "1"
from sampling_helpers import _one_thread, llm  # noqa: F401  (module fixtures)
from sampling_helpers import PROMPT, PROMPTS, greedy_sp, hf_first_logits, hf_penalized_greedy, hf_step_logits, run_engine, token_ids
from tiny_models import assert_engine_idle, assert_greedy_close, hf_greedy_with_logits, random_prompts

from kvgate.engine import LLM, RequestOutputKind, SamplingParams


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
    assert_engine_idle(llm)


@pytest.mark.parametrize("fused", [False, True], ids=["torch", "kernel"])
def test_penalties_with_sampling_are_per_sequence(llm: LLM, fused: bool) -> None:
    """A penalized seeded request gives the same tokens alone and next to unpenalized requests, on the torch
    sampler and on the fused kernel's path (CUDA's; the interpreter here). Negative presence and frequency penalties
    make it repeat its own tokens, which the tiny random model's sample seldom does: a check that the
    penalties acted that does not hang on one draw of the noise."""
    llm.engine.sampler.fused = fused
    try:
        sp = SamplingParams(temperature=0.7, seed=11, max_tokens=16, ignore_eos=True, repetition_penalty=1.2,
                            frequency_penalty=-2.0, presence_penalty=-2.0)
        alone = llm.generate([PROMPT], sp)[0].outputs[0].token_ids
        unpenalized = SamplingParams(temperature=0.7, seed=11, max_tokens=16, ignore_eos=True)
        batch = llm.generate([PROMPTS[0], PROMPT, PROMPT], [greedy_sp(16), sp, unpenalized])
    finally:
        llm.engine.sampler.fused = None
    assert batch[1].outputs[0].token_ids == alone
    plain = batch[2].outputs[0].token_ids
    assert repeats(alone) >= repeats(plain) + 3, (alone, plain)  # (20 seeds on each path: 5-15 against 0-2)
    assert_engine_idle(llm)


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
    assert_engine_idle(llm)


def test_logprobs_sampled_include_the_sampled_token(llm: LLM, tiny_llama: str) -> None:
    tok = llm.get_tokenizer()
    sps = [SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True, logprobs=3,
                          repetition_penalty=1.2 if s % 2 else 1.0) for s in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, sps)
    outside = sum(check_logprobs(o.outputs[0], p, tiny_llama, 3, tok) for p, o in zip(PROMPTS, outs))
    assert outside > 0, "some sampled tokens should rank below the top 3 (their logprobs are then included)"
    assert_engine_idle(llm)


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
    assert_engine_idle(llm)


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
    assert_engine_idle(llm)


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
    assert_engine_idle(llm)
    # the engine still serves
    assert llm.generate([PROMPT], greedy_sp(6))[0].outputs[0].finish_reason == "length"
