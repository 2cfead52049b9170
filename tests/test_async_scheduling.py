"""Async scheduling (engine/llm_engine.py): step N+1 is scheduled and started before step N's sampled tokens reach
the host, its pending tokens taken from N's tokens on the device. On the CPU it overlaps nothing, but it runs the
same bookkeeping as on CUDA (where it is on by default), so here it is turned on explicitly and checked against the
same engine without it: tokens, stops, logprobs, n > 1, preemption, guided rows, aborts and the KV blocks.
"""
from __future__ import annotations

import json

import jsonschema
import pytest
from tiny_models import assert_engine_idle, random_prompts

from kvgate.engine import LLM, SamplingParams
from kvgate.engine.arg_utils import ArgError, EngineArgs
from kvgate.engine.structured_output import StructuredOutputsParams

KW = dict(kv_cache_memory_bytes=1 << 24, max_num_seqs=8, max_num_batched_tokens=64, dtype="float32")  # exact on a GPU too


def run(model: str, prompts, sp, asynchronous: bool, **kw):
    llm = LLM(model, async_scheduling=asynchronous, **{**KW, **kw})
    outs = llm.generate(prompts, sp)
    assert_engine_idle(llm)
    return [[(c.token_ids, c.finish_reason, c.stop_reason, c.text) for c in o.outputs] for o in outs], llm


@pytest.mark.parametrize("sp", [
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=30, min_tokens=5),  # stops on EOS, not before 5 tokens
    SamplingParams(temperature=0.0, max_tokens=30, stop=["e", " a"], include_stop_str_in_output=True),
    SamplingParams(temperature=0.9, top_p=0.9, top_k=20, max_tokens=16, seed=7, n=3, logprobs=3),
    SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=1.3, frequency_penalty=0.4),
], ids=["greedy", "eos-min-tokens", "stop-strings", "seeded-n3-logprobs", "penalties"])
def test_same_outputs_with_and_without(tiny_model_dirs: dict[str, str], sp: SamplingParams) -> None:
    """Chunked prefill (64-token budget over prompts of up to 90 tokens), prefix hits (every prompt starts alike)."""
    base = random_prompts(1, seed=3, min_len=40, max_len=40)[0]
    prompts = [base[:k] + p for k, p in zip((0, 17, 40, 33, 40, 5), random_prompts(6, seed=4, min_len=1,
                                                                                   max_len=50))]
    want, _ = run(tiny_model_dirs["qwen3"], prompts, sp, False)
    got, llm = run(tiny_model_dirs["qwen3"], prompts, sp, True)
    assert got == want
    if sp.logprobs:
        # the same tokens, ranks and logprobs (up to float noise: the steps' batches differ)
        sync = LLM(tiny_model_dirs["qwen3"], async_scheduling=False, **KW).generate(prompts, sp)
        got_lp = [c.logprobs for o in llm.generate(prompts, sp) for c in o.outputs]
        want_lp = [c.logprobs for o in sync for c in o.outputs]
        for g_seq, w_seq in zip(got_lp, want_lp, strict=True):
            for g, w in zip(g_seq, w_seq, strict=True):
                assert {t: (lp.rank, lp.decoded_token) for t, lp in g.items()} == \
                    {t: (lp.rank, lp.decoded_token) for t, lp in w.items()}
                assert all(abs(g[t].logprob - w[t].logprob) < 1e-4 for t in g)


def test_preemption_and_max_model_len(tiny_model_dirs: dict[str, str]) -> None:
    """A cache of 16 blocks for 6 requests that grow to 128 tokens (8 blocks) each: preemptions, some of a sequence
    whose step is in flight; every request runs into max_model_len (128) and ends there."""
    prompts = random_prompts(6, seed=5, min_len=20, max_len=60)
    sp = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    kw = dict(num_gpu_blocks_override=16, block_size=16, max_model_len=128, kv_cache_memory_bytes=None)
    want, _ = run(tiny_model_dirs["llama"], prompts, sp, False, **kw)
    got, llm = run(tiny_model_dirs["llama"], prompts, sp, True, **kw)
    assert got == want and llm.engine.scheduler.num_preemptions > 0
    assert {c[1] for o in got for c in o} == {"length"}
    assert [len(p) + len(o[0][0]) for p, o in zip(prompts, got)] == [128] * 6


