"""Guided decoding in the engine (engine/structured_output/): every kind of StructuredOutputsParams is followed, a
random model's JSON validates against its schema for small max_tokens, guided and unguided requests share steps,
n > 1, preemption, chunked prefill, abort, invalid specs, compilation off the loop and its cache."""
from __future__ import annotations

import contextlib
import json
import re
import threading
from collections.abc import Iterator

import jsonschema
import pytest
from tiny_models import assert_engine_idle, random_prompts

from kvgate.engine import LLM, SamplingParams
from kvgate.engine.sequence import SequenceStatus
from kvgate.engine.stats import snapshot
from kvgate.engine.structured_output import StructuredOutputsParams
from kvgate.engine.structured_output.manager import StructuredOutputManager

SCHEMAS = {  # each one's shortest document fits in 24 tokens of the tiny tokenizer
    "enum_and_range": {"type": "object", "properties": {
        "c": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer", "minimum": 3, "maximum": 97}},
        "required": ["c", "n"]},
    "nested": {"type": "object", "properties": {
        "p": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -50, "maximum": -10},
                                               "ok": {"type": "boolean"}}, "required": ["x", "ok"]},
        "z": {"type": "null"}}, "required": ["p"]},
    "array": {"type": "object", "properties": {
        "a": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2,
              "maxItems": 4}}, "required": ["a"]},
    "strings": {"type": "object", "properties": {
        "s": {"type": "string", "pattern": "^[a-z]+$", "minLength": 2, "maxLength": 6},
        "t": {"type": "string", "minLength": 1, "maxLength": 5}}, "required": ["s", "t"]},
    "any_of": {"type": "object", "properties": {
        "v": {"anyOf": [{"type": "integer", "minimum": 100, "maximum": 200},
                        {"type": "string", "pattern": "^[A-Z]{2}$"}, {"type": "null"}]}}, "required": ["v"]},
    "number_bool": {"type": "object", "properties": {
        "f": {"type": "number", "minimum": 0.5, "maximum": 9.5}, "b": {"type": "boolean"}}, "required": ["f", "b"]},
    "array_of_objects": {"type": "array", "items": {"type": "object", "properties": {"i": {"type": "integer"}},
                                                    "required": ["i"]}, "minItems": 1, "maxItems": 3},
}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}


def big_schema(n: int = 50) -> dict:
    props = {f"field_{i}": {"type": "string", "pattern": f"^[a-z]{{1,{i % 7 + 2}}}[0-9]?$"} for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props)}


def guided(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw)


def no_constants(name: str) -> None:
    raise ValueError(f"JSON constant {name} is not JSON")


def parse(text: str):
    """json.loads that refuses NaN / Infinity (Python accepts them by default)."""
    return json.loads(text, parse_constant=no_constants)


@pytest.fixture(scope="module")
def llm(tiny_llama: str) -> LLM:
    return LLM(tiny_llama, max_num_seqs=64, max_model_len=512, max_num_batched_tokens=128)


def test_json_schemas_validate_for_a_random_model_and_small_budgets(llm: LLM) -> None:
    prompts, params, names = [], [], []
    for max_tokens in (24, 40, 64):
        for name, schema in SCHEMAS.items():
            for seed in range(6):
                prompts.append(f"item {seed}")
                params.append(SamplingParams(temperature=1.0 + 0.5 * (seed % 2), seed=seed, max_tokens=max_tokens,
                                             structured_outputs=guided(json=schema)))
                names.append(name)
    outs = llm.generate(prompts, params)
    for name, out, sp in zip(names, outs, params):
        c = out.outputs[0]
        jsonschema.validate(parse(c.text), SCHEMAS[name])
        assert c.finish_reason == "stop" and len(c.token_ids) <= sp.max_tokens
        assert " " not in c.text.replace('" "', "") or name == "strings"  # compact: no whitespace between tokens
    assert_engine_idle(llm)


