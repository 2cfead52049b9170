"""How the router chooses among a model's deployments: latency (default), least_loaded, round_robin, weighted,
prefix_affinity; and what a deployment has learned about itself (EWMA rates, requests in flight).

Every strategy sees only available deployments (healthy, loaded, queue not full) and returns one of them.
"""
from __future__ import annotations

import hashlib
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from kvgate.gateway.health import Health

if TYPE_CHECKING:
    from kvgate.gateway.router import RoutedRequest

PRIOR_TTFT_S = 0.2  # a deployment with no history, and no sibling with history, is assumed to be this slow
PRIOR_TPOT_S = 0.05
PREFILL_OVERHEAD_TOKENS = 32  # TTFT(L) is taken as proportional to L + this (a fixed cost per request)
BATCH_SLOWDOWN = 0.05  # each other request in the batch makes a decode step this much slower (before learning)


@dataclass
class LoadState:
    """A deployment's live state: read from the engine (embedded) or scraped from /metrics (remote)."""
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    capacity: int | None = None  # seats in the running batch (max_num_seqs), when known
    scraped_at: float = float("-inf")  # requests the router sent after this are not in the counts above


@dataclass
class RequestTiming:
    """One dispatched request, filled in by the backend as bytes come back."""
    started: float
    prompt_tokens: int
    load: int  # requests on the deployment when this one was sent (itself not included)
    queue_wait: float  # the predicted queue wait at dispatch, taken out of the observed TTFT
    first_token: float | None = None
    output_tokens: int = 0


class EWMA:
    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha, self.value, self.count = alpha, 0.0, 0

    def update(self, x: float) -> None:
        self.value = x if self.count == 0 else self.value + self.alpha * (x - self.value)
        self.count += 1


@dataclass
class DeploymentStats:
    """Learned online: TTFT (per prompt length) and time per output token (per batch load), as EWMAs."""
    ttft: EWMA = field(default_factory=EWMA)
    ttft_len: EWMA = field(default_factory=EWMA)  # prompt lengths behind the TTFT average
    tpot: EWMA = field(default_factory=EWMA)
    tpot_load: EWMA = field(default_factory=EWMA)  # batch loads behind the TPOT average
    in_flight: dict[int, RequestTiming] = field(default_factory=dict)
    last_observed: float = float("-inf")
    requests: int = 0
    failures: int = 0
    _ids: Any = field(default_factory=itertools.count)

    def begin(self, timing: RequestTiming) -> int:
        key = next(self._ids)
        self.in_flight[key] = timing
        self.requests += 1
        return key

    def end(self, key: int, now: float, ok: bool) -> None:
        t = self.in_flight.pop(key, None)
        if t is None:
            return
        if not ok:
            self.failures += 1
            return
        self.last_observed = now
        first = t.first_token
        if first is None:  # a non-streamed answer: split its time as the current rates would
            ttft, tpot = self.predict_ttft(t.prompt_tokens), self.predict_tpot(t.load)
            share = ttft / (ttft + max(0, t.output_tokens - 1) * tpot)
            first = t.started + t.queue_wait + max(0.0, now - t.started - t.queue_wait) * share
        self.ttft_len.update(t.prompt_tokens)
        self.ttft.update(max(0.0, first - t.started - t.queue_wait))
        if t.output_tokens > 1:
            self.tpot_load.update(t.load + 1)
            self.tpot.update(max(1e-5, (now - first) / (t.output_tokens - 1)))

    def pending_since(self, scraped_at: float) -> int:
        """Requests this router sent after the last scrape: not yet in the scraped counts."""
        if scraped_at == float("-inf"):
            return len(self.in_flight)
        return sum(1 for t in self.in_flight.values() if t.started >= scraped_at)

    @property
    def observations(self) -> int:
        return max(self.ttft.count, self.tpot.count)

    def predict_ttft(self, prompt_tokens: int, prior: float = PRIOR_TTFT_S) -> float:
        if self.ttft.count == 0:
            return prior * (prompt_tokens + PREFILL_OVERHEAD_TOKENS) / (128 + PREFILL_OVERHEAD_TOKENS)
        return self.ttft.value * (prompt_tokens + PREFILL_OVERHEAD_TOKENS) / (self.ttft_len.value
                                                                              + PREFILL_OVERHEAD_TOKENS)

    def predict_tpot(self, load: int, prior: float = PRIOR_TPOT_S) -> float:
        if self.tpot.count == 0:
            return prior * (1 + BATCH_SLOWDOWN * load)
        return self.tpot.value * (1 + BATCH_SLOWDOWN * load) / (1 + BATCH_SLOWDOWN * self.tpot_load.value)


@dataclass
class Deployment:
    """One replica of a model: where requests go (backend), how much traffic it takes (weight), its health."""
    model: str
    name: str  # unique: "model#index", shown in logs and metrics
    backend: Any  # EmbeddedBackend | RemoteBackend
    weight: float = 1.0
    health: Health = field(default_factory=Health)
    stats: DeploymentStats = field(default_factory=DeploymentStats)

    def load_state(self, now: float) -> LoadState:
        return self.backend.load_state(now)

    def load(self, now: float) -> int:
        """Requests on it now: scraped running + waiting, plus what the router sent since the scrape."""
        s = self.load_state(now)
        return s.running + s.waiting + self.stats.pending_since(s.scraped_at)


# ---- strategies ---------------------------------------------------------------------------------------------------
class Strategy:
    name = ""

    def pick(self, deps: list[Deployment], req: "RoutedRequest") -> Deployment:
        raise NotImplementedError


