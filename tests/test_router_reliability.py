"""The router's reliability through real parts: mock OpenAI upstreams and the gateway on real uvicorn servers on
loopback, the real `openai` client. Failing upstreams, cooldown and recovery, retries, fallbacks, 503s, client
disconnects. Everything is asserted by counts and contents, never by wall-clock time."""
from __future__ import annotations

import json
import time
from typing import Callable, Iterator

import httpx
import openai
import pytest

from kvgate.gateway.app import create_app
from kvgate.gateway.router import ModelRouter
from mock_upstream import MockUpstream, serving

MSGS = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def mocks() -> Iterator[tuple[MockUpstream, MockUpstream]]:
    a, b = MockUpstream("A").start(), MockUpstream("B").start()
    yield a, b
    a.stop()
    b.stop()


@pytest.fixture
def ab(mocks) -> tuple[MockUpstream, MockUpstream]:
    for m in mocks:  # a fresh state for every test
        m.delay = m.chunk_delay = 0.0
        m.chunks, m.fail = 5, None
        m.requests = m.streams_completed = m.closed_early = 0
        m.headers_seen.clear()
        m.bodies_seen.clear()
    return mocks


def fast_router(**kw) -> ModelRouter:
    return ModelRouter(**{"strategy": "round_robin", "cooldown_s": 0.3, "health_check_interval": 0.1, **kw})


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"gave up waiting: {what}"
        time.sleep(0.02)