def test_every_kind_is_followed(llm: LLM) -> None:
    grammar = 'root ::= "(" [a-z]+ ")" | "[" [0-9]+ "]"'
    kinds = {
        "json": (guided(json=json.dumps(PERSON)), lambda t: jsonschema.validate(parse(t), PERSON)),
        "json_object": (guided(json_object=True), lambda t: isinstance(parse(t), dict) or pytest.fail(t)),
        "regex": (guided(regex=r"[0-9]{3}-[a-z]{2,4}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)
                  or pytest.fail(t)),
        "choice": (guided(choice=["yes", "no", 'maybe "so"']), lambda t: t in ("yes", "no", 'maybe "so"')
                   or pytest.fail(t)),
        "grammar": (guided(grammar=grammar), lambda t: re.fullmatch(r"\([a-z]+\)|\[[0-9]+\]", t) or pytest.fail(t)),
        "json_with_whitespace": (guided(json=PERSON, disable_any_whitespace=False),
                                 lambda t: jsonschema.validate(parse(t), PERSON)),
    }
    names = [k for k in kinds for _ in range(4)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=48, structured_outputs=kinds[k][0])
              for i, k in enumerate(names)]
    for name, out in zip(names, llm.generate(["Answer:"] * len(names), params)):
        kinds[name][1](out.outputs[0].text)
        assert out.outputs[0].finish_reason == "stop", (name, out.outputs[0])


def test_guided_and_unguided_share_steps_and_unguided_is_unchanged(llm: LLM) -> None:
    prompts = random_prompts(6, seed=3, min_len=4, max_len=40)
    plain = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=24)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain)]
    mixed_params = [plain if i % 2 == 0 else SamplingParams(temperature=0.0, max_tokens=40,
                                                            structured_outputs=guided(json=PERSON))
                    for i in range(len(prompts))]
    mixed = llm.generate(prompts, mixed_params)
    for i, out in enumerate(mixed):
        if i % 2 == 0:
            assert out.outputs[0].token_ids == alone[i]
        else:
            jsonschema.validate(parse(out.outputs[0].text), PERSON)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_each_of_n_samples_has_its_own_matcher(tiny_llama: str, llm: LLM, asynchronous: bool) -> None:
    if asynchronous:  # the n samples forked as the prompt's step starts, running ahead of their tokens (a pool of
        # its own size: on a GPU the module's engine holds gpu_memory_utilization of it)
        llm = LLM(tiny_llama, max_num_seqs=64, max_model_len=512, max_num_batched_tokens=128, async_scheduling=True,
                  num_gpu_blocks_override=64)
    try:
        sp = SamplingParams(n=3, temperature=1.2, seed=7, max_tokens=40, structured_outputs=guided(json=PERSON))
        out = llm.generate("Person:", sp)[0]
        texts = [c.text for c in out.outputs]
        for text in texts:
            jsonschema.validate(parse(text), PERSON)
        assert len(set(texts)) > 1  # independent samples
        assert_engine_idle(llm)
    finally:
        if asynchronous:
            llm.engine.shutdown()


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_preemption_by_recompute_keeps_matchers_consistent(tiny_llama: str, llm: LLM, asynchronous: bool) -> None:
    """Also with async scheduling: guided rows running ahead, n = 1 here, preempted with steps in flight."""
    prompts = random_prompts(6, seed=11, min_len=20, max_len=40)
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=guided(json=SCHEMAS["array"]))
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    small = LLM(tiny_llama, num_gpu_blocks_override=10, max_num_batched_tokens=64, max_num_seqs=8,
                async_scheduling=asynchronous)
    outs = small.generate(prompts, params)
    assert small.engine.scheduler.num_preemptions > 0
    for out, ref in zip(outs, reference):
        jsonschema.validate(parse(out.outputs[0].text), SCHEMAS["array"])
        assert out.outputs[0].token_ids == ref
    assert_engine_idle(small)


