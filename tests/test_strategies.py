"""Strategies, health and the router's request view, on deployments whose live state the test sets (no HTTP)."""
from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest

from kvgate.gateway.backends import RemoteBackend, completion_tokens, parse_vllm_metrics
from kvgate.gateway.health import COOLDOWN, HALF_OPEN, HEALTHY, Health
from kvgate.gateway.router import RoutedRequest
from kvgate.gateway.strategies import Deployment, LoadState, RequestTiming, estimate, make_strategy


@dataclass
class FakeBackend:
    state: LoadState = field(default_factory=LoadState)
    ready: bool = True
    dead: bool = False

    def load_state(self, now: float) -> LoadState:
        return self.state

    def queue_full(self, limit: int) -> bool:
        return False


def dep(name: str, capacity: int | None = None, weight: float = 1.0) -> Deployment:
    return Deployment("m", name, FakeBackend(LoadState(capacity=capacity, scraped_at=time.monotonic() - 1)), weight)


def learn(d: Deployment, ttft: float, tpot: float, n: int = 5, tokens: int = 10) -> None:
    """Feed `n` finished requests with this TTFT and time per output token into d's stats."""
    for _ in range(n):
        now = time.monotonic()
        t = RequestTiming(started=now - ttft - tpot * (tokens - 1), prompt_tokens=20, load=0, queue_wait=0.0)
        t.first_token, t.output_tokens = now - tpot * (tokens - 1), tokens
        d.stats.end(d.stats.begin(t), now, ok=True)


def req(text: str = "hello", max_tokens: int = 16) -> RoutedRequest:
    return RoutedRequest("chat", {"model": "m", "messages": [{"role": "user", "content": text}],
                                  "max_tokens": max_tokens})


def dispatch(d: Deployment, r: RoutedRequest) -> int:
    """What the router does when it sends a request: it is in flight on d from now on."""
    return d.stats.begin(RequestTiming(time.monotonic(), r.len, d.load(time.monotonic()), 0.0))


def test_latency_probes_unknown_deployments_one_at_a_time() -> None:
    a, b = dep("a", 8), dep("b", 8)
    lat = make_strategy("latency")
    first = lat.pick([a, b], req())
    dispatch(first, req())
    second = lat.pick([a, b], req())
    assert {first.name, second.name} == {"a", "b"}  # each gets a probe while the other is busy
    learn(a, ttft=0.01, tpot=0.005)
    for _ in range(2):  # probe_requests
        a.stats.in_flight.clear()
        assert lat.pick([a, b], req()) is b  # b still needs probes and has none in flight
        dispatch(b, req())
        assert lat.pick([a, b], req()) is a  # a probe is in flight on b: no second probe meanwhile
        b.stats.in_flight.clear()
        learn(b, ttft=0.05, tpot=0.02, n=1)
    assert lat.pick([a, b], req()) is a  # both known now: the faster one


def test_latency_prefers_the_faster_for_this_request_and_priors_come_from_siblings() -> None:
    a, b, new = dep("a", 8), dep("b", 8), dep("new", 8)
    learn(a, ttft=0.02, tpot=0.010)
    learn(b, ttft=0.20, tpot=0.005)  # slow prefill, fast decode
    lat = make_strategy("latency")
    now = time.monotonic()
    short_prompt_long_output = req("hi", max_tokens=500)
    long_prompt_short_output = req("word " * 2000, max_tokens=1)
    def predicted(d: Deployment, r: RoutedRequest) -> float:
        return sum(estimate(d, [a, b], r, now))

    assert predicted(b, short_prompt_long_output) < predicted(a, short_prompt_long_output)
    assert predicted(a, long_prompt_short_output) < predicted(b, long_prompt_short_output)
    assert lat.pick([a, b], short_prompt_long_output) is b and lat.pick([a, b], long_prompt_short_output) is a
    # a new replica is predicted like its best-known siblings, not as free
    _, service_new = estimate(new, [a, b, new], req(), now)
    _, service_a = estimate(a, [a, b, new], req(), now)
    assert service_new > 0 and service_new == pytest.approx(min(service_a, sum(estimate(b, [a, b, new], req(), now))),
                                                            rel=0.5)


