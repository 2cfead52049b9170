"""stream_interval (vLLM's --stream-interval): a streamed (DELTA) request's outputs gather that many tokens; the
first token and the end go at once, an abort carries what was held back, and the tokens, text and logprobs
streamed are exactly those of stream_interval 1. Other output kinds are unchanged."""
from __future__ import annotations

import pytest
from sampling_helpers import PROMPTS, run_engine
from tiny_models import assert_engine_idle

from kvgate.engine import LLM, RequestOutputKind, SamplingParams
from kvgate.engine.arg_utils import ArgError, EngineArgs

DELTA = RequestOutputKind.DELTA


def requests() -> list[tuple[str, list[int], SamplingParams]]:
    return [("greedy", PROMPTS[0], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, output_kind=DELTA)),
            ("n2", PROMPTS[1], SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=7, ignore_eos=True, logprobs=1,
                                              output_kind=DELTA)),
            ("final", PROMPTS[2], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                                                 output_kind=RequestOutputKind.FINAL_ONLY)),
            ("cumulative", PROMPTS[2], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))]


def streamed(outputs, i: int = 0) -> tuple[list[int], str, list]:
    return (sum((o.outputs[i].token_ids for o in outputs), []), "".join(o.outputs[i].text for o in outputs),
            sum((o.outputs[i].logprobs or [] for o in outputs), []))


@pytest.fixture(scope="module")
def engines(tiny_llama: str) -> dict[int, LLM]:
    return {k: LLM(tiny_llama, dtype="float32", seed=0, stream_interval=k) for k in (1, 4)}


def test_outputs_gather_stream_interval_tokens_and_lose_nothing(engines: dict[int, LLM]) -> None:
    one, four = (run_engine(engines[k].engine, requests()) for k in (1, 4))
    assert [len(o.outputs[0].token_ids) for o in one["greedy"]] == [1] * 10
    assert [len(o.outputs[0].token_ids) for o in four["greedy"]] == [1, 4, 4, 1]  # the first at once, the end too
    assert [len(o.outputs[0].token_ids) for o in four["n2"]] == [1, 4, 2]
    assert [o.finished for o in four["greedy"]] == [False, False, False, True]
    for rid, n in (("greedy", 1), ("n2", 2)):
        for i in range(n):
            assert streamed(four[rid], i) == streamed(one[rid], i)
            assert four[rid][-1].outputs[i].finish_reason == "length"
    assert len(four["final"]) == 1 and four["final"][0].outputs[0].token_ids == one["final"][0].outputs[0].token_ids
    assert len(four["cumulative"]) == 5  # only DELTA outputs gather (as in vLLM)
    assert_engine_idle(engines[4])


def test_an_abort_carries_the_tokens_held_back(engines: dict[int, LLM]) -> None:
    engine = engines[4].engine
    engine.add_request("a", PROMPTS[3], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True,
                                                       output_kind=DELTA))
    sent: list[int] = []
    for _ in range(3):  # the first token, then two held
        for o in engine.step():
            sent += o.outputs[0].token_ids
    assert len(sent) == 1
    (last,) = engine.abort_request("a")
    assert last.finished and last.outputs[0].finish_reason == "abort" and len(last.outputs[0].token_ids) == 2
    assert_engine_idle(engines[4])


def test_stream_interval_below_one_is_refused() -> None:
    with pytest.raises(ArgError, match="stream_interval must be >= 1"):
        EngineArgs(stream_interval=0).check()