class RoundRobin(Strategy):
    name = "round_robin"

    def __init__(self) -> None:
        self.n = 0

    def pick(self, deps: list[Deployment], req: "RoutedRequest") -> Deployment:
        self.n += 1
        return deps[(self.n - 1) % len(deps)]


class Weighted(Strategy):
    """Smooth weighted round robin (nginx's): deterministic, and spread out rather than in bursts."""
    name = "weighted"

    def __init__(self) -> None:
        self.current: dict[str, float] = {}

    def pick(self, deps: list[Deployment], req: "RoutedRequest") -> Deployment:
        total = sum(d.weight for d in deps)
        for d in deps:
            self.current[d.name] = self.current.get(d.name, 0.0) + d.weight
        best = max(deps, key=lambda d: self.current[d.name])
        self.current[best.name] -= total
        return best


class LeastLoaded(Strategy):
    name = "least_loaded"

    def __init__(self) -> None:
        self.n = 0

    def pick(self, deps: list[Deployment], req: "RoutedRequest") -> Deployment:
        now, self.n = time.monotonic(), self.n + 1
        start = self.n % len(deps)  # ties rotate
        order = deps[start:] + deps[:start]
        return min(order, key=lambda d: (d.load(now), d.load_state(now).kv_usage))


class PrefixAffinity(Strategy):
    """Prompts that share their first `prefix_chars` characters go to one replica (rendezvous hashing), where the
    prefix cache already holds them, unless that replica is overloaded: then the least loaded one."""
    name = "prefix_affinity"

    def __init__(self, prefix_chars: int = 512, min_chars: int = 64, slack: int = 8) -> None:
        self.prefix_chars, self.min_chars, self.slack = prefix_chars, min_chars, slack
        self.fallback = LeastLoaded()

    def pick(self, deps: list[Deployment], req: "RoutedRequest") -> Deployment:
        prefix = req.prefix_text(self.prefix_chars)
        if len(prefix) < self.min_chars:
            return self.fallback.pick(deps, req)
        key = prefix.encode()
        best = max(deps, key=lambda d: hashlib.blake2b(key + d.name.encode(), digest_size=8).digest())
        now = time.monotonic()
        load, lightest = best.load(now), min(d.load(now) for d in deps)
        cap = best.load_state(now).capacity
        if load > lightest + self.slack or (cap is not None and load >= cap and lightest < load):
            return self.fallback.pick(deps, req)
        return best


class Latency(Strategy):
    """Predicted completion time of THIS request on each deployment (see `estimate`). A deployment without
    history is predicted from its siblings (or a prior) and gets `probe_requests` probes, one at a time; one not
    observed for `explore_after_s` gets another probe, so a replica that got faster is noticed."""
    name = "latency"

    def __init__(self, probe_requests: int = 2, explore_after_s: float = 30.0) -> None:
        self.probe_requests, self.explore_after_s = probe_requests, explore_after_s

    def pick(self, deps: list[Deployment], req: "RoutedRequest") -> Deployment:
        now = time.monotonic()
        if len(deps) > 1:
            for d in sorted(deps, key=lambda d: d.stats.observations):
                st = d.stats
                stale = st.observations and now - st.last_observed > self.explore_after_s
                if (st.observations < self.probe_requests or stale) and not st.in_flight:
                    return d  # a probe: one at a time, so an unknown replica is never flooded
        return min(deps, key=lambda d: sum(estimate(d, deps, req, now)))


def estimate(d: Deployment, siblings: list[Deployment], req: "RoutedRequest", now: float,
             default_max_tokens: int = 128) -> tuple[float, float]:
    """(queue wait, service time) for this request on `d`. Queue wait comes from the live state: the requests
    this router sent that the scrape has not seen yet count too, so concurrent requests spread out instead of
    herding onto the replica that looked fastest. Service = prefill for the prompt length + decode for max_tokens
    at the batch size it would join, from the deployment's learned rates (or its siblings' for a new one)."""
    s = d.load_state(now)
    load = s.running + s.waiting + d.stats.pending_since(s.scraped_at)
    known = [x.stats for x in siblings if x.stats.observations]
    prior_ttft = min((x.predict_ttft(128) for x in known), default=PRIOR_TTFT_S)
    prior_tpot = min((x.predict_tpot(0) for x in known), default=PRIOR_TPOT_S)
    ttft = d.stats.predict_ttft(req.len, prior_ttft)
    service = ttft + (req.max_tokens or default_max_tokens) * d.stats.predict_tpot(load, prior_tpot)
    # seats free up at about `seats` requests per service time; the requests beyond them go first
    seats = s.capacity if s.capacity is not None else (max(1, s.running) if s.waiting else None)
    wait = 0.0 if seats is None else max(0, load + 1 - seats) * service / seats
    if s.kv_usage > 0.95:  # near a full KV cache, new requests wait or preempt others
        wait += service * (s.kv_usage - 0.95) * 20
    return wait, service


STRATEGIES: dict[str, Callable[[], Strategy]] = {
    "latency": Latency, "least_loaded": LeastLoaded, "round_robin": RoundRobin, "weighted": Weighted,
    "prefix_affinity": PrefixAffinity}


def make_strategy(name: str) -> Strategy:
    if name not in STRATEGIES:
        raise ValueError(f"unknown routing strategy {name!r}; choose one of {', '.join(STRATEGIES)}")
    return STRATEGIES[name]()
