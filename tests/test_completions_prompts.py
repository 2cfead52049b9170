"""Several prompts in one /v1/completions request, through a real gateway (uvicorn on loopback): they enter the
engine together (one step for all, read from the engine's step count), streamed or not; their outputs equal the
one-by-one outputs; choices are numbered prompt index * n + sample index; the client going away aborts every one;
no KV block is left behind. Also RequestGroup's contract on its own."""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Iterator

import httpx
import pytest
from mock_upstream import serving_engines

from kvgate.engine.async_engine import AsyncEngineArgs, AsyncLLMEngine
from kvgate.gateway.request_group import RequestGroup

GEN, BATCHED = "gen", "batched"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def gateway(tiny_llama: str) -> Iterator[tuple[str, dict]]:
    """A generative model (4 seats), and the same model as "batched": prefills held up to 1 s unless its 4 seats
    fill, so prompts that arrive together run in one step."""
    common = dict(model=tiny_llama, max_num_seqs=4, num_gpu_blocks_override=64)
    engines = {GEN: AsyncLLMEngine.from_engine_args(AsyncEngineArgs(**common)),
               BATCHED: AsyncLLMEngine.from_engine_args(AsyncEngineArgs(**common, scheduler_delay=1.0))}
    with serving_engines(engines) as base:
        yield base, engines


def send(base: str, body: dict, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(base + COMPLETIONS, json=body, headers=headers, timeout=60)


def in_core(engine: AsyncLLMEngine, fn: Any) -> Any:
    async def main() -> Any:
        return await engine.call(fn)
    return asyncio.run(main())


def steps(core) -> int:
    return core.num_steps


def idle(core) -> tuple[list[str], bool]:
    return list(core.requests), core.block_manager.num_free_blocks == core.block_manager.num_blocks


PROMPTS = ["The cat reads", "A small dog", "My friend likes", "The engineer builds"]
GREEDY = {"max_tokens": 5, "temperature": 0, "ignore_eos": True}


def sse_events(r: httpx.Response) -> list[dict]:
    events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_the_prompts_of_one_request_run_in_one_step_and_equal_one_by_one(gateway) -> None:
    """"batched" holds prefills up to 1 s unless its 4 seats fill: the 4 prompts of one request arrive together,
    so 5 tokens each take 5 steps in all (one prefill, 4 decodes); one after another they would take 20."""
    base, engine = gateway[0], gateway[1][BATCHED]
    alone = [send(base, {"model": BATCHED, "prompt": p, **GREEDY}, {"X-Max-Batch-Delay-Ms": "0"}
                  ).json()["choices"][0]["text"] for p in PROMPTS]
    for stream in (False, True):
        before = in_core(engine, steps)
        r = send(base, {"model": BATCHED, "prompt": PROMPTS, "stream": stream,
                        "stream_options": {"include_usage": True} if stream else None, **GREEDY})
        assert r.status_code == 200, r.text
        assert in_core(engine, steps) - before == 5, stream
        if not stream:
            body = r.json()
            assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
            assert [c["text"] for c in body["choices"]] == alone and body["usage"]["completion_tokens"] == 20
            continue
        events = sse_events(r)
        texts = ["", "", "", ""]
        for e in events:
            for c in e["choices"]:
                texts[c["index"]] += c["text"]
        assert texts == alone and events[-1]["usage"]["completion_tokens"] == 20
        assert events[-1]["usage"]["prompt_tokens"] == sum(len(engine.tokenizer.encode(p)) for p in PROMPTS)


def test_streamed_prompts_with_n_samples_are_indexed_like_openai(gateway) -> None:
    base = gateway[0]
    body = {"model": GEN, "prompt": PROMPTS[:3], "n": 2, **GREEDY}
    full = send(base, body).json()["choices"]
    assert [c["index"] for c in full] == list(range(6))
    texts, finish = [""] * 6, [None] * 6
    for e in sse_events(send(base, {**body, "echo": True, "logprobs": 1, "stream": True})):
        for c in e["choices"]:
            texts[c["index"]] += c["text"]
            finish[c["index"]] = c["finish_reason"] or finish[c["index"]]
            assert c["logprobs"] is None or len(c["logprobs"]["tokens"]) == len(c["logprobs"]["token_logprobs"])
    assert texts == [PROMPTS[i // 2] + c["text"] for i, c in enumerate(full)]  # echo: the prompt once, first
    assert finish == ["length"] * 6


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_gone_aborts_every_prompt(gateway, stream: bool) -> None:
    base, engine = gateway[0], gateway[1][GEN]
    body = {"model": GEN, "prompt": PROMPTS, "max_tokens": 400, "ignore_eos": True, "stream": stream}
    if stream:
        with httpx.stream("POST", base + COMPLETIONS, json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(lines)
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(base + COMPLETIONS, json=body, timeout=0.5)
    deadline = time.time() + 10
    while time.time() < deadline and (engine.num_requests or in_core(engine, idle) != ([], True)):
        time.sleep(0.05)
    assert engine.num_requests == 0 and in_core(engine, idle) == ([], True)


def test_the_first_failure_of_a_group_aborts_the_rest() -> None:
    closed: list[int] = []

    async def good(i: int):
        try:
            yield i
            await asyncio.sleep(30)
            yield -1
        finally:
            closed.append(i)

    async def bad():
        yield 2
        raise ValueError("refused")

    async def main() -> list[int]:
        group = RequestGroup([good(0), good(1), bad()])
        try:
            assert sorted(await group.started()) == [0, 1, 2]
            with pytest.raises(ValueError, match="refused"):
                async for _ in group:
                    pass
        finally:
            await group.aclose()
        return sorted(closed)

    assert asyncio.run(main()) == [0, 1]


def test_no_kv_block_is_left_behind(gateway) -> None:
    for name, engine in gateway[1].items():
        deadline = time.time() + 10
        while time.time() < deadline and in_core(engine, idle) != ([], True):
            time.sleep(0.05)
        assert engine.num_requests == 0 and in_core(engine, idle) == ([], True), name