def test_latency_spreads_a_burst_instead_of_herding() -> None:
    fast, slow = dep("fast", 4), dep("slow", 4)
    learn(fast, ttft=0.01, tpot=0.01)
    learn(slow, ttft=0.01, tpot=0.03)
    lat = make_strategy("latency")
    picks = Counter()
    for _ in range(32):  # 32 requests arrive before the (stale) scraped state shows any of them
        d = lat.pick([fast, slow], req())
        dispatch(d, req())
        picks[d.name] += 1
    assert picks["fast"] + picks["slow"] == 32
    assert picks["slow"] >= 6 and picks["fast"] > picks["slow"], picks
    # with the requests counted only in a fresh scrape, the same holds: scraped + pending never double counts
    for d in (fast, slow):
        n = len(d.stats.in_flight)
        d.backend.state = LoadState(running=min(n, 4), waiting=max(0, n - 4), capacity=4, scraped_at=time.monotonic())
        assert d.load(time.monotonic()) == n


def test_queue_wait_from_scraped_state_counts_requests_sent_since_the_scrape() -> None:
    d = dep("remote")
    learn(d, ttft=0.05, tpot=0.01)
    scraped = time.monotonic()
    d.backend.state = LoadState(running=8, waiting=4, scraped_at=scraped)
    wait_before, _ = estimate(d, [d], req(), time.monotonic())
    assert wait_before > 0  # a waiting queue means every seat (8 running) is taken
    for _ in range(4):
        dispatch(d, req())
    assert d.load(time.monotonic()) == 16
    wait_after, _ = estimate(d, [d], req(), time.monotonic())
    assert wait_after > wait_before
    d.backend.state = LoadState(running=8, waiting=4, scraped_at=time.monotonic() + 1)  # a scrape saw them
    assert d.load(time.monotonic()) == 12


def test_remote_state_older_than_its_bound_is_not_used() -> None:
    async def main() -> None:
        b = RemoteBackend("http://127.0.0.1:9/v1", staleness_s=0.5, max_staleness_s=5.0)
        now = time.monotonic()
        b.state = LoadState(running=7, waiting=3, scraped_at=now - 1.0)
        assert b.load_state(now).running == 7  # stale enough to refresh, fresh enough to use
        b.state = LoadState(running=7, waiting=3, scraped_at=now - 6.0)
        assert b.load_state(now) == LoadState()  # too old: unknown (the router counts its own requests)
        await b.close()

    asyncio.run(main())


def test_round_robin_weighted_and_least_loaded() -> None:
    a, b, c = dep("a"), dep("b"), dep("c", weight=3)
    rr = make_strategy("round_robin")
    assert [rr.pick([a, b, c], req()).name for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]
    w = make_strategy("weighted")
    seq = [w.pick([a, c], req()).name for _ in range(8)]
    assert Counter(seq) == {"c": 6, "a": 2} and seq[:4].count("a") == 1  # 3:1, spread out
    ll = make_strategy("least_loaded")
    for _ in range(3):
        dispatch(a, req())
    dispatch(b, req())
    assert ll.pick([a, b, c], req()) is c
    dispatch(c, req())
    assert ll.pick([a, b, c], req()) in (b, c)
    with pytest.raises(ValueError, match="unknown routing strategy 'fastest'"):
        make_strategy("fastest")


def test_prefix_affinity_keeps_a_shared_prefix_on_one_replica_unless_overloaded() -> None:
    deps = [dep(f"r{i}", capacity=8) for i in range(3)]
    pa = make_strategy("prefix_affinity")
    system = "You are a helpful assistant for the ACME support desk. " * 12
    homes = {pa.pick(deps, req(system + f"question {i}")).name for i in range(20)}
    assert len(homes) == 1  # the same long prefix always goes home
    others = Counter(pa.pick(deps, req(f"{i} another system prompt entirely " * 20)).name for i in range(60))
    assert len(others) == 3  # different prefixes spread over every replica
    home = next(d for d in deps if d.name in homes)
    for _ in range(9):  # the home replica is overloaded: full and well above the others
        dispatch(home, req())
    assert pa.pick(deps, req(system + "one more")) is not home