def sse_events(base: str, body: dict) -> list[str]:
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=10) as r:
        assert r.status_code == 200, r.read()
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def test_failing_upstream_is_taken_out_and_comes_back(ab) -> None:
    a, b = ab
    b.fail = "down"
    router = fast_router()
    router.add_model("m", [a.url, b.url])
    with serving(create_app(router)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        for _ in range(10):  # every request succeeds: the failure is retried on A before any byte went out
            r = client.chat.completions.create(model="m", messages=MSGS, max_tokens=5)
            assert r.system_fingerprint == "fp_A" and r.choices[0].message.content == a.text()
        # the first health check or the first failed request put B into cooldown; its probes fail too
        assert b.requests <= 1
        dep_b = router.models["m"][1]
        assert not dep_b.health.available() and "500" in dep_b.health.last_error
        metrics = httpx.get(f"{base}/metrics").text
        assert 'kvgate:router_deployment_healthy{model_name="m",deployment="m#1"} 0' in metrics
        assert 'kvgate:router_requests_total{model_name="m",deployment="m#0"} 10' in metrics
        b.fail = None  # heals: the next half-open probe passes and B takes traffic again
        wait_for(dep_b.health.available, "B back after a passing probe")
        for _ in range(10):
            client.chat.completions.create(model="m", messages=MSGS, max_tokens=5)
        assert b.requests >= 1 + 4  # round robin again: about half of the 10


def test_retry_before_first_byte_gives_one_clean_stream(ab) -> None:
    a, b = ab
    b.fail = "500"
    router = fast_router()
    router.add_model("m", [b.url, a.url])  # round robin tries B first
    with serving(create_app(router)) as base:
        events = sse_events(base, {"model": "m", "messages": MSGS, "stream": True})
    assert b.requests == 1 and a.requests == 1
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-A-")
    assert sum(1 for c in chunks if c["choices"][0]["delta"].get("role")) == 1
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == a.text()
    assert all(c["system_fingerprint"] == "fp_A" for c in chunks)


def test_stream_broken_after_first_byte_is_not_retried(ab) -> None:
    a, b = ab
    b.fail = "midstream"
    router = fast_router()
    router.add_model("m", [b.url, a.url])
    with serving(create_app(router)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        seen = []
        with pytest.raises((openai.APIError, httpx.HTTPError)):
            for c in client.chat.completions.create(model="m", messages=MSGS, stream=True):
                seen.append(c.choices[0].delta.content or "")
        assert "".join(seen) == "B0 B1 "  # what B sent before it broke, once, and nothing from A
        assert a.requests == 0 and b.requests == 1
        wait_for(lambda: not router.models["m"][0].stats.in_flight, "the broken stream accounted")
        assert router.models["m"][0].stats.failures == 1


def test_fallback_model_serves_when_the_model_is_down(ab) -> None:
    a, b = ab
    b.fail = "500"
    router = fast_router(fallbacks={"big": ["small"]})
    router.add_model("big", b.url)
    router.add_model("small", a.url)
    with serving(create_app(router)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(model="big", messages=MSGS, max_tokens=5)
        assert r.system_fingerprint == "fp_A" and b.requests == 1
        r = client.chat.completions.create(model="big", messages=MSGS, max_tokens=5)  # B cooling: straight to A
        assert r.system_fingerprint == "fp_A" and b.requests == 1 and a.requests == 2


def test_503_with_retry_after_when_every_deployment_is_down(ab) -> None:
    a, b = ab
    a.fail = b.fail = "500"
    router = fast_router(cooldown_s=30.0)
    router.add_model("m", [a.url, b.url])
    with serving(create_app(router)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:
            client.chat.completions.create(model="m", messages=MSGS)
        assert e.value.status_code == 503 and int(e.value.response.headers["retry-after"]) >= 1
        assert e.value.body["code"] == "model_unavailable" and "m#0" in e.value.message
        assert a.requests == 1 and b.requests == 1  # each tried once
        with pytest.raises(openai.InternalServerError) as again:  # both cooling: refused without trying them
            client.chat.completions.create(model="m", messages=MSGS)
        assert again.value.status_code == 503 and 25 <= int(again.value.response.headers["retry-after"]) <= 30
        assert a.requests == 1 and b.requests == 1
        health = httpx.get(f"{base}/health")
        assert health.status_code == 503 and health.json()["status"] == "unavailable"


def test_client_disconnect_closes_the_upstream_stream(ab) -> None:
    a, _ = ab
    a.chunks, a.chunk_delay = 400, 0.02
    router = fast_router()
    router.add_model("m", a.url)
    with serving(create_app(router)) as base:
        with httpx.stream("POST", f"{base}/v1/chat/completions",
                          json={"model": "m", "messages": MSGS, "stream": True}) as r:
            lines = r.iter_lines()
            for _ in range(3):
                next(lines)
        wait_for(lambda: a.closed_early == 1, "the upstream saw its stream closed")
        assert a.streams_completed == 0
        wait_for(lambda: not router.models["m"][0].stats.in_flight, "the router forgot the request")
        assert router.models["m"][0].health.available()  # a client leaving is not the upstream's fault


def test_client_disconnect_cancels_a_non_streamed_upstream_request(ab) -> None:
    a, _ = ab
    a.delay = 5.0
    router = fast_router()
    router.add_model("m", a.url)
    with serving(create_app(router)) as base:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{base}/v1/chat/completions", json={"model": "m", "messages": MSGS}, timeout=0.5)
        wait_for(lambda: a.closed_early == 1, "the upstream saw the request go away")


def test_relay_keeps_bytes_ids_and_forwards_priority_headers(ab) -> None:
    a, _ = ab
    router = fast_router()
    router.add_model("A", a.url, api_key="upstream-key")  # the upstream's own model name: no rewrite
    with serving(create_app(router, api_key="gateway-key")) as base:
        body = b'{"model": "A", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "x_extra": 1}'
        r = httpx.post(f"{base}/v1/chat/completions", content=body,
                       headers={"authorization": "Bearer gateway-key", "content-type": "application/json",
                                "x-priority": "90", "x-max-batch-delay-ms": "5"})
        assert r.status_code == 200
        assert a.bodies_seen[-1] == body  # passed through untouched (fields kvgate itself does not know, too)
        seen = a.headers_seen[-1]
        assert seen["x-priority"] == "90" and seen["x-max-batch-delay-ms"] == "5"
        assert seen["authorization"] == "Bearer upstream-key"  # the upstream's key, never the client's
        assert r.json()["id"].startswith("chatcmpl-A-") and r.json()["system_fingerprint"] == "fp_A"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="gateway-key", max_retries=0)
        c = client.completions.create(model="A", prompt="hi", max_tokens=3, extra_headers={"X-Priority": "10"})
        assert c.id.startswith("cmpl-A-") and c.system_fingerprint == "fp_A" and c.choices[0].text == a.text()
        assert a.headers_seen[-1]["x-priority"] == "10"
        with pytest.raises(openai.BadRequestError, match="priority"):  # still checked at the gateway
            client.completions.create(model="A", prompt="hi", extra_headers={"X-Priority": "500"})


def test_upstream_client_errors_are_relayed_not_retried(ab) -> None:
    a, b = ab
    a.fail = b.fail = "400"
    router = fast_router()
    router.add_model("m", [a.url, b.url])
    with serving(create_app(router)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="A says 400"):
            client.chat.completions.create(model="m", messages=MSGS)
        assert a.requests + b.requests == 1 and router.models["m"][0].health.available()


def test_model_name_is_rewritten_for_an_upstream_that_serves_another_name(ab) -> None:
    a, _ = ab
    router = fast_router()
    router.add_model("m", a.url)  # A serves one model, "A": the health check learns that
    with serving(create_app(router)) as base:
        wait_for(lambda: router.models["m"][0].backend.served == ["A"], "the first health check")
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        client.chat.completions.create(model="m", messages=MSGS, max_tokens=3, extra_body={"x_extra": [1, "é"]})
        assert json.loads(a.bodies_seen[-1]) == {"model": "A", "messages": MSGS, "max_tokens": 3, "x_extra": [1, "é"]}


def test_a_restarted_upstream_takes_traffic_again_within_one_health_check_interval(ab) -> None:
    """B goes away long enough for its back-off to grow well past the health-check interval (7 failed probes:
    0.1 s doubling would be 12.8 s by now), then comes back: the next probe, due within one interval, lets it in."""
    a, b = ab
    interval = 1.0
    router = fast_router(cooldown_s=0.1, health_check_interval=interval)
    router.add_model("m", [a.url, b.url])
    dep_b = router.models["m"][1]
    with serving(create_app(router)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        b.stop()
        try:
            while dep_b.health.cooldowns < 7:  # every request is served meanwhile (by A, or retried on A)
                r = client.chat.completions.create(model="m", messages=MSGS, max_tokens=5)
                assert r.system_fingerprint == "fp_A"
                time.sleep(0.05)
            assert not dep_b.health.available() and dep_b.health.until - time.monotonic() <= interval
        finally:
            b.start()
        back_at = time.monotonic()
        wait_for(dep_b.health.available, "B back after a passing probe")
        assert time.monotonic() - back_at <= interval + 1.0  # the promise: one interval (+ a probe's trip)
        served_by_b = b.requests
        for _ in range(4):  # round robin again: B takes its share at once
            client.chat.completions.create(model="m", messages=MSGS, max_tokens=5)
        assert b.requests - served_by_b == 2
