"""The OpenAI-compatible gateway through a real uvicorn server on loopback and the real `openai` client."""
from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from typing import Any, Iterator

import httpx
import openai
import pytest
import uvicorn

from kvgate.engine.async_engine import AsyncEngineArgs, AsyncLLMEngine
from kvgate.gateway.app import create_app
from kvgate.gateway.serving import OpenAIServing

MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running(engine: AsyncLLMEngine, app: Any = None, **app_kwargs) -> Iterator[str]:
    """A real uvicorn server on a loopback port serving `engine` as MODEL (or `app`), once the engine is loaded."""
    app = app or create_app({MODEL: OpenAIServing(MODEL, engine)}, **app_kwargs)
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        asyncio.run(engine.wait_until_ready(timeout=60))
        while not srv.started:
            time.sleep(0.05)
        yield f"http://127.0.0.1:{srv.config.port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
        engine.shutdown()


@pytest.fixture(scope="module", params=["core-thread", "core-process"])
def server(request: pytest.FixtureRequest, tiny_model_dirs: dict[str, str]):
    """The same tests with the engine core on a thread (the CPU default) and in its own process (the CUDA one)."""
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
        model=tiny_model_dirs["qwen3"], max_num_seqs=16, num_gpu_blocks_override=128,
        engine_core_process=request.param == "core-process"))
    with running(engine) as base:
        yield base, engine


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)


MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is the capital of France?"}]


def test_chat_stream_equals_non_stream_and_usage_matches_tokenizer(client: openai.OpenAI, server) -> None:
    full = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=20, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    tok = server[1].tokenizer
    prompt_ids = tok.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert full.usage.prompt_tokens == len(prompt_ids) == chunks[-1].usage.prompt_tokens
    assert full.usage.completion_tokens == 20


def test_completions_prompts_echo_n_and_logprobs(client: openai.OpenAI) -> None:
    one = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=8, temperature=0)
    again = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=8, temperature=0, echo=True)
    assert again.choices[0].text == "The sky is" + one.choices[0].text
    many = client.completions.create(model=MODEL, prompt=["a b", "c d e"], max_tokens=4, temperature=0, n=2)
    assert len(many.choices) == 4 and [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.usage.completion_tokens == 16
    ids = client.completions.create(model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=3, temperature=0)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 5
    lp = client.completions.create(model=MODEL, prompt="hello", max_tokens=5, temperature=0, logprobs=3)
    assert len(lp.choices[0].logprobs.tokens) == 5
    # keyed by token text (OpenAI's format), so byte tokens that decode alike may share a key
    assert all(1 <= len(t) <= 3 for t in lp.choices[0].logprobs.top_logprobs)
    first = lp.choices[0].logprobs
    assert first.token_logprobs[0] == pytest.approx(max(first.top_logprobs[0].values()))  # greedy: the top token
    stream = list(client.completions.create(model=MODEL, prompt="The sky is", max_tokens=8, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in stream if c.choices) == one.choices[0].text


def test_chat_logprobs_stop_and_n(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 6 and all(len(c.top_logprobs) == 2 for c in content)
    assert content[0].logprob == max(t.logprob for t in content[0].top_logprobs)  # greedy: the top token
    text = r.choices[0].message.content
    stop = text[2:4]
    cut = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=6, temperature=0, stop=[stop])
    assert cut.choices[0].message.content == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"
    two = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=5, n=2, temperature=1.0, seed=3)
    assert [c.index for c in two.choices] == [0, 1]


def test_errors_have_openai_shape_and_status(client: openai.OpenAI, server) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSGS)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 512 tokens"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=100000)
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.chat.completions.create(model=MODEL, messages=MSGS, top_p=1.5)
    with pytest.raises(openai.BadRequestError, match="needs the model served with --enable-auto-tool-choice"):
        client.chat.completions.create(model=MODEL, messages=MSGS, tools=[{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {}}}}])
    with pytest.raises(openai.BadRequestError, match="priority"):
        client.chat.completions.create(model=MODEL, messages=MSGS, extra_headers={"X-Priority": "101"})
    raw = httpx.post(f"{server[0]}/v1/chat/completions", content=b"{not json",
                     headers={"content-type": "application/json"})
    assert raw.status_code == 400 and raw.json()["error"]["message"].startswith("malformed JSON")
    stats = server[1].stats  # the core's snapshot after its last turn
    assert stats.num_free_blocks == stats.num_blocks  # nothing leaked


def test_disconnect_mid_stream_aborts_and_frees_blocks(server) -> None:
    base, engine = server
    body = {"model": MODEL, "prompt": "tell me a story", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    deadline = time.time() + 10
    while time.time() < deadline and (engine.num_requests or engine.stats.num_requests_running):
        time.sleep(0.05)
    stats = engine.stats  # the core's snapshot after it ran the abort (on a thread or in its own process)
    assert engine.num_requests == 0 and stats.num_requests_running == stats.num_requests_waiting == 0
    assert stats.num_free_blocks == stats.num_blocks


def test_many_concurrent_streams_complete(server) -> None:
    async def main() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)

        async def one(i: int) -> str:
            stream = await aclient.completions.create(model=MODEL, prompt=f"number {i}", max_tokens=12,
                                                      temperature=0, stream=True)
            return "".join([c.choices[0].text async for c in stream if c.choices])

        return await asyncio.gather(*(one(i) for i in range(32)))

    texts = asyncio.run(main())
    assert len(texts) == 32 and all(texts)


