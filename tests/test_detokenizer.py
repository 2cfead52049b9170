"""Incremental detokenization (never a broken UTF-8 character, streamed text == the full decode) and stop strings
(cut before the stop string, never leaked in a stream), as units and through the engine on a tiny model."""
from __future__ import annotations

import copy
import dataclasses
import functools
import random
from collections.abc import Iterator

import pytest
from tiny_models import VOCAB_SIZE, assert_engine_idle, copy_with_eos, one_thread, random_prompts

from kvgate.engine import LLM, LLMEngine, RequestOutput, RequestOutputKind, SamplingParams
from kvgate.engine.detokenizer import (OutputDetokenizer, byte_table, check_stop_strings, detokenize_incrementally,
                                       init_offsets)
from kvgate.engine.output_stream import merge_delta
from kvgate.engine.sequence import Request, Sequence

MULTI = "naïve café 日本語 🙂 ok"
REPLACEMENT = "\ufffd"


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with one_thread():
        yield


@pytest.fixture(scope="module")
def llm(tiny_llama: str) -> LLM:
    return LLM(tiny_llama, kv_cache_memory_bytes=1 << 24)


@pytest.fixture(scope="module")
def tok(llm: LLM):
    return llm.get_tokenizer()


class WithoutByteTable:
    """The same tokenizer, seen without its Rust backend: detokenized the other way (context decodes)."""
    _tokenizer = None

    def __init__(self, tok) -> None:
        self._tok = tok

    def __getattr__(self, name: str):
        return getattr(self._tok, name)


@pytest.fixture(params=["byte table", "context decodes"])
def any_tok(request, tok):
    """The tiny tokenizer (byte-level BPE) through each of the detokenizer's two ways."""
    if request.param == "byte table":
        assert byte_table(tok) is not None
        return tok
    other = WithoutByteTable(tok)
    assert byte_table(other) is None
    return other