def test_chunked_prefill_of_a_long_prompt(llm: LLM) -> None:
    prompt = random_prompts(1, seed=5, min_len=400, max_len=400)[0]  # 4 chunks of 128 tokens
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=40,
                                                                    structured_outputs=guided(json=PERSON)))[0]
    jsonschema.validate(parse(out.outputs[0].text), PERSON)
    assert len(out.outputs[0].token_ids) <= 512 - 400


def test_abort_frees_blocks_and_matchers(llm: LLM) -> None:
    engine = llm.engine
    so = engine.structured_output_manager
    engine.add_request("a", "Hi", SamplingParams(max_tokens=200, ignore_eos=True, n=2,
                                                 structured_outputs=guided(json=PERSON)))
    while len(engine.requests["a"].seqs[0].token_ids) < 10:
        engine.step()
    seqs = engine.requests["a"].seqs
    assert all(s.grammar is not None for s in seqs) and so.active == {"a"}
    engine.abort_request("a")
    assert all(s.grammar is None for s in seqs) and not so.active and not so.waiting
    with compilations_held(so):  # and abort while the grammar is still compiling
        engine.add_request("b", "Hi", SamplingParams(max_tokens=8, structured_outputs=guided(json=big_schema(7))))
        engine.step()
        assert engine.requests["b"].seqs[0].status is SequenceStatus.WAITING_FOR_FSM and "b" in so.waiting
        engine.abort_request("b")
    assert not so.waiting and not so.active
    assert_engine_idle(llm)


@pytest.mark.parametrize("spec, problem", [
    (dict(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}), "structured_outputs.json"),
    (dict(json="{not json"), "not valid JSON"),
    (dict(regex="(unclosed"), "structured_outputs.regex"),
    (dict(grammar='root ::= "a" missing_rule'), "structured_outputs.grammar"),
])
def test_an_invalid_spec_fails_alone(llm: LLM, spec: dict, problem: str) -> None:
    engine = llm.engine
    engine.add_request("ok-guided", "Hi", SamplingParams(temperature=0.0, max_tokens=30,
                                                         structured_outputs=guided(json=PERSON)))
    engine.add_request("ok-plain", "Hi", SamplingParams(temperature=0.0, max_tokens=5))
    engine.add_request("bad", "Hi", SamplingParams(max_tokens=30, structured_outputs=guided(**spec)))
    finished, failed = {}, []
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        failed += engine.take_failed()
    assert [rid for rid, _ in failed] == ["bad"] and isinstance(failed[0][1], ValueError)
    assert problem in str(failed[0][1])
    assert set(finished) == {"ok-guided", "ok-plain"}
    jsonschema.validate(parse(finished["ok-guided"].outputs[0].text), PERSON)
    assert_engine_idle(llm)
    with pytest.raises(ValueError, match=re.escape(problem)):  # known bad now: refused at once
        engine.add_request("bad-again", "Hi", SamplingParams(structured_outputs=guided(**spec)))
    with pytest.raises(ValueError, match=re.escape(problem)):  # offline: the batch fails with it
        llm.generate(["x"], SamplingParams(structured_outputs=guided(**spec)))
    assert_engine_idle(llm)


@contextlib.contextmanager
def compilations_held(so: StructuredOutputManager) -> Iterator[threading.Event]:
    """Every compilation started inside waits (on the worker) until the yielded event is set, as a slow schema
    would."""
    gate = threading.Event()
    compile_ = so._compile

    def slow(params):
        gate.wait(30)
        return compile_(params)

    so._compile = slow  # type: ignore[method-assign]
    try:
        yield gate
    finally:
        gate.set()
        del so._compile


