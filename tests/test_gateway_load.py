"""The gateway under concurrent load, through a real uvicorn on loopback and the real openai.AsyncOpenAI client:
64 concurrent streams, a client that disconnects mid-stream, a client that stops reading, and the latency
histograms in /metrics moving with the traffic."""
from __future__ import annotations

import asyncio
import re

import httpx
import openai
import pytest
from test_gateway import MODEL, running

from kvgate.engine.async_engine import AsyncEngineArgs, AsyncLLMEngine

HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds")
NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
SAMPLE = re.compile(rf'^({NAME})(?:\{{((?:[a-zA-Z_]+="[^"]*",?)*)\}})? (\S+)$')


@pytest.fixture(scope="module")
def server(tiny_model_dirs: dict[str, str]):
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=tiny_model_dirs["llama"], max_num_seqs=16,
                                                             num_gpu_blocks_override=256))
    with running(engine) as base:
        yield base, engine


def client(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Client {i} asks: what is {i} plus {i}?"}]


async def streamed_chat(c: openai.AsyncOpenAI, i: int, max_tokens: int = 8) -> str:
    stream = await c.chat.completions.create(model=MODEL, messages=messages(i), max_tokens=max_tokens, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    return "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])


async def full_chat(c: openai.AsyncOpenAI, i: int, max_tokens: int = 8) -> str:
    r = await c.chat.completions.create(model=MODEL, messages=messages(i), max_tokens=max_tokens, temperature=0,
                                        extra_body={"ignore_eos": True})
    return r.choices[0].message.content


def scrape(base: str) -> dict[str, float]:
    """Every sample of /metrics by `name{labels}`; fails on a line that is not Prometheus text format."""
    samples: dict[str, float] = {}
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith("#"):
            assert re.match(rf"^# (HELP|TYPE) {NAME} ", line), line
            continue
        m = SAMPLE.match(line)
        assert m is not None, line
        samples[f"{m[1]}{{{m[2] or ''}}}"] = float(m[3])
    return samples


async def no_requests_left(engine: AsyncLLMEngine) -> tuple[int, int]:
    """Waits until the engine holds no request; returns (free blocks, all blocks), read on the engine thread."""
    while await engine.call(lambda e: bool(e.requests)):
        await asyncio.sleep(0.02)
    return await engine.call(lambda e: (e.block_manager.num_free_blocks, e.block_manager.num_blocks))


def test_64_concurrent_streams_equal_greedy_outputs_and_move_the_histograms(server) -> None:
    base, engine = server
    before = scrape(base)

    async def main() -> tuple[list[str], list[str]]:
        c = client(base)
        texts = await asyncio.gather(*(streamed_chat(c, i) for i in range(64)))
        return texts, await asyncio.gather(*(full_chat(c, i) for i in range(64)))

    texts, full = asyncio.run(main())
    assert texts == full and len(set(texts)) > 1
    after = scrape(base)
    label = f'model_name="{MODEL}"'
    moved = {k: after[k] - before.get(k, 0.0) for k in after}
    for name in HISTOGRAMS:
        buckets = [(k, v) for k, v in after.items() if k.startswith(f"{name}_bucket{{")]
        assert len(buckets) > 10 and buckets[-1][0] == f'{name}_bucket{{le="+Inf",{label}}}'
        counts = [v for _, v in buckets]
        assert counts == sorted(counts) and counts[-1] == after[f"{name}_count{{{label}}}"]  # cumulative
    assert moved[f"vllm:time_to_first_token_seconds_count{{{label}}}"] == 128
    assert moved[f"vllm:inter_token_latency_seconds_count{{{label}}}"] == 128 * 7  # each later token
    assert moved[f"vllm:e2e_request_latency_seconds_count{{{label}}}"] == 128
    assert moved[f"vllm:request_queue_time_seconds_count{{{label}}}"] == 128
    assert moved[f"vllm:e2e_request_latency_seconds_sum{{{label}}}"] > 0
    assert moved[f'vllm:request_success_total{{finished_reason="length",{label}}}'] == 128
    assert moved[f"vllm:generation_tokens_total{{{label}}}"] == 128 * 8
    assert after[f"vllm:num_requests_running{{{label}}}"] == 0


def test_client_disconnect_mid_stream_aborts_and_frees_every_block(server) -> None:
    base, engine = server
    before = scrape(base)

    async def main() -> tuple[list[str], tuple[int, int]]:
        c = client(base)
        others = [asyncio.create_task(streamed_chat(c, i, max_tokens=16)) for i in range(4)]
        stream = await c.completions.create(model=MODEL, prompt="tell me a long story", max_tokens=480,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True})
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 3:
                break
        await stream.close()  # the client goes away mid-stream
        texts = await asyncio.gather(*others)
        return texts, await asyncio.wait_for(no_requests_left(engine), timeout=120)

    texts, (free, total) = asyncio.run(main())
    assert all(texts) and free == total
    after = scrape(base)
    label = f'model_name="{MODEL}"'
    assert after[f'vllm:request_success_total{{finished_reason="abort",{label}}}'] \
        - before[f'vllm:request_success_total{{finished_reason="abort",{label}}}'] == 1
    assert after[f'vllm:request_success_total{{finished_reason="length",{label}}}'] \
        - before[f'vllm:request_success_total{{finished_reason="length",{label}}}'] == 4


def test_a_client_that_stops_reading_stalls_nobody(server) -> None:
    base, engine = server

    async def main() -> tuple[list[str], list[str], str, str]:
        c = client(base)
        # a big stream (top-20 logprobs with every token) whose reader stops after the first chunk
        slow = await c.chat.completions.create(model=MODEL, messages=messages(99), max_tokens=200, temperature=0,
                                               stream=True, logprobs=True, top_logprobs=20,
                                               extra_body={"ignore_eos": True})
        head = await slow.__anext__()
        refs = asyncio.gather(full_chat(c, 99, max_tokens=200), *(full_chat(c, i, max_tokens=12) for i in range(8)))
        # while it is stalled, eight other clients run to completion (a hang here fails the test)...
        texts = await asyncio.wait_for(asyncio.gather(*(streamed_chat(c, i, max_tokens=12) for i in range(8))),
                                       timeout=120)
        # ...and the engine finishes the unread request too: its outputs wait in the gateway, not in the engine
        await asyncio.wait_for(no_requests_left(engine), timeout=120)
        rest = [ch async for ch in slow]  # only now does the slow client read on
        slow_text = "".join(ch.choices[0].delta.content or "" for ch in [head, *rest] if ch.choices)
        slow_ref, *other_refs = await refs
        return texts, other_refs, slow_text, slow_ref

    texts, refs, slow_text, slow_ref = asyncio.run(main())
    assert texts == refs  # the others finished, correctly, while the slow reader held its stream open
    assert slow_text == slow_ref  # and the slow reader lost nothing
