"""Engine statistics: request latency histograms (vLLM's names and buckets) recorded on the engine thread, and the
EngineStats snapshot that other threads (the /metrics endpoint, the router) read instead of live engine state."""
from __future__ import annotations

import bisect
import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvgate.engine.kv_offload import OffloadTier
    from kvgate.engine.llm_engine import LLMEngine
    from kvgate.engine.sequence import Request

TIME_TO_FIRST_TOKEN = "vllm:time_to_first_token_seconds"
INTER_TOKEN_LATENCY = "vllm:inter_token_latency_seconds"
E2E_REQUEST_LATENCY = "vllm:e2e_request_latency_seconds"
REQUEST_QUEUE_TIME = "vllm:request_queue_time_seconds"
ITERATION_TOKENS = "vllm:iteration_tokens_total"

# vLLM's bucket boundaries (seconds) for these histograms
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # tokens a step computes
FINISH_REASONS = ("stop", "length", "abort")


@dataclass
class Histogram:
    buckets: tuple[float, ...]  # upper bounds, ascending; the +Inf bucket is implied
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; the last one is +Inf
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1  # the first bound >= value ("le")
        self.sum += value
        self.count += 1

    def copy(self) -> "Histogram":
        return Histogram(self.buckets, list(self.counts), self.sum, self.count)

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations <= bound) per bucket, ending with (inf, count)."""
        total, rows = 0, []
        for bound, n in zip((*self.buckets, float("inf")), self.counts):
            total += n
            rows.append((bound, total))
        return rows


class LatencyStats:
    """Per-request timings, recorded by LLMEngine on the engine thread (times are time.monotonic())."""

    def __init__(self) -> None:
        self.histograms = {
            TIME_TO_FIRST_TOKEN: Histogram(TTFT_BUCKETS),
            INTER_TOKEN_LATENCY: Histogram(ITL_BUCKETS),
            E2E_REQUEST_LATENCY: Histogram(REQUEST_LATENCY_BUCKETS),
            REQUEST_QUEUE_TIME: Histogram(REQUEST_LATENCY_BUCKETS),
            ITERATION_TOKENS: Histogram(ITERATION_TOKENS_BUCKETS),
        }
        self.request_success: dict[str, int] = dict.fromkeys(FINISH_REASONS, 0)  # finished requests by reason
        self._last_token_time: dict[str, float] = {}

    def on_step(self, num_tokens: int) -> None:
        """A step computed num_tokens tokens (prompt and decode)."""
        self.histograms[ITERATION_TOKENS].observe(num_tokens)

    def on_tokens(self, req: "Request", now: float) -> None:
        """A step produced tokens for req: its first (time to first token) or a later one (inter-token latency)."""
        last = self._last_token_time.get(req.request_id)
        if last is None:
            self.histograms[TIME_TO_FIRST_TOKEN].observe(now - req.arrival_time)
        else:
            self.histograms[INTER_TOKEN_LATENCY].observe(now - last)
        self._last_token_time[req.request_id] = now

    def on_finished(self, req: "Request", now: float, reason: str | None) -> None:
        self._last_token_time.pop(req.request_id, None)
        reason = reason or "stop"
        self.request_success[reason] = self.request_success.get(reason, 0) + 1
        if reason == "abort":  # a client that left: its latency says nothing about the server
            return
        self.histograms[E2E_REQUEST_LATENCY].observe(now - req.arrival_time)
        if req.first_scheduled_time is not None:
            self.histograms[REQUEST_QUEUE_TIME].observe(req.first_scheduled_time - req.arrival_time)


@dataclass
class LoopTimes:
    """Where the engine loop's wall time goes (seconds, totals; EngineCore adds to them): running steps (`busy`:
    scheduling, launching, waiting for the GPU, sampling, detokenizing, making outputs), handing the outputs over
    (`emit`: to the event loop, or pickled into the pipe of the engine core's process) and waiting for commands with
    nothing to run, or running them: adding requests, aborts (`idle`)."""
    busy: float = 0.0
    emit: float = 0.0
    idle: float = 0.0


@dataclass(frozen=True)
class EngineStats:
    """A consistent copy of the engine's figures, taken on the engine thread between steps."""
    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage_perc: float
    num_free_blocks: int
    num_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    num_steps: int
    histograms: dict[str, Histogram]
    request_success: dict[str, int]
    timestamp: float
    # the KV offload tier (zeros when it is off): tokens looked up and found there, bytes copied each way, blocks held
    offload_queries: int = 0
    offload_hits: int = 0
    offload_saved_bytes: int = 0
    offload_loaded_bytes: int = 0
    offload_blocks: int = 0
    offload_capacity_blocks: int = 0
    offload_disk_queries: int = 0  # the disk tier below it, likewise
    offload_disk_hits: int = 0
    offload_disk_saved_bytes: int = 0
    offload_disk_loaded_bytes: int = 0
    offload_disk_blocks: int = 0
    offload_disk_capacity_blocks: int = 0
    loop_busy_seconds: float = 0.0  # LoopTimes
    loop_emit_seconds: float = 0.0
    loop_idle_seconds: float = 0.0


def snapshot(engine: "LLMEngine") -> EngineStats:
    """O(running + waiting) work: cheap enough to run after every step."""
    bm, sched, lat = engine.block_manager, engine.scheduler, engine.latency_stats
    running = {s.request.request_id for s in sched.running}
    waiting = ({s.request.request_id for s in sched.waiting} | set(engine.structured_output_manager.waiting)) - running
    free = bm.num_free_blocks  # every block with ref_count 0 sits in the free queue (cached-free ones too)
    return EngineStats(
        num_requests_running=len(running), num_requests_waiting=len(waiting),
        kv_cache_usage_perc=(bm.num_blocks - free) / bm.num_blocks, num_free_blocks=free, num_blocks=bm.num_blocks,
        prefix_cache_queries=bm.prefix_cache_queries, prefix_cache_hits=bm.prefix_cache_hits,
        num_preemptions=sched.num_preemptions, prompt_tokens=engine.num_prompt_tokens,
        generation_tokens=engine.num_generation_tokens, num_steps=engine.num_steps,
        histograms={name: h.copy() for name, h in lat.histograms.items()},
        request_success=dict(lat.request_success), timestamp=time.time(), loop_busy_seconds=engine.loop_times.busy,
        loop_emit_seconds=engine.loop_times.emit, loop_idle_seconds=engine.loop_times.idle,
        **offload_figures(bm.offload))


def offload_figures(tier: "OffloadTier | None") -> dict[str, int]:
    if tier is None:
        return {}
    st, block = tier.stats, tier.block_bytes
    return dict(offload_queries=st.queries, offload_hits=st.hits, offload_saved_bytes=st.saved_blocks * block,
                offload_loaded_bytes=st.loaded_blocks * block, offload_blocks=len(tier),
                offload_capacity_blocks=tier.num_slots, offload_disk_queries=st.disk_queries,
                offload_disk_hits=st.disk_hits, offload_disk_saved_bytes=st.spilled_blocks * block,
                offload_disk_loaded_bytes=st.fetched_blocks * block,
                offload_disk_blocks=len(tier.disk) if tier.disk is not None else 0,
                offload_disk_capacity_blocks=tier.disk.capacity if tier.disk is not None else 0)


def idle(stats: EngineStats) -> EngineStats:
    """`stats` with nothing running or waiting and every block free: what a core process that died left behind."""
    return dataclasses.replace(stats, num_requests_running=0, num_requests_waiting=0, kv_cache_usage_perc=0.0,
                               num_free_blocks=stats.num_blocks, timestamp=time.time())