# ---- helpers -----------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def byte_to_char() -> dict[int, str]:
    """GPT-2's byte -> printable character map that byte-level BPE vocabularies use for single bytes."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def byte_token_ids(tok, text: str) -> list[int]:
    """One token per UTF-8 byte of text: every multi-byte character is split across tokens."""
    ids = tok.convert_tokens_to_ids([byte_to_char()[b] for b in text.encode()])
    assert all(isinstance(i, int) and i >= 3 for i in ids), ids
    assert tok.decode(ids) == text
    return ids


def new_seq(prompt_ids: list[int], **sp) -> Sequence:
    req = Request("r", None, list(prompt_ids), SamplingParams(**sp))
    seq = Sequence(req, 0, list(prompt_ids))
    init_offsets(seq)
    req.seqs.append(seq)
    return seq


def stream(tok, seq: Sequence, output_ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    """Feed output ids one by one, as the engine does; the delta of each."""
    deltas = []
    for t in output_ids:
        seq.token_ids.append(t)
        deltas.append(detokenize_incrementally(tok, seq, skip_special_tokens))
    return deltas


def expected_text(tok, output_ids: list[int], skip_special_tokens: bool = True) -> str:
    """The full decode of the output, less a trailing incomplete (or invalid) character, which is never sent."""
    return tok.decode(output_ids, skip_special_tokens=skip_special_tokens).rstrip(REPLACEMENT)


def assert_clean_stream(deltas: list[str], final: str) -> None:
    """The deltas add up to final; no delta ends inside a character; a replacement character only where the full
    decode has one."""
    assert "".join(deltas) == final
    sent = ""
    for d in deltas:
        sent += d
        assert final.startswith(sent)
        assert not d.endswith(REPLACEMENT), f"a delta ends in a broken character: {d!r}"
    if REPLACEMENT not in final:
        assert all(REPLACEMENT not in d for d in deltas)


Requests = list[tuple[str, list[int], SamplingParams]]


def collect(engine: LLMEngine, requests: Requests) -> dict[str, list[RequestOutput]]:
    for rid, prompt, sp in requests:
        engine.add_request(rid, prompt, sp)
    got: dict[str, list[RequestOutput]] = {rid: [] for rid, _, _ in requests}
    while engine.has_unfinished_requests():
        for o in engine.step():
            got[o.request_id].append(o)
    return got


# ---- detokenize_incrementally ------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt_text", ["Say: ", "A", "The capital of Japan is 日本語 and", "🙂 "])
def test_multibyte_text_token_by_token(any_tok, prompt_text: str) -> None:
    prompt = any_tok.encode(prompt_text)
    ids = any_tok.encode(MULTI)
    assert any_tok.decode(ids) == MULTI
    seq = new_seq(prompt)
    deltas = stream(any_tok, seq, ids)
    assert_clean_stream(deltas, MULTI)
    assert seq.text == MULTI
    # with one token per byte every multi-byte character is split: the detokenizer must wait for its last byte
    seq = new_seq(prompt)
    byte_ids = byte_token_ids(any_tok, MULTI)
    deltas = stream(any_tok, seq, byte_ids)
    assert_clean_stream(deltas, MULTI)
    assert seq.text == MULTI
    assert deltas.count("") == len(MULTI.encode()) - len(MULTI), "no text until a character is complete"
    assert [d for d in deltas if d] == list(MULTI), "each character comes whole, once"


def test_mixed_tokens_and_special_tokens(any_tok) -> None:
    text_ids = any_tok.encode("Hello 🙂 world")
    bytes_ids = byte_token_ids(any_tok, " 日本")
    end_id = any_tok.convert_tokens_to_ids("<|im_end|>")
    out = text_ids + [end_id] + bytes_ids[:2] + [any_tok.convert_tokens_to_ids("<|endoftext|>")] + bytes_ids[2:] \
        + any_tok.encode(" ok")
    seq = new_seq(any_tok.encode("Q: "))
    deltas = stream(any_tok, seq, out, skip_special_tokens=True)
    assert_clean_stream(deltas, any_tok.decode(out, skip_special_tokens=True))
    assert seq.text == "Hello 🙂 world 日本 ok"
    seq = new_seq(any_tok.encode("Q: "))
    deltas = stream(any_tok, seq, out, skip_special_tokens=False)
    assert seq.text == any_tok.decode(out, skip_special_tokens=False)
    assert "<|im_end|>" in seq.text
    # a special token that falls inside a split character does not break it
    assert "".join(deltas) == seq.text


def test_random_token_streams_match_the_full_decode(any_tok) -> None:
    """Random ids include lone bytes that form broken or partial characters; the stream equals the decode."""
    rng = random.Random(0)
    byte_ids = byte_token_ids(any_tok, "é日🙂ü語")
    for trial in range(150):
        pool = list(range(3, VOCAB_SIZE)) if trial % 2 else byte_ids + rng.sample(range(3, VOCAB_SIZE), 20)
        out = [rng.choice(pool) for _ in range(rng.randint(1, 30))]
        seq = new_seq(any_tok.encode(rng.choice(["Hi", "Say this: ", "日本語: ", "a b c d e f g h"])))
        deltas = stream(any_tok, seq, out)
        assert_clean_stream(deltas, expected_text(any_tok, out))
        assert seq.text == expected_text(any_tok, out)


def test_the_byte_table_is_used_only_where_it_decodes_as_the_tokenizer(tok) -> None:
    """Byte-level BPE gets a table, checked against the tokenizer on every token and on random sequences; a
    tokenizer whose decoding differs (another decoder in the chain, or not byte-level at all) gets none."""
    from tokenizers import Tokenizer, decoders, models

    table = byte_table(tok)
    assert table is not None and byte_table(tok) is table  # built once
    rng = random.Random(1)
    for _ in range(200):
        ids = [rng.randrange(VOCAB_SIZE + 3) for _ in range(rng.randint(1, 20))]  # (a few past the vocabulary)
        for skip in (True, False):
            assert table.decode(ids, skip) == tok.decode(ids, skip_special_tokens=skip)
    changed = Tokenizer.from_str(tok._tokenizer.to_str())
    changed.decoder = decoders.Sequence([decoders.Replace("Ġ", "_"), decoders.ByteLevel()])  # spaces become "_"
    assert byte_table(WithBackend(tok, changed)) is None
    words = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    words.decoder = decoders.WordPiece()
    assert byte_table(WithBackend(tok, words)) is None


class WithBackend(WithoutByteTable):
    def __init__(self, tok, backend) -> None:
        super().__init__(tok)
        self._tokenizer = backend


# ---- streaming through the engine --------------------------------------------------------------------------------
def clean_prompts(tok, n: int, seed: int) -> list[list[int]]:
    """Random prompts whose text ends with a whole character (a character split between the prompt and the
    output belongs to neither, so the output text is then not comparable with decode(output ids))."""
    return [p for p in random_prompts(n, seed=seed, min_len=1, max_len=40)
            if not tok.decode(p).endswith(REPLACEMENT)]


def test_engine_delta_stream_equals_full_decode(llm: LLM, tok) -> None:
    prompts = clean_prompts(tok, 40, seed=13)
    texts = (MULTI, "日本語のテキストです。", "Hello 🙂 world!", "Привет, мир!")
    prompts += [tok.encode(t) for t in texts]
    requests = []
    for i, p in enumerate(prompts):
        sp = SamplingParams(temperature=0.0 if i % 4 == 0 else 1.0, seed=i, max_tokens=32, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
        requests.append((f"r{i}", p, sp))
    got = collect(llm.engine, requests)
    broken = 0
    for rid, _, _ in requests:
        outs = got[rid]
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
        ids = sum((o.outputs[0].token_ids for o in outs), [])
        assert len(ids) == 32
        assert_clean_stream([o.outputs[0].text for o in outs], expected_text(tok, ids))
        broken += REPLACEMENT in tok.decode(ids)
    assert broken > 0, "some random outputs should contain broken bytes, so that the stream is exercised"
    # the final text of a non-streamed request is the same
    final = llm.generate([p for _, p, _ in requests[:8]],
                         [SamplingParams(temperature=sp.temperature, seed=sp.seed, max_tokens=32, ignore_eos=True)
                          for _, _, sp in requests[:8]])
    for (rid, _, _), out in zip(requests[:8], final):
        assert out.outputs[0].text == "".join(o.outputs[0].text for o in got[rid])
    assert_engine_idle(llm)


def test_engine_cumulative_stream_never_shows_a_broken_character(llm: LLM, tok) -> None:
    prompts = clean_prompts(tok, 16, seed=29)
    got = collect(llm.engine, [(f"c{i}", p, SamplingParams(temperature=1.0, seed=100 + i, max_tokens=24,
                                                         ignore_eos=True)) for i, p in enumerate(prompts)])
    for outs in got.values():
        final = outs[-1].outputs[0]
        assert final.text == expected_text(tok, final.token_ids)
        for o in outs:
            assert final.text.startswith(o.outputs[0].text)
            assert not o.outputs[0].text.endswith(REPLACEMENT)
    assert_engine_idle(llm)


# ---- the API process's side (OutputDetokenizer) ------------------------------------------------------------------
@pytest.fixture(scope="module")
def eos_llm(llm: LLM, tok, tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[LLM, list[int]]:
    """The tiny Llama with a regular token as its EOS (one its greedy continuation of the returned prompt emits
    after a few tokens), so that the EOS has text that the output must leave out."""
    prompt = tok.encode("Hello 🙂 world!")
    ids = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=16,
                                                                      ignore_eos=True))[0].outputs[0].token_ids
    k = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i] and tok.decode([ids[i]]).strip())
    model = copy_with_eos(tiny_llama, tmp_path_factory.mktemp("eos") / "llama", ids[k])
    return LLM(model, kv_cache_memory_bytes=1 << 24), prompt


def joined(outs: list[RequestOutput]) -> dict[int, str]:
    """Each sample's text, the outputs' deltas joined."""
    texts: dict[int, str] = {}
    for o in outs:
        for c in o.outputs:
            texts[c.index] = texts.get(c.index, "") + c.text
    return texts


def test_the_api_process_makes_the_engines_text(eos_llm: tuple[LLM, list[int]], any_tok) -> None:
    """Requests sent with detokenize=False (as API processes that share a core send them) carry token ids only;
    OutputDetokenizer then makes from them exactly the outputs the engine makes when it detokenizes: every kind, n,
    logprobs, skip_special_tokens, broken characters, and a last token that ended the sample (EOS, a stop token)
    without its text, unless include_stop_str_in_output. Streamed outputs merged while unread (as a stream read late
    holds them) get the same text in all."""
    llm, prompt = eos_llm
    engine = llm.engine
    eos = engine.eos_token_ids[0]
    greedy = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=16))[0].outputs[0]
    assert greedy.finish_reason == "stop" and greedy.token_ids[-1] == eos and any_tok.decode([eos]).strip()
    stop_token = greedy.token_ids[1]
    delta, final, cumulative = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE
    kinds = [
        dict(temperature=0, max_tokens=16, output_kind=delta),  # stops on the EOS: its text left out
        dict(temperature=0, max_tokens=16, output_kind=delta, include_stop_str_in_output=True),  # ... kept
        dict(temperature=0, max_tokens=16, ignore_eos=True, output_kind=cumulative),  # EOS text in the middle
        dict(temperature=0, max_tokens=16, stop_token_ids=[stop_token], output_kind=final),
        dict(temperature=0, max_tokens=16, stop_token_ids=[stop_token], include_stop_str_in_output=True),
        dict(n=2, temperature=1.0, seed=7, max_tokens=24, ignore_eos=True, skip_special_tokens=False,
             output_kind=delta),
        dict(temperature=1.0, seed=9, max_tokens=12, ignore_eos=True, logprobs=2, output_kind=cumulative),
    ]
    requests = [(f"k{i}", {"prompt_token_ids": prompt}, SamplingParams(**kw)) for i, kw in enumerate(kinds)]
    requests += [(f"r{i}", p, SamplingParams(temperature=1.0, seed=i, max_tokens=24, ignore_eos=True,
                                             output_kind=delta)) for i, p in enumerate(clean_prompts(any_tok, 12, 5))]
    engine.tokenizer = any_tok
    try:
        want = collect(engine, requests)
        got = collect(engine, [(rid, p, dataclasses.replace(sp, detokenize=False)) for rid, p, sp in requests])
    finally:
        engine.tokenizer = llm.get_tokenizer()
    broken = 0
    for rid, p, sp in requests:
        ids = p["prompt_token_ids"] if isinstance(p, dict) else p
        if sp.output_kind is delta:  # read three at a time: one output holding three steps' tokens
            merged = [functools.reduce(merge_delta, got[rid][i:i + 3]) for i in range(0, len(got[rid]), 3)]
            merged = copy.deepcopy(merged)
            detok = OutputDetokenizer(any_tok, ids, sp, engine.eos_token_ids)
            for o in merged:
                detok.fill(o)
            assert len(merged) < len(got[rid]) and joined(merged) == joined(want[rid]), rid
        detok = OutputDetokenizer(any_tok, ids, sp, engine.eos_token_ids)
        for o in got[rid]:
            assert all(c.text == "" for c in o.outputs)  # the engine made no text
            detok.fill(o)
        assert [o.outputs for o in got[rid]] == [o.outputs for o in want[rid]], rid
        broken += any(REPLACEMENT in any_tok.decode(c.token_ids) for c in want[rid][-1].outputs)
    assert broken, "some outputs should hold broken characters"
    texts = {rid: "".join(c.text for o in want[rid] for c in o.outputs) for rid in ("k0", "k1")}
    assert texts["k1"] == texts["k0"] + any_tok.decode([eos]), "the EOS's text only with include_stop_str_in_output"
    with pytest.raises(ValueError, match="stop strings need detokenize=True"):
        SamplingParams(stop=["x"], detokenize=False)
    assert_engine_idle(llm)


# ---- check_stop_strings ------------------------------------------------------------------------------------------
def text_seq(text: str) -> Sequence:
    seq = new_seq([5, 6, 7])
    seq.text = text
    return seq


def test_stop_string_spanning_two_deltas() -> None:
    seq = text_seq("hello wo")
    assert check_stop_strings(seq, len("hello wo"), ["world"], False) is None
    assert seq.text == "hello wo"
    seq.text += "rld and more"
    assert check_stop_strings(seq, len("rld and more"), ["world"], False) == "world"
    assert seq.text == "hello "
    seq = text_seq("hello wo")
    seq.text += "rld and more"
    assert check_stop_strings(seq, len("rld and more"), ["world"], True) == "world"
    assert seq.text == "hello world"
    # spanning many small deltas, one character at a time
    seq = text_seq("")
    hit = None
    for ch in "abc STOP def":
        seq.text += ch
        hit = check_stop_strings(seq, 1, ["STOP"], False)
        if hit:
            break
    assert hit == "STOP" and seq.text == "abc "


def test_earliest_stop_string_wins() -> None:
    seq = text_seq("x")
    seq.text += " one END two STOP three"
    assert check_stop_strings(seq, len(" one END two STOP three"), ["STOP", "END"], False) == "END"
    assert seq.text == "x one "
    # a longer stop string that starts earlier wins over a shorter one that starts later
    seq = text_seq("")
    seq.text += "a xabc"
    assert check_stop_strings(seq, 6, ["abc", "xab"], True) == "xab"
    assert seq.text == "a xab"
    # two stop strings completed by the same delta, one of them begun in the text before it
    seq = text_seq("aaa <st")
    seq.text += "op> <e>"
    assert check_stop_strings(seq, len("op> <e>"), ["<e>", "<stop>"], False) == "<stop>"
    assert seq.text == "aaa "


def test_stop_string_edge_cases() -> None:
    seq = text_seq("nothing here")
    assert check_stop_strings(seq, 4, ["zzz"], False) is None and seq.text == "nothing here"
    assert check_stop_strings(seq, 0, ["here"], False) is None, "no new text, no new stop"
    assert check_stop_strings(seq, 4, [], False) is None
    seq = text_seq("STOP")
    assert check_stop_strings(seq, 4, ["STOP"], False) == "STOP" and seq.text == ""
    seq = text_seq("日本語🙂の")
    assert check_stop_strings(seq, 2, ["🙂"], False) == "🙂" and seq.text == "日本語"


# ---- stop strings through the engine -----------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def greedy_text(model_dir: str) -> tuple[list[int], list[int], str, list[int]]:
    """A prompt whose greedy continuation starts with 24+ clean characters: (prompt, ids, text, char offset at
    which each token's text ends)."""
    llm = LLM(model_dir, kv_cache_memory_bytes=1 << 22)
    tok = llm.get_tokenizer()
    for prompt in [tok.encode(t) for t in ("The cat reads a book", "What is the capital of France?",
                                             "Our team builds the code")] + random_prompts(30, seed=2):
        comp = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))[0].outputs[0]
        text = comp.text
        if REPLACEMENT in text[:30] or len(text) < 30:
            continue
        ends = [len(tok.decode(comp.token_ids[:k + 1])) for k in range(len(comp.token_ids))]
        return prompt, comp.token_ids, text, ends
    raise AssertionError("no prompt with a clean greedy continuation")