def test_the_next_step_starts_before_the_tokens_are_read(tiny_model_dirs: dict[str, str]) -> None:
    """The defining order: start(N+1) comes before result(N); and a finished sequence's extra step is dropped."""
    llm = LLM(tiny_model_dirs["llama"], async_scheduling=True, **KW)
    engine = llm.engine
    log: list[str] = []
    start, result = engine.executor.start, engine.sampler.result
    engine.executor.start = lambda *a, **kw: log.append("start") or start(*a, **kw)
    engine.sampler.result = lambda s: log.append("result") or result(s)
    outs = llm.generate(random_prompts(2, seed=1, max_len=20), SamplingParams(temperature=0.0, max_tokens=5,
                                                                             ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 5]
    # the prompt step, then a start for each later step before the previous step's tokens are read
    assert log[:4] == ["start", "start", "result", "start"]
    assert log.count("start") == 5 and log.count("result") == 5  # no step past the 5th token (max_tokens known)
    assert_engine_idle(llm)


def test_abort_with_steps_in_flight_frees_every_block(tiny_model_dirs: dict[str, str]) -> None:
    llm = LLM(tiny_model_dirs["llama"], async_scheduling=True, **KW)
    engine = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    for i, p in enumerate(random_prompts(4, seed=2, max_len=40)):
        engine.add_request(str(i), p, sp)
    for _ in range(4):
        engine.step()
    assert len(engine.in_flight) == 1 and any(s.num_pending for r in engine.requests.values() for s in r.seqs)
    engine.abort_request(["0", "2"])
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id in ("1", "3")
    assert engine.step() == []
    assert_engine_idle(llm)


def test_guided_rows_run_ahead_and_a_replaced_token_is_computed_again(tiny_model_dirs: dict[str, str]) -> None:
    """A guided row's mask needs its previous token in the matcher: a step with guided rows is drawn after the step
    before completed. The row itself runs ahead (its pending token from the device), also near the end of its
    budget, where the grammar may replace the token it accepts: the step in flight then computed the token drawn,
    so its result for that row is dropped and the position is computed again from the token kept. Outputs are what
    the engine without async scheduling writes (greedy), and every block is freed. The schema lets one token
    lengthen the way to the end (an array's `"` adds the string's closing quote), so small budgets make the
    budget-aware finish replace drawn tokens."""
    schema = {"type": "object", "properties": {"t": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
                                               "o": {"type": "object", "properties": {"k": {"type": "string"}},
                                                     "required": ["k"]}}, "required": ["t", "o"]}
    guide = StructuredOutputsParams(json=schema)
    guided = [SamplingParams(temperature=0.0, max_tokens=24 + i % 9, structured_outputs=guide) for i in range(10)]
    free = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    penalized = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, presence_penalty=0.5)
    params = guided[:5] + [free] + guided[5:] + [penalized]
    prompts = random_prompts(len(params), seed=9, max_len=30)
    out = {}
    for asynchronous in (False, True):
        llm = LLM(tiny_model_dirs["llama"], async_scheduling=asynchronous, **KW)
        engine = llm.engine
        sched = engine.scheduler
        schedule = sched.schedule
        ahead = []

        def checked(*a, **kw):
            pending = {s: s.num_pending for s in sched.running}
            o = schedule(*a, **kw)
            for s, _ in o.scheduled:
                assert pending.get(s, 0) <= 1
                if s.grammar is not None and pending.get(s):
                    ahead.append(s)
            return o

        sched.schedule = checked
        outs = llm.generate(prompts, params)
        out[asynchronous] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]
        for o, p in zip(outs, params):
            if p.structured_outputs is not None:
                jsonschema.validate(json.loads(o.outputs[0].text), schema)
        assert_engine_idle(llm)
        assert bool(ahead) == asynchronous  # with async scheduling guided rows did run ahead
        assert bool(engine.num_rewinds) == asynchronous  # and some drawn token was replaced while they did
    assert out[True] == out[False]

    # sampled (seeded): valid documents within the budgets
    llm = LLM(tiny_model_dirs["llama"], async_scheduling=True, **KW)
    sampled = [SamplingParams(temperature=1.5, seed=i, max_tokens=24 + i % 9, structured_outputs=guide)
               for i in range(48)]  # (24 gave no replaced token with the GPU's sampling kernel: 2-8 of 24 do)
    for o, p in zip(llm.generate(random_prompts(48, seed=3, max_len=20), sampled), sampled):
        jsonschema.validate(json.loads(o.outputs[0].text), schema)
        assert len(o.outputs[0].token_ids) <= p.max_tokens
    assert llm.engine.num_rewinds > 0
    assert_engine_idle(llm)


def test_guided_masks_are_filled_while_the_next_step_is_scheduled(tiny_model_dirs: dict[str, str]) -> None:
    """A guided step drawn after the step before completed has its masks filled on the manager's filler thread
    (xgrammar releases the GIL), and is sampled only after the engine scheduled and built the next step: the fill
    overlaps that host work. Tokens (greedy) and min_tokens come out as without async scheduling."""
    import threading

    schema = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
              "required": ["a", "b"]}
    sp = [SamplingParams(temperature=0.0, max_tokens=40, min_tokens=6 + i,
                         structured_outputs=StructuredOutputsParams(json=schema)) for i in range(6)]
    prompts = random_prompts(6, seed=11, max_len=20)
    want, _ = run(tiny_model_dirs["llama"], prompts, sp, False)

    llm = LLM(tiny_model_dirs["llama"], async_scheduling=True, **KW)
    engine, so = llm.engine, llm.engine.structured_output_manager
    log: list[tuple[str, str]] = []
    fill, schedule, sample = so._fill, engine.scheduler.schedule, engine.sampler.sample
    so._fill = lambda *a, **kw: log.append(("fill", threading.current_thread().name)) or fill(*a, **kw)
    engine.scheduler.schedule = lambda *a, **kw: log.append(("schedule", "")) or schedule(*a, **kw)
    engine.sampler.sample = lambda logits, rows, guide=None, counted=False: \
        log.append(("sample", "guided" if guide is not None else "")) or sample(logits, rows, guide, counted)
    outs = llm.generate(prompts, sp)
    got = [[(c.token_ids, c.finish_reason, c.stop_reason, c.text) for c in o.outputs] for o in outs]
    assert got == want
    for o in outs:
        jsonschema.validate(json.loads(o.outputs[0].text), schema)
    assert_engine_idle(llm)
    background = [i for i, (what, thread) in enumerate(log) if what == "fill" and thread.startswith("kvgate-fill")]
    assert len(background) > 10
    for i in background:  # each: the next step scheduled, then the guided step sampled with its masks
        rest = [what for what, _ in log[i + 1:]]
        assert "schedule" in rest and rest.index("schedule") < rest.index("sample")
        assert log[i + 1 + rest.index("sample")] == ("sample", "guided")


def test_refused_with_several_ranks() -> None:
    with pytest.raises(ArgError, match="async_scheduling runs one rank, and tensor_parallel_size x "
                                       "pipeline_parallel_size is 2"):
        EngineArgs(model="x", async_scheduling=True, tensor_parallel_size=2).check()