def test_compilation_runs_off_the_loop_and_is_cached(llm: LLM) -> None:
    engine = llm.engine
    so = engine.structured_output_manager
    schema = big_schema(50)
    compiles = so.num_compiles
    with compilations_held(so):
        engine.add_request("plain", "Hi", SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12))
        engine.add_request("guided", "Hi", SamplingParams(temperature=0.0, max_tokens=20,
                                                          structured_outputs=guided(json=schema)))
        waiting_steps = []  # steps in which "plain" got a token while "guided" waited for its grammar
        while len(engine.requests["plain"].seqs[0].output_token_ids) < 5:
            outs = engine.step()
            if any(o.request_id == "plain" for o in outs):
                assert engine.requests["guided"].seqs[0].status is SequenceStatus.WAITING_FOR_FSM
                waiting_steps.append(engine.num_steps)
        assert len(waiting_steps) == 5
        stats = snapshot(engine)
        assert (stats.num_requests_running, stats.num_requests_waiting) == (1, 1)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert so.num_compiles == compiles + 1
    assert done["guided"].outputs[0].finish_reason == "length"  # 50 required fields do not fit in 20 tokens
    hits = so.num_cache_hits
    engine.add_request("again", "Hi", SamplingParams(temperature=0.0, max_tokens=20,
                                                     structured_outputs=guided(json=json.dumps(schema))))
    assert engine.requests["again"].seqs[0].status is SequenceStatus.WAITING  # scheduled at once
    assert so.num_compiles == compiles + 1 and so.num_cache_hits == hits + 1
    while engine.has_unfinished_requests():
        engine.step()
    assert_engine_idle(llm)


def test_eos_only_where_the_grammar_ends_and_ignore_eos(llm: LLM) -> None:
    choices = ["alpha", "be"]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=30, ignore_eos=True, min_tokens=10,
                             structured_outputs=guided(choice=choices)) for s in range(6)]
    for out in llm.generate(["Pick:"] * 6, params):
        c = out.outputs[0]
        assert c.text in choices and c.finish_reason == "stop"  # the grammar ended it: ignore_eos, min_tokens too


def test_an_engine_without_tokenizer_refuses_guided_requests(tiny_llama: str) -> None:
    llm = LLM(tiny_llama, skip_tokenizer_init=True, num_gpu_blocks_override=16)
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        llm.generate([[5, 6, 7]], SamplingParams(structured_outputs=guided(json=PERSON)))
    with pytest.raises(ValueError, match="StructuredOutputsParams"):
        llm.generate([[5, 6, 7]], SamplingParams(structured_outputs={"json": PERSON}))  # type: ignore[arg-type]
    assert_engine_idle(llm)


# ---- the pieces --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def backend(llm: LLM):
    from kvgate.engine.structured_output.backend import XgrammarBackend

    engine = llm.engine
    return XgrammarBackend(engine.tokenizer, engine.config.model_config.vocab_size, engine.eos_token_ids)


@pytest.mark.parametrize("schema, shortest", [
    ({"type": "object", "properties": {"c": {"enum": ["long", "x"]}}, "required": ["c"]}, '{"c":"x"}'),
    ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 18, "maximum": 120}},
      "required": ["n"]}, '{"n":99}'),
    ({"type": "string", "pattern": "^[a-z0-9.]+@[a-z]+\\.[a-z]{2,3}$"}, None),  # a repetition before its exit
    ({"type": "array", "items": {"type": "string", "pattern": "^[0-9]{5}$"}, "minItems": 1}, None),
])
def test_the_completion_search(backend, schema: dict, shortest: str | None) -> None:
    import xgrammar as xgr

    from kvgate.engine.structured_output.completion import MAX_COMPLETION_TOKENS, CompletionSearch, improve

    guide = backend.compile(guided(json=schema))
    matcher = xgr.GrammarMatcher(guide.grammar)
    plan = CompletionSearch(matcher, backend.search_alphabet, MAX_COMPLETION_TOKENS, backend.vocab_size).run()
    assert plan is not None
    plan = improve(matcher, backend.search_alphabet, plan, backend.vocab_size, 20000)
    text = b"".join(backend.decoded_vocab[t] for t in plan).decode()
    assert matcher.accept_string(text) and matcher.is_completed()
    jsonschema.validate(parse(text), schema)
    if shortest is not None:
        assert len(text) == len(shortest)