def pick_stop(text: str, ends: list[int], length: int, start: int = 5) -> tuple[int, str]:
    """(i, s): s = text[i:i+length], first occurring at i >= start, with a token boundary strictly inside it."""
    for i in range(start, 30 - length):
        s = text[i:i + length]
        if text.find(s) == i and any(i < e < i + length for e in ends) and s.strip():
            return i, s
    raise AssertionError("no suitable stop string")


def tokens_until(ids: list[int], ends: list[int], end_char: int) -> list[int]:
    """The output tokens up to the one whose text reaches end_char."""
    k = next(k for k, e in enumerate(ends) if e >= end_char)
    return ids[:k + 1]


def stop_sp(stop, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, stop=stop, **kw)


def test_stop_string_cuts_the_output(llm: LLM, tiny_llama: str) -> None:
    prompt, ids, text, ends = greedy_text(tiny_llama)
    i, s = pick_stop(text, ends, 4)
    comp = llm.generate([prompt], stop_sp([s]))[0].outputs[0]
    assert comp.text == text[:i], (comp.text, text, s)
    assert comp.finish_reason == "stop" and comp.stop_reason == s
    assert comp.token_ids == tokens_until(ids, ends, i + len(s)), "generation stops at the token completing s"
    comp = llm.generate([prompt], stop_sp(s, include_stop_str_in_output=True))[0].outputs[0]
    assert comp.text == text[:i + len(s)] and comp.text.endswith(s)
    assert comp.finish_reason == "stop" and comp.stop_reason == s
    # the stop string beats max_tokens when both end the same token
    n = len(tokens_until(ids, ends, i + len(s)))
    comp = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, stop=[s]))[0]
    assert comp.outputs[0].finish_reason == "stop" and comp.outputs[0].text == text[:i]
    # a stop string at the very start of the output leaves no text
    comp = llm.generate([prompt], stop_sp([text[:3]]))[0].outputs[0]
    assert comp.text == "" and comp.finish_reason == "stop" and comp.stop_reason == text[:3]
    # a stop string that never appears changes nothing
    comp = llm.generate([prompt], stop_sp(["\x00never\x00"]))[0].outputs[0]
    assert comp.text == text and comp.token_ids == ids and comp.finish_reason == "length"
    assert_engine_idle(llm)


