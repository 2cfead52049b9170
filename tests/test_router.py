"""Routing through real parts: two in-process engines of the tiny model (one slowed down inside its engine step),
mock OpenAI upstreams, the gateway on a real uvicorn server, the real `openai` client. Counts, not timings."""
from __future__ import annotations

import asyncio
import json
import time
from typing import Iterator

import httpx
import openai
import pytest

from kvgate.engine.async_engine import AsyncEngineArgs, AsyncLLMEngine
from kvgate.gateway.app import create_app
from kvgate.gateway.config import parse_config
from kvgate.gateway.router import ModelRouter, RoutedRequest
from kvgate.gateway.router_config import build_router
from mock_upstream import MockUpstream, serving

SLOW_FACTOR = 1  # a slow step sleeps as long as the real step took: 2x slower on any machine
class CountingEngine:
    """An AsyncLLMEngine whose engine counts the requests it was given (and, if slow, sleeps after every step)."""

    def __init__(self, model_dir: str, slow: bool, max_num_seqs: int = 4) -> None:
        self.engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=model_dir, max_num_seqs=max_num_seqs))
        asyncio.run(self.engine.wait_until_ready(timeout=60))
        self.added = 0
        self.most_waiting = 0  # the longest waiting queue seen at admission
        core = self.engine.engine
        add, step = core.add_request, core.step

        def add_request(*a, **kw):
            self.added += 1
            self.most_waiting = max(self.most_waiting, self.engine.num_requests - max_num_seqs)
            return add(*a, **kw)

        def one_step():
            t0 = time.perf_counter()
            out = step()
            if slow:  # relative, not a fixed 30 ms sleep, whose speed ratio (10x and more on a quiet machine) put
                # the fast engine's queue within 0-4 of the herding limit below and once on it (a CI flake)
                time.sleep(max(0.002, SLOW_FACTOR * (time.perf_counter() - t0)))
            return out

        core.add_request, core.step = add_request, one_step


@pytest.fixture(scope="module")
def engines(tiny_model_dirs: dict[str, str]) -> Iterator[tuple[CountingEngine, CountingEngine]]:
    fast, slow = CountingEngine(tiny_model_dirs["llama"], False), CountingEngine(tiny_model_dirs["llama"], True)
    yield fast, slow
    fast.engine.shutdown()
    slow.engine.shutdown()