def test_a_token_that_cuts_the_plan_never_breaks_the_budget(backend) -> None:
    """The budget-aware finish against a sampler that, wherever it can, writes only the start of the plan's next
    token (`a` where the plan goes on with `active`): the plan then goes on in single-byte tokens, longer than it
    was, and must still fit the budget (else another completion, or the plan's own token, is taken). Every budget
    from the shortest completion up, tokens otherwise random: each output validates and stays within its budget."""
    import random

    import xgrammar as xgr

    from kvgate.engine.structured_output.completion import MAX_COMPLETION_TOKENS, CompletionSearch, improve
    from kvgate.engine.structured_output.grammar import SequenceGrammar

    schema = {"type": "object", "properties": {
        "active": {"type": "boolean"}, "name": {"type": "string", "maxLength": 8},
        "the_count": {"type": "integer", "minimum": 0, "maximum": 500}}, "required": ["active", "name", "the_count"]}
    guide = backend.compile(guided(json=schema))
    matcher = xgr.GrammarMatcher(guide.grammar)
    plan = CompletionSearch(matcher, backend.search_alphabet, MAX_COMPLETION_TOKENS, backend.vocab_size).run()
    guide.initial_completion = improve(matcher, backend.search_alphabet, plan, backend.vocab_size, 20000)
    vocab, mask = backend.decoded_vocab, xgr.allocate_token_bitmask(1, backend.vocab_size)
    cuts = 0
    for budget in range(len(guide.initial_completion), len(guide.initial_completion) + 48, 3):
        for seed in range(3):
            g, rng, out = SequenceGrammar(guide, backend), random.Random(seed), []
            for remaining in range(budget, 0, -1):
                token = g.prepare(remaining)
                if token is None:
                    g.matcher.fill_next_token_bitmask(mask, 0)
                    bits = mask[0].numpy()
                    allowed = [t for t in range(backend.vocab_size) if (bits[t >> 5] >> (t & 31)) & 1
                               and (vocab[t].isascii() or t in backend.stop_token_ids)]
                    head = vocab[g.plan[0]] if g.plan else b""
                    cut = [t for t in allowed if 0 < len(vocab[t]) < len(head) and head.startswith(vocab[t])]
                    cuts += bool(cut)
                    token = rng.choice(cut or allowed)
                out.append(g.accept(token, remaining))
                assert not g.budget_lost, (budget, seed, b"".join(vocab[t] for t in out))
                if g.finished:
                    break
            text = b"".join(vocab[t] for t in out).decode()
            jsonschema.validate(parse(text), schema)
    assert cuts > 20  # the case this test is about came up


def test_schema_rewrites_for_xgrammar() -> None:
    from kvgate.engine.structured_output.schema import JSON_STRING_CHAR, normalize_json_schema

    schema = {"type": "object", "properties": {
        "a": {"type": "string", "maxLength": 5},
        "b": {"type": "string", "pattern": "^[a-z]+$", "minLength": 2, "maxLength": 6},
        "c": {"type": "string", "pattern": "\\d{3,}", "maxLength": 4},
        "d": {"type": "string", "pattern": "^(ab)+$", "maxLength": 4},
        "e": {"enum": [{"type": "string", "maxLength": 1}]}}}
    out = normalize_json_schema(schema)
    p = out["properties"]
    assert p["a"] == {"type": "string", "pattern": f"^{JSON_STRING_CHAR}{{0,5}}$"}
    assert p["b"] == {"type": "string", "pattern": "^[a-z]{2,6}$"}
    assert p["c"] == {"type": "string", "pattern": "^\\d{3,4}$"}
    assert p["d"] == schema["properties"]["d"]  # not one repeated atom: kept (lengths unenforced, logged)
    assert p["e"] == schema["properties"]["e"]  # an enum's values are values, not schemas
    assert schema["properties"]["a"] == {"type": "string", "maxLength": 5}  # the caller's schema is not changed