def test_earliest_of_several_stop_strings_wins(llm: LLM, tiny_llama: str) -> None:
    prompt, ids, text, ends = greedy_text(tiny_llama)
    i, s = pick_stop(text, ends, 3, start=4)
    j, late = pick_stop(text, ends, 5, start=i + 4)
    for stops in ([late, s], [s, late], [late, "\x00never-ever\x00", s]):
        comp = llm.generate([prompt], stop_sp(stops))[0].outputs[0]
        assert comp.text == text[:i] and comp.stop_reason == s, (stops, comp)
    comp = llm.generate([prompt], stop_sp([late]))[0].outputs[0]
    assert comp.text == text[:j] and comp.stop_reason == late
    assert_engine_idle(llm)


def test_stop_strings_only_match_the_output(llm: LLM, tiny_llama: str, tok) -> None:
    prompt, ids, text, ends = greedy_text(tiny_llama)
    prompt_text = tok.decode(prompt)
    s = next(prompt_text[a:a + 3] for a in range(len(prompt_text) - 3) if prompt_text[a:a + 3] not in text)
    comp = llm.generate([prompt], stop_sp([s]))[0].outputs[0]
    assert comp.text == text and comp.finish_reason == "length", "a stop string in the prompt does not stop"
    assert_engine_idle(llm)


