"""Stop conditions through LLM / LLMEngine on a tiny model: max_tokens, max_model_len, stop token ids and
strings, min_tokens, EOS and ignore_eos."""
from __future__ import annotations

import functools

import pytest
from sampling_helpers import _one_thread, llm  # noqa: F401  (module fixtures)
from sampling_helpers import PROMPT, greedy_sp, hf_first_logits, load_tokenizer
from tiny_models import assert_engine_idle, copy_with_eos, hf_greedy_with_logits, random_prompts

from kvgate.engine import LLM, SamplingParams


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
    assert_engine_idle(llm)


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
    assert_engine_idle(llm)


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
    assert_engine_idle(llm)


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
    assert_engine_idle(llm)


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
    assert_engine_idle(llm)


@pytest.fixture(scope="module")
def eos_model(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, int, int]:
    """A copy of the tiny Llama whose eos is a token its greedy continuation of PROMPT emits (same weights).
    Returns (model dir, eos id, index of its first appearance in the greedy continuation)."""
    expected = greedy_of(tiny_llama, tuple(PROMPT))
    k = first_new_index(expected, 3, load_tokenizer(tiny_llama))
    eos = expected[k]
    return copy_with_eos(tiny_llama, tmp_path_factory.mktemp("eos_model") / "llama_eos", eos), eos, k


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
    assert_engine_idle(llm)