def test_health_models_version_tokenize_metrics(server, client: openai.OpenAI) -> None:
    base, engine = server
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{base}/version").json()["version"]
    ids = httpx.post(f"{base}/tokenize", json={"model": MODEL, "prompt": "café 日本語"}).json()["tokens"]
    assert ids == engine.tokenizer.encode("café 日本語")
    assert httpx.post(f"{base}/detokenize", json={"model": MODEL, "tokens": ids}).json()["prompt"] == "café 日本語"

    def metric(name: str) -> float:
        text = httpx.get(f"{base}/metrics").text
        line = next(x for x in text.splitlines() if x.startswith(name + "{"))
        assert f'model_name="{MODEL}"' in line
        return float(line.rsplit(" ", 1)[1])

    names = ("vllm:generation_tokens_total", "vllm:iteration_tokens_total_sum", "vllm:iteration_tokens_total_count",
             "kvgate:engine_steps_total", "kvgate:engine_loop_busy_seconds_total")
    before = {name: metric(name) for name in names}
    prompt_len = len(engine.tokenizer.encode("hi"))
    client.completions.create(model=MODEL, prompt="hi", max_tokens=7, temperature=0, extra_body={"ignore_eos": True})
    after = {name: metric(name) for name in names}
    assert after["vllm:generation_tokens_total"] == before["vllm:generation_tokens_total"] + 7
    # the steps' tokens: the prompt, then the 6 tokens fed back (the 7th is sampled only), one count per step
    assert after["vllm:iteration_tokens_total_sum"] - before["vllm:iteration_tokens_total_sum"] == prompt_len + 6
    steps = after["kvgate:engine_steps_total"] - before["kvgate:engine_steps_total"]
    assert after["vllm:iteration_tokens_total_count"] - before["vllm:iteration_tokens_total_count"] == steps >= 7
    assert after["kvgate:engine_loop_busy_seconds_total"] > before["kvgate:engine_loop_busy_seconds_total"]


def test_api_key_body_limit_and_queue_limit(tiny_model_dirs: dict[str, str]) -> None:
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=tiny_model_dirs["llama"], max_num_seqs=1))
    with running(engine, api_key="sekret", max_body_bytes=2000, max_queue_len=1) as base:
        with pytest.raises(openai.AuthenticationError, match="API key"):
            openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=f"{base}/v1", api_key="sekret", max_retries=0)
        assert [m.id for m in good.models.list().data] == [MODEL]
        assert httpx.get(f"{base}/health").status_code == 200  # health needs no key
        with pytest.raises(openai.APIStatusError) as big:
            good.completions.create(model=MODEL, prompt="x" * 5000, max_tokens=1)
        assert big.value.status_code == 413 and "limit of 2000 bytes" in big.value.message

        async def flood() -> list[int]:
            aclient = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="sekret", max_retries=0)

            async def one(i: int) -> int:
                try:
                    await aclient.completions.create(model=MODEL, prompt=f"n {i}", max_tokens=30, temperature=0,
                                                     extra_body={"ignore_eos": True})
                    return 200
                except openai.RateLimitError as e:
                    assert e.response.headers["retry-after"]
                    return 429

            return await asyncio.gather(*(one(i) for i in range(6)))

        codes = asyncio.run(flood())
        assert 429 in codes and 200 in codes
        assert engine.engine.block_manager.num_free_blocks == engine.engine.block_manager.num_blocks


def test_x_priority_orders_a_saturated_engine(tiny_model_dirs: dict[str, str]) -> None:
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=tiny_model_dirs["llama"], max_num_seqs=1))
    with running(engine) as base:

        async def main() -> list[str]:
            aclient = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
            done: list[str] = []

            async def one(tag: str, prio: int, tokens: int) -> None:
                await aclient.completions.create(model=MODEL, prompt=f"req {tag}", max_tokens=tokens,
                                                 temperature=0, extra_body={"ignore_eos": True},
                                                 extra_headers={"X-Priority": str(prio)})
                done.append(tag)

            blocker = asyncio.create_task(one("blocker", 50, 60))  # occupies the only seat
            while not engine.engine.scheduler.running:
                await asyncio.sleep(0.01)
            rest = [asyncio.create_task(one(f"low{i}", 20, 4)) for i in range(3)]
            await asyncio.sleep(0.05)
            rest += [asyncio.create_task(one(f"high{i}", 90, 4)) for i in range(3)]
            await asyncio.gather(blocker, *rest)
            return done

        order = asyncio.run(main())
        # the later, more urgent requests preempt the running one and go first; the batch class goes last
        assert set(order[:3]) == {"high0", "high1", "high2"}, order
        assert order[3] == "blocker" and set(order[4:]) == {"low0", "low1", "low2"}, order