@pytest.mark.parametrize("include", [False, True])
def test_delta_stream_never_leaks_a_stop_string(llm: LLM, tiny_llama: str, include: bool) -> None:
    prompt, ids, text, ends = greedy_text(tiny_llama)
    i, s = pick_stop(text, ends, 5, start=8)
    final_text = text[:i + len(s)] if include else text[:i]
    for stops in ([s], [s, "\x00a-much-longer-stop-string\x00"], [s[:-1] + "\x00", s]):
        sp = stop_sp(stops, include_stop_str_in_output=include, output_kind=RequestOutputKind.DELTA)
        outs = collect(llm.engine, [("d", prompt, sp)])["d"]
        assert outs[-1].finished and all(not o.finished for o in outs[:-1])
        deltas = [o.outputs[0].text for o in outs]
        assert "".join(deltas) == final_text, (stops, deltas)
        sent = ""
        for d in deltas[:-1]:
            sent += d
            assert final_text.startswith(sent), f"a delta leaked text past the stop point: {deltas}"
            assert not include or s not in sent
        assert sum((o.outputs[0].token_ids for o in outs), []) == tokens_until(ids, ends, i + len(s))
        assert outs[-1].outputs[0].finish_reason == "stop" and outs[-1].outputs[0].stop_reason == s
        # cumulative streaming holds back the same way
        sp = stop_sp(stops, include_stop_str_in_output=include)
        outs = collect(llm.engine, [("c", prompt, sp)])["c"]
        assert outs[-1].outputs[0].text == final_text
        assert all(final_text.startswith(o.outputs[0].text) for o in outs)
    assert_engine_idle(llm)


