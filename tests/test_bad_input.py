"""Bad input: each raises a clear error (naming the value and the limit) and the engine keeps serving,
with no leaked KV blocks and no leftover request."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvgate.engine.llm import LLM
from kvgate.engine.sampling_params import SamplingParams
from tiny_models import assert_engine_idle, hf_greedy

MAX_MODEL_LEN = 64
GOOD = [100, 200, 300, 400, 500, 150, 250]  # its greedy continuation has no near-ties (top-2 gap > 0.1)


def greedy(max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_llama: str) -> str:
    return tiny_llama


@pytest.fixture(scope="module")
def llm(model: str) -> LLM:
    return LLM(model, max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=16, max_num_seqs=4)


@pytest.fixture(scope="module")
def expected(llm: LLM) -> list[int]:
    """The greedy continuation of GOOD on a fresh engine (the same as transformers')."""
    out = llm.generate([GOOD], greedy())[0]
    assert out.outputs[0].token_ids == hf_greedy(llm.engine.config.model_path, [GOOD], 6)[0]
    return out.outputs[0].token_ids


def assert_still_serves(llm: LLM, expected: list[int]) -> None:
    assert_engine_idle(llm)
    outs = llm.generate([GOOD, GOOD[:3]], greedy())
    assert outs[0].outputs[0].token_ids == expected
    assert outs[0].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 6
    assert_engine_idle(llm)


# ---- prompts -----------------------------------------------------------------------------------------------------
def test_prompt_longer_than_max_model_len(llm: LLM, expected: list[int]) -> None:
    assert llm.engine.max_model_len == MAX_MODEL_LEN
    for n in (MAX_MODEL_LEN, MAX_MODEL_LEN + 37):
        with pytest.raises(ValueError) as e:
            llm.generate([GOOD, [7] * n], greedy())  # the good prompt of the batch is rolled back
        msg = str(e.value)
        assert f"{n} tokens" in msg and str(MAX_MODEL_LEN) in msg, msg
        assert "context length" in msg, msg
        assert_still_serves(llm, expected)
    # the longest allowed prompt leaves room for exactly one output token
    out = llm.generate([[7] * (MAX_MODEL_LEN - 1)], greedy(5))[0]
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"
    assert_still_serves(llm, expected)


def test_empty_prompt(llm: LLM, expected: list[int]) -> None:
    for bad in ([], ""):
        with pytest.raises(ValueError, match="empty"):
            llm.generate([GOOD, bad], greedy())
        assert_still_serves(llm, expected)
    with pytest.raises(ValueError, match="empty"):
        llm.engine.add_request("empty", {"prompt_token_ids": []}, greedy())
    assert_still_serves(llm, expected)


@pytest.mark.parametrize("bad_id", [512, 100_000, -1])
def test_out_of_vocab_token_id(llm: LLM, expected: list[int], bad_id: int) -> None:
    with pytest.raises(ValueError) as e:
        llm.generate([GOOD, [5, 6, bad_id, 7]], greedy())
    msg = str(e.value)
    assert str(bad_id) in msg and "512" in msg, msg  # the id and the vocabulary size
    assert_still_serves(llm, expected)


def test_prompt_of_wrong_type(llm: LLM, expected: list[int]) -> None:
    for bad in ([1.5, 2.0], [True, False], {"nothing": 1}, 42):
        with pytest.raises(ValueError, match="prompt"):
            llm.engine.add_request("weird", bad, greedy())
        assert_still_serves(llm, expected)


# ---- sampling parameters -------------------------------------------------------------------------------------------
BAD_SAMPLING = [
    ({"max_tokens": 0}, ["max_tokens", ">= 1", "0"]),
    ({"max_tokens": -3}, ["max_tokens", ">= 1", "-3"]),
    ({"top_p": 0.0}, ["top_p", "(0, 1]", "0.0"]),
    ({"top_p": 1.5}, ["top_p", "(0, 1]", "1.5"]),
    ({"top_p": -0.2}, ["top_p", "(0, 1]", "-0.2"]),
    ({"top_k": -2}, ["top_k", "-1", "-2"]),
    ({"temperature": -0.5}, ["temperature", ">= 0", "-0.5"]),
    ({"temperature": float("nan")}, ["temperature", "nan"]),  # NaN passes `< 0` checks; it samples token 0
    ({"n": 0}, ["n must be", "0"]),
    ({"min_p": 1.5}, ["min_p", "1.5"]),
    ({"min_tokens": 5, "max_tokens": 2}, ["min_tokens", "5", "2"]),
    ({"repetition_penalty": 0.0}, ["repetition_penalty", "(0, 2]"]),
    ({"presence_penalty": 3.0}, ["presence_penalty", "[-2, 2]"]),
    ({"logprobs": 99}, ["logprobs", "99"]),
    ({"stop_token_ids": [-4]}, ["stop_token_ids", "-4"]),
]


@pytest.mark.parametrize("kwargs, words", BAD_SAMPLING,
                         ids=["-".join(f"{k}={v}" for k, v in kw.items()) for kw, _ in BAD_SAMPLING])
def test_bad_sampling_params(llm: LLM, expected: list[int], kwargs: dict, words: list[str]) -> None:
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    msg = str(e.value)
    assert all(w in msg for w in words), msg
    assert_still_serves(llm, expected)


def test_good_edge_sampling_params_are_accepted(llm: LLM) -> None:
    SamplingParams(top_p=1.0, top_k=-1, temperature=0.0, max_tokens=1)
    sp = SamplingParams(top_k=-1)
    assert sp.top_k == 0  # -1 means disabled, as in vLLM
    out = llm.generate([GOOD], SamplingParams(temperature=0, top_p=1e-9, max_tokens=1))[0]
    assert len(out.outputs[0].token_ids) == 1


def test_logprobs_over_the_engine_limit(llm: LLM, expected: list[int]) -> None:
    limit = llm.engine.config.args.max_logprobs
    sp = SamplingParams(logprobs=limit + 10, max_logprobs=limit + 20, max_tokens=2)
    with pytest.raises(ValueError) as e:
        llm.generate([GOOD, GOOD], [greedy(), sp])
    assert f"<= {limit}" in str(e.value) and str(limit + 10) in str(e.value)
    assert_still_serves(llm, expected)


# ---- request options ------------------------------------------------------------------------------------------------
def test_duplicate_request_id(llm: LLM, expected: list[int]) -> None:
    engine = llm.engine
    engine.add_request("dup", GOOD, greedy())
    with pytest.raises(ValueError) as e:
        engine.add_request("dup", [9, 9, 9], greedy())
    assert "'dup'" in str(e.value) and "already" in str(e.value)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    assert final.request_id == "dup"
    assert final.prompt_token_ids == GOOD and final.outputs[0].token_ids == expected
    # once finished, the id may be used again
    engine.add_request("dup", GOOD, greedy())
    engine.abort_request("dup")
    assert_still_serves(llm, expected)


@pytest.mark.parametrize("priority", [101, -1, 1000, 50.5, "high", True])
def test_bad_priority(llm: LLM, expected: list[int], priority) -> None:
    with pytest.raises(ValueError) as e:
        llm.engine.add_request("prio", GOOD, greedy(), priority=priority)
    msg = str(e.value)
    assert "priority" in msg and "[0, 100]" in msg and repr(priority) in msg, msg
    assert_still_serves(llm, expected)
    with pytest.raises(ValueError, match="priority"):
        llm.generate([GOOD, GOOD], greedy(), priority=[50, priority])
    assert_still_serves(llm, expected)


def test_priority_list_of_the_wrong_length(llm: LLM, expected: list[int]) -> None:
    with pytest.raises(ValueError) as e:
        llm.generate([GOOD, GOOD, GOOD], greedy(), priority=[90])
    assert "priorit" in str(e.value) and "3" in str(e.value), str(e.value)
    assert_still_serves(llm, expected)


def test_priority_bounds_are_accepted(llm: LLM) -> None:
    outs = llm.generate([GOOD, GOOD], greedy(2), priority=[0, 100])
    assert all(len(o.outputs[0].token_ids) == 2 for o in outs)
    assert_engine_idle(llm)


def test_negative_max_batch_delay(llm: LLM, expected: list[int]) -> None:
    with pytest.raises(ValueError, match="max_batch_delay.*-1"):
        llm.engine.add_request("delay", GOOD, greedy(), max_batch_delay=-1)
    assert_still_serves(llm, expected)


def test_a_failed_add_keeps_the_id_free_and_running_work_intact(llm: LLM, expected: list[int]) -> None:
    engine = llm.engine
    engine.add_request("busy", GOOD, greedy())
    engine.step()
    engine.step()
    with pytest.raises(ValueError):
        engine.add_request("x", [7] * MAX_MODEL_LEN, greedy())
    assert "x" not in engine.requests
    with pytest.raises(ValueError):
        engine.add_request("y", GOOD, greedy(), priority=101)
    assert "y" not in engine.requests
    engine.add_request("x", GOOD[:3], greedy(2))  # the id of a rejected request is free
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done["busy"].outputs[0].token_ids == expected
    assert len(done["x"].outputs[0].token_ids) == 2
    assert_still_serves(llm, expected)


def test_abort_of_unknown_request_is_harmless(llm: LLM, expected: list[int]) -> None:
    assert llm.engine.abort_request("never-added") == []
    assert llm.engine.abort_request(["a", "b"]) == []
    assert_still_serves(llm, expected)


def test_mismatched_sampling_params_list(llm: LLM, expected: list[int]) -> None:
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        llm.generate([GOOD, GOOD, GOOD], [greedy(), greedy()])
    assert_still_serves(llm, expected)


# ---- models ----------------------------------------------------------------------------------------------------------
def copy_model(model: str, dest: Path) -> Path:
    shutil.copytree(model, dest)
    return dest


def test_unknown_model_path(llm: LLM, expected: list[int]) -> None:
    with pytest.raises(FileNotFoundError) as e:
        LLM("no/such/dir")
    assert "no/such/dir" in str(e.value)
    with pytest.raises(FileNotFoundError):
        LLM("no/such/model.gguf")
    assert_still_serves(llm, expected)


def test_directory_without_weights(model: str, tmp_path: Path) -> None:
    d = copy_model(model, tmp_path / "noweights")
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(str(d))


@pytest.mark.parametrize("how", ["garbage", "truncated", "empty"])
def test_corrupt_safetensors(model: str, tmp_path: Path, llm: LLM, expected: list[int], how: str) -> None:
    d = copy_model(model, tmp_path / how)
    weights = d / "model.safetensors"
    data = weights.read_bytes()
    if how == "garbage":
        weights.write_bytes(b"this is not a safetensors file \x00\xff" * 100)
    elif how == "truncated":
        weights.write_bytes(data[: len(data) // 2])
    else:
        weights.write_bytes(b"")
    with pytest.raises(ValueError) as e:
        LLM(str(d))
    assert "model.safetensors" in str(e.value), str(e.value)
    assert_still_serves(llm, expected)
    # a fresh engine on the intact model still works
    fresh = LLM(model, max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=16)
    assert fresh.generate([GOOD], greedy())[0].outputs[0].token_ids == expected


def test_corrupt_gguf(tmp_path: Path, llm: LLM, expected: list[int]) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    with pytest.raises(ValueError) as e:
        LLM(str(bad))
    assert "broken.gguf" in str(e.value)
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match="broken.gguf"):
        LLM(str(bad))
    assert_still_serves(llm, expected)


def test_unsupported_architecture(model: str, tmp_path: Path, llm: LLM, expected: list[int]) -> None:
    d = copy_model(model, tmp_path / "gpt2")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as e:
        LLM(str(d))
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg, msg
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in msg, msg
    assert_still_serves(llm, expected)


def test_invalid_config_json(model: str, tmp_path: Path) -> None:
    d = copy_model(model, tmp_path / "badjson")
    (d / "config.json").write_text("{ not json")
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(d))


def test_unknown_attention_backend(model: str, llm: LLM, expected: list[int]) -> None:
    with pytest.raises(ValueError) as e:
        LLM(model, attention_backend="no-such-backend")
    msg = str(e.value)
    assert "no-such-backend" in msg and "torch" in msg, msg
    assert_still_serves(llm, expected)


@pytest.mark.parametrize("kwargs, words", [
    ({"block_size": 8}, ["block_size", "16, 32, 64", "8"]),
    ({"max_model_len": 10_000}, ["max_model_len", "512", "10000"]),
    ({"max_num_seqs": 0}, ["max_num_seqs", "0"]),
    ({"dtype": "float8"}, ["dtype", "float8"]),
    ({"load_format": "pickle"}, ["load_format", "pickle"]),
    ({"scheduler_delay": -1.0}, ["scheduler_delay", "-1"]),
    ({"enable_chunked_prefill": False, "max_num_batched_tokens": 32, "max_model_len": 64},
     ["max_num_batched_tokens", "32", "64"]),
])
def test_bad_engine_args(model: str, kwargs: dict, words: list[str]) -> None:
    with pytest.raises(ValueError) as e:
        LLM(model, **kwargs)
    msg = str(e.value)
    assert all(w in msg for w in words), msg