def test_health_cooldown_half_open_and_back_off() -> None:
    h = Health(max_fails=2, cooldown_s=1.0, max_cooldown_s=30.0, probe_interval_s=5.0)
    h.on_failure(100.0, "boom")
    assert h.available() and h.state == HEALTHY  # one failure is allowed
    h.on_failure(100.0, "boom")
    assert not h.available() and h.state == COOLDOWN and h.retry_after(100.2) == 1
    assert not h.due_for_probe(100.5)
    assert h.due_for_probe(101.0) and h.state == HALF_OPEN and not h.available()  # waits for its probe
    h.on_failure(101.0, "probe failed")  # a failed probe: a longer wait before the next one
    assert h.state == COOLDOWN and h.until == 103.0
    h.on_failure(102.0, "in flight when it went down")  # does not extend it
    assert h.until == 103.0
    t = 103.0
    for wait in (4.0, 5.0, 5.0, 5.0):  # the back-off doubles, but probes come at least every probe_interval_s
        assert h.due_for_probe(t)
        h.on_failure(t, "probe failed")
        assert h.until == t + wait
        t += wait
    assert h.due_for_probe(t)
    h.on_probe_ok()  # traffic returns at the first passing probe, whatever the back-off had reached
    assert h.available() and h.state == HEALTHY
    h.on_failure(200.0, "x")
    h.on_failure(200.0, "x")
    assert h.until == 201.0  # the passing probe ended the back-off: the next cooldown starts over
    h.due_for_probe(201.0)
    h.on_failure(201.0, "probe failed")
    assert h.until == 203.0
    h.due_for_probe(203.0)
    h.on_probe_ok()
    h.on_success()  # a request served well resets it too
    assert h.cooldowns == 0 and h.fails == 0
    capped = Health(cooldown_s=1.0, max_cooldown_s=3.0)  # no probe interval: max_cooldown_s caps the back-off
    for t, wait in ((0.0, 1.0), (1.0, 2.0), (3.0, 3.0), (6.0, 3.0)):
        capped.due_for_probe(t)
        capped.on_failure(t, "x")
        assert capped.until == t + wait


def test_routed_request_view() -> None:
    chat = RoutedRequest("chat", {"model": "auto", "user": "u", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "what is "}, {"type": "text", "text": "2+2"}]}]},
        raw=b"{...}", count_tokens=lambda s: len(s.split()))
    assert chat.text() == "be brief\nwhat is 2+2" and chat.len == 5 and chat.user == "u"
    assert chat.max_tokens is None and not chat.stream
    ids = RoutedRequest("completions", {"model": "m", "prompt": [1, 2, 3]})
    assert ids.len == 3 and ids.max_tokens == 16  # the completions default
    many = RoutedRequest("completions", {"model": "m", "prompt": [[1, 2], [3]], "max_tokens": 5, "stream": True})
    assert many.len == 3 and many.max_tokens == 5 and many.stream
    plain = RoutedRequest("completions", {"model": "m", "prompt": "x" * 40}, raw=b'{"model": "m"}')
    assert plain.len == 11  # no tokenizer: about 4 bytes per token
    assert plain.body_for("m") is plain.raw  # same model: the client's bytes go upstream unchanged
    assert b'"model": "up"' in plain.body_for("up")


def test_metrics_and_usage_parsing() -> None:
    text = ('# HELP vllm:num_requests_running x\nvllm:num_requests_running{model_name="a"} 3.0\n'
            'vllm:num_requests_running{model_name="b"} 2.0\nvllm:num_requests_waiting{model_name="a"} 4.0\n'
            'vllm:gpu_cache_usage_perc{model_name="a"} 0.5\nvllm:kv_cache_usage_perc{model_name="b"} 0.7\n'
            'vllm:num_requests_waiting_by_reason{reason="x"} 9\n')
    s = parse_vllm_metrics(text, 12.0)
    assert (s.running, s.waiting, s.kv_usage, s.scraped_at) == (5, 4, 0.7, 12.0)
    assert completion_tokens(b'{"usage": {"prompt_tokens": 3, "completion_tokens": 42, "total_tokens": 45}}') == 42
    assert completion_tokens(b'{"usage":{"completion_tokens":7}}') == 7 and completion_tokens(b"{}") == 0