def test_stop_strings_per_sample_with_n(llm: LLM, tok) -> None:
    """n seeded samples each stop at their own first occurrence of a stop string, streamed or not."""
    prompt = tok.encode("The cat reads a book")
    base = dict(n=4, temperature=1.0, top_k=8, seed=17, max_tokens=24, ignore_eos=True)
    free = llm.generate([prompt], SamplingParams(**base))[0].outputs
    texts = [c.text for c in free]
    # a 2-character stop string found in the first sample (after its start), made of printable characters
    stop = next(texts[0][a:a + 2] for a in range(3, len(texts[0]) - 2)
                if texts[0][a:a + 2].isprintable() and REPLACEMENT not in texts[0][a:a + 2]
                and texts[0].find(texts[0][a:a + 2]) == a)
    want = [t[:t.find(stop)] if stop in t else t for t in texts]
    cut = llm.generate([prompt], SamplingParams(**base, stop=[stop]))[0].outputs
    assert [c.text for c in cut] == want
    assert [c.finish_reason for c in cut] == ["stop" if stop in t else "length" for t in texts]
    assert all(c.token_ids == f.token_ids[:len(c.token_ids)] for c, f in zip(cut, free))
    outs = collect(llm.engine, [("n", prompt, SamplingParams(**base, stop=[stop],
                                                             output_kind=RequestOutputKind.DELTA))])["n"]
    for j in range(4):
        deltas = [o.outputs[j].text for o in outs]
        assert "".join(deltas) == want[j]
        sent = ""
        for d in deltas:
            sent += d
            assert want[j].startswith(sent)
    assert_engine_idle(llm)