def test_latency_sends_sequential_requests_to_the_fast_engine(engines) -> None:
    fast, slow = engines
    f0, s0 = fast.added, slow.added
    router = ModelRouter(strategy="latency")
    router.add_model("tiny", [slow.engine, fast.engine])  # the slow one first: order gives it no edge
    with serving(create_app(router)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        for i in range(60):
            r = client.completions.create(model="tiny", prompt=f"count {i}", max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert r.usage.completion_tokens == 8
    n_fast, n_slow = fast.added - f0, slow.added - s0
    assert n_fast + n_slow == 60
    assert n_fast >= 0.95 * 60, (n_fast, n_slow)  # the slow one only got its probes
    assert 1 <= n_slow <= 3


def test_latency_spreads_32_concurrent_clients_without_a_runaway_queue(engines) -> None:
    fast, slow = engines
    router = ModelRouter(strategy="latency")
    router.add_model("tiny", [fast.engine, slow.engine])
    with serving(create_app(router)) as base:
        async def main() -> list[int]:
            client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)

            async def user(u: int) -> list[int]:
                out = []
                for k in range(3):
                    r = await client.completions.create(model="tiny", prompt=f"user {u} turn {k}", max_tokens=12,
                                                        temperature=0, extra_body={"ignore_eos": True})
                    out.append(r.usage.completion_tokens)
                return out

            for k in range(6):  # warm up: both engines have a history (probes, then the fast one)
                await client.completions.create(model="tiny", prompt=f"warm {k}", max_tokens=12)
            f0, s0 = fast.added, slow.added
            fast.most_waiting = slow.most_waiting = 0
            return [f0, s0] + [n for ns in await asyncio.gather(*(user(u) for u in range(32))) for n in ns]

        f0, s0, *tokens = asyncio.run(main())
        assert tokens == [12] * 96
    n_fast, n_slow = fast.added - f0, slow.added - s0
    assert n_fast + n_slow == 96
    assert n_slow >= 5 and n_fast > n_slow, (n_fast, n_slow)  # both take traffic, the fast one more
    # no herding: neither engine ever held every client (32 - 4 seats = 28 waiting would mean all of them)
    assert fast.most_waiting < 28 and slow.most_waiting < 28, (fast.most_waiting, slow.most_waiting)
    assert all(not d.stats.in_flight for d in router.models["tiny"])


def test_latency_sends_sequential_requests_to_the_fast_upstream() -> None:
    quick, sluggish = MockUpstream("quick").start(), MockUpstream("sluggish", delay=0.05).start()
    try:
        router = ModelRouter(strategy="latency")
        router.add_model("quick", [sluggish.url, quick.url])
        with serving(create_app(router)) as base:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
            for _ in range(60):
                client.chat.completions.create(model="quick", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=5)
        assert quick.requests + sluggish.requests == 60
        assert quick.requests >= 0.95 * 60, (quick.requests, sluggish.requests)
    finally:
        quick.stop()
        sluggish.stop()


def test_route_function_choice_is_honoured_and_models_lists_models_and_routes(engines) -> None:
    fast, _ = engines
    big = MockUpstream("big").start()
    seen: list[RoutedRequest] = []
    try:
        router = ModelRouter()
        router.add_model("small", fast.engine)
        router.add_model("big", big.url)

        @router.route(strategy="least_loaded")
        async def handle_request(request: RoutedRequest) -> str:
            seen.append(request)
            return "small" if request.len < 30 else "big"

        with serving(create_app(router)) as base:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
            assert {m.id for m in client.models.list().data} == {"small", "big", "auto"}
            short = client.chat.completions.create(model="auto", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=4, extra_headers={"X-Priority": "80"}, user="u1")
            long = client.chat.completions.create(model="auto", max_tokens=4, messages=[
                {"role": "user", "content": "a much longer question " * 20}])
            direct = client.chat.completions.create(model="big", messages=[{"role": "user", "content": "hi"}])
        assert short.model == "small" and short.choices[0].finish_reason == "length"
        assert long.system_fingerprint == "fp_big" and long.choices[0].message.content == big.text()
        assert direct.system_fingerprint == "fp_big" and big.requests == 2 and len(seen) == 2  # named: no route
        assert seen[0].priority == 80 and seen[0].user == "u1" and seen[0].messages[0]["content"] == "hi"
        assert seen[0].headers["x-priority"] == "80"
        tok = fast.engine.engine.tokenizer
        assert seen[1].len == len(tok.encode("a much longer question " * 20))
        assert seen[0].len < 30 <= seen[1].len
        assert json.loads(big.bodies_seen[0])["model"] == "big"  # "auto" replaced by the chosen model
    finally:
        big.stop()


def test_build_router_from_a_parsed_config(engines, tiny_model_dirs: dict[str, str]) -> None:
    a, b = MockUpstream("big").start(), MockUpstream("big").start()
    try:
        cfg = parse_config({
            "max_num_seqs": 4,
            "models": [{"name": "small", "model": tiny_model_dirs["llama"]},
                       {"name": "big", "deployments": [{"url": a.url, "api_key": "k1", "weight": 3},
                                                       {"url": b.url, "timeout": 5}]}],
            "router": {"strategy": "weighted", "fallbacks": {"big": ["small"]}},
            "routes": [{"name": "auto", "function": "mock_upstream:route_by_length"},
                       {"name": "any", "strategy": "least_loaded"}]})
        router = build_router(cfg)
        assert [d.name for d in router.deployments()] == ["small#0", "big#0", "big#1"]
        assert [d.weight for d in router.models["big"]] == [3.0, 1.0]
        assert router.fallbacks == {"big": ["small"]} and set(router.routes) == {"auto", "any"}
        assert router.models["big"][1].backend.timeout == 5.0
        engine = router.models["small"][0].backend.engine
        asyncio.run(engine.wait_until_ready(timeout=60))
        assert engine.engine.config.max_num_seqs == 4
        with serving(create_app(router)) as base:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
            for _ in range(8):  # weighted 3:1
                client.chat.completions.create(model="big", messages=[{"role": "user", "content": "hi"}])
            assert (a.requests, b.requests) == (6, 2)
            assert a.headers_seen[0]["authorization"] == "Bearer k1" and "authorization" not in b.headers_seen[0]
            r = client.chat.completions.create(model="auto", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=2)
            assert r.model == "small"
            r = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=2)
            assert r.model in ("small", "big")
            assert not engine.is_dead
    finally:
        asyncio.run(router.close())  # the router owns the engine it built (the app's shutdown closed it already)
        a.stop()
        b.stop()
    deadline = time.monotonic() + 30
    while router.models["small"][0].backend.engine._thread.is_alive():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_plain_servings_dict_keeps_working(tiny_model_dirs: dict[str, str]) -> None:
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=tiny_model_dirs["llama"], max_num_seqs=2))
    from kvgate.gateway.serving import OpenAIServing
    app = create_app({"one": OpenAIServing("one", engine)})
    with serving(app) as base:
        asyncio.run(engine.wait_until_ready(timeout=60))
        assert httpx.get(f"{base}/health").json() == {"status": "ok"}
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 2})  # no model: the only one
        assert r.status_code == 200 and r.json()["model"] == "one"
        bad = httpx.post(f"{base}/v1/completions", json={"model": "one", "prompt": "hi", "top_p": 7})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_p"
    engine.shutdown()