def test_utf8_validity_of_tokens() -> None:
    from kvgate.engine.structured_output.backend import _utf8_fragment_ok

    assert _utf8_fragment_ok("é".encode()) and _utf8_fragment_ok(b"\xc3") and _utf8_fragment_ok(b"\xa9x")
    assert _utf8_fragment_ok("日".encode()[:2]) and _utf8_fragment_ok(b"\xe0\xa0")
    for bad in (b"\xc0\x80", b"\xc1", b"\xf5", b"\xed\xa0\x80", b"\xe0\x80", b"\xf4\x90", b"a\xc3a"):
        assert not _utf8_fragment_ok(bad), bad


def test_surrogates_and_overlong_forms_never_reach_the_text(llm: LLM) -> None:
    schema = {"type": "object", "properties": {"t": {"type": "string", "minLength": 1, "maxLength": 5}},
              "required": ["t"]}
    params = [SamplingParams(temperature=1.5, seed=s, max_tokens=40, structured_outputs=guided(json=schema))
              for s in range(24)]
    for out in llm.generate(["item"] * 24, params):
        assert "\ufffd" not in out.outputs[0].text
        jsonschema.validate(parse(out.outputs[0].text), schema)


def test_tokens_never_valid_utf8_are_masked_in_every_guided_row(llm: LLM) -> None:
    """GrammarStep.apply masks the tokens that can never be part of valid UTF-8 (XgrammarBackend.utf8_masks[0]) on
    the logits' device, beside what the grammar forbids. The tiny tokenizer's grammar refuses its invalid tokens
    itself, so here some tokens the grammar allows are marked invalid: they must come out -inf."""
    import torch

    from kvgate.engine.sampling_params import SamplingParams as SP
    from kvgate.engine.sequence import Request, Sequence

    engine = llm.engine
    dev = engine.config.device  # (on a GPU: the mask is copied from pinned memory and narrowed there)
    so = StructuredOutputManager(engine.tokenizer, engine.config.model_config.vocab_size, engine.eos_token_ids,
                                 dev, max_num_seqs=4)
    schema = {"type": "object", "properties": {"t": {"type": "string"}}, "required": ["t"]}
    seqs = []
    for rid in ("a", "b"):
        req = Request(rid, None, [5, 6], SP(max_tokens=40, structured_outputs=guided(json=schema)))
        req.seqs.append(Sequence(req, 0, [5, 6]))
        if not so.add_request(req):
            so.wait(30)
            assert so.take_ready()[0] == [req]
        seqs.append(req.seqs[0])
    seqs[1].grammar.matcher.accept_string('{"t":"')  # inside a string: most of the vocabulary is allowed
    step = so.prepare_step(seqs, [40, 40])
    vocab = so.vocab_size
    grammar_allows = [[t for t in range(vocab) if (int(step.bitmask[r, t >> 5]) >> (t & 31)) & 1] for r in (0, 1)]
    marked = grammar_allows[1][::3]  # a third of the string's tokens
    valid = so._backend.utf8_masks[0].clone()
    for t in marked:
        valid[t >> 5] &= ~(1 << (t & 31)) if t & 31 != 31 else 0x7FFFFFFF
    so._backend.utf8_masks, so._backend.narrow_utf8 = (valid, so._backend.utf8_masks[1]), True
    logits = torch.zeros(3, vocab, device=dev)  # row 2: not guided (left alone)
    step.apply(logits)
    logits = logits.cpu()
    for r in (0, 1):
        assert torch.isfinite(logits[r]).nonzero()[:, 0].tolist() == sorted(set(grammar_allows[r]) - set(marked))
    assert torch.isfinite(logits[2]).all() and len(grammar_allows[1]) > 100
    for s in seqs:
        so.finish(s.request)


def test_logprobs_are_the_models_own(llm: LLM) -> None:
    sp = SamplingParams(temperature=0.0, max_tokens=30, logprobs=1, structured_outputs=guided(json=PERSON))
    c = llm.generate("Person:", sp)[0].outputs[0]
    ranks = [lp[t].rank for t, lp in zip(c.token_ids, c.logprobs)]
    assert max(ranks) > 1  # the grammar took tokens the model did not rank first, and the ranks say so