def test_held_back_text_is_flushed_at_the_end(llm: LLM, tiny_llama: str) -> None:
    """Text held back because it might begin a stop string is sent when the request ends another way."""
    prompt, ids, text, ends = greedy_text(tiny_llama)
    last = text[-2:]
    for stops in ([last + "\x00"], ["\x00" * 20], [text[:2] + "\x00"]):
        sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, stop=stops,
                            output_kind=RequestOutputKind.DELTA)
        outs = collect(llm.engine, [("h", prompt, sp)])["h"]
        assert "".join(o.outputs[0].text for o in outs) == text
        assert outs[-1].outputs[0].finish_reason == "length"
    # aborted: everything generated so far is sent, with finish_reason "abort"
    engine = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, stop=["\x00" * 20],
                        output_kind=RequestOutputKind.DELTA)
    engine.add_request("ab", prompt, sp)
    sent = ""
    for _ in range(8):
        sent += "".join(o.outputs[0].text for o in engine.step())
    (out,) = engine.abort_request("ab")
    sent += out.outputs[0].text
    assert out.outputs[0].finish_reason == "abort"
    assert sent == text[:ends[7]] and len(sent) > 0
    assert_engine_idle(llm)


def test_stop_string_before_min_tokens_is_ignored(llm: LLM, tiny_llama: str) -> None:
    prompt, ids, text, ends = greedy_text(tiny_llama)
    i, s = pick_stop(text, ends, 3)
    k = len(tokens_until(ids, ends, i + len(s)))
    assert k >= 2
    comp = llm.generate([prompt], stop_sp([s], min_tokens=k + 2))[0].outputs[0]
    assert len(comp.token_ids) >= k + 2
    assert comp.text.startswith(text[:i + len(s)]), "the early stop string is part of the text"
    assert comp.token_ids == ids[:len(comp.token_ids)]
    comp = llm.generate([prompt], stop_sp([s], min_tokens=k - 1))[0].outputs[0]
    assert comp.text == text[:i] and len(comp.token_ids) == k, "min_tokens reached: the stop string counts"
    assert_engine_idle(llm)
