"""AsyncLLMEngine: concurrent streams, cancellation frees blocks, bad input fails only its caller; with the engine
core on a thread and in its own process (calls into the core are module-level functions, so both can run them)."""
from __future__ import annotations

import asyncio
import time

import pytest
from tiny_models import random_prompts

from kvgate.engine import LLM, SamplingParams
from kvgate.engine.async_engine import AsyncEngineArgs, AsyncLLMEngine
from kvgate.engine.sampling_params import RequestOutputKind

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["core-thread", "core-process"])
def engine(request: pytest.FixtureRequest, tiny_llama: str):
    eng = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=tiny_llama, scheduler_delay=0.05, max_batch_size=8,
                                                          enable_preemption=True, num_gpu_blocks_override=64,
                                                          engine_core_process=request.param == "core-process"))
    yield eng
    eng.shutdown()


def core_state(e) -> tuple[list[str], int, int]:
    """Runs in the engine core: live request ids, free KV blocks, all KV blocks."""
    return list(e.requests), e.block_manager.num_free_blocks, e.block_manager.num_blocks


def priorities(e) -> dict[str, tuple[int, float | None]]:
    return {rid: (req.priority, req.max_batch_delay) for rid, req in e.requests.items()}


async def collect(eng: AsyncLLMEngine, rid: str, prompt, **kw) -> list[int]:
    last = None
    async for out in eng.generate(prompt, SamplingParams(**{**GREEDY, **kw}), rid):
        last = out
    assert last is not None and last.finished
    return last.outputs[0].token_ids


def test_concurrent_streams_match_offline_engine(engine: AsyncLLMEngine, tiny_llama: str) -> None:
    prompts = random_prompts(12, seed=11, min_len=3, max_len=40)

    async def main() -> list[list[int]]:
        return await asyncio.gather(*(collect(engine, f"r{i}", p, max_tokens=12) for i, p in enumerate(prompts)))

    got = asyncio.run(main())
    ref = LLM(tiny_llama).generate(prompts, SamplingParams(**GREEDY, max_tokens=12))
    assert got == [o.outputs[0].token_ids for o in ref]


def test_cancel_mid_stream_aborts_and_frees_blocks(engine: AsyncLLMEngine, tiny_llama: str) -> None:
    async def main() -> tuple[list[str], int, int]:
        seen = 0
        gen = engine.generate([5, 6, 7, 8] * 10, SamplingParams(**GREEDY, max_tokens=400,
                                                                 output_kind=RequestOutputKind.DELTA), "long")
        async for _ in gen:
            seen += 1
            if seen == 3:
                break
        await gen.aclose()  # what a server does when the client disconnects
        assert len(await collect(engine, "after", [9, 10, 11], max_tokens=5)) == 5  # the engine goes on
        return await engine.call(core_state)

    live, free, total = asyncio.run(main())
    assert live == [] and free == total


def test_invalid_request_fails_alone_and_engine_keeps_serving(engine: AsyncLLMEngine) -> None:
    async def main() -> list[int]:
        with pytest.raises(ValueError, match="maximum context length"):
            async for _ in engine.generate([3] * 5000, SamplingParams(max_tokens=4), "too-long"):
                pass
        with pytest.raises(ValueError, match="empty"):
            async for _ in engine.generate([], SamplingParams(max_tokens=4), "empty"):
                pass
        return await collect(engine, "ok", [4, 5, 6], max_tokens=4)

    assert len(asyncio.run(main())) == 4


def test_priority_and_batch_delay_reach_the_scheduler(engine: AsyncLLMEngine) -> None:
    async def main() -> tuple[int, float | None]:
        gen = engine.generate([7, 8, 9], SamplingParams(**GREEDY, max_tokens=50), "p", priority=90,
                              max_batch_delay=0.01)
        await gen.__anext__()
        seen = await engine.call(priorities)
        await gen.aclose()
        return seen["p"]

    assert asyncio.run(main()) == (90, 0.01)


def test_load_failure_is_reported() -> None:
    eng = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model="no/such/model/dir"))

    async def main() -> None:
        await eng.wait_until_ready(timeout=30)

    with pytest.raises(Exception, match="model not found"):
        asyncio.run(main())
    assert eng.is_dead


def test_stats_snapshot_records_request_latencies(engine: AsyncLLMEngine) -> None:
    from kvgate.engine.stats import (E2E_REQUEST_LATENCY, INTER_TOKEN_LATENCY, ITERATION_TOKENS, REQUEST_QUEUE_TIME,
                                     TIME_TO_FIRST_TOKEN, snapshot)

    def moved(a, b) -> dict[str, int]:
        return {k: b.histograms[k].count - a.histograms[k].count for k in b.histograms}

    async def main() -> None:
        await engine.wait_until_ready(timeout=60)
        # an earlier test's aborted request may still be in a step: a call runs after it (commands are FIFO) and
        # its result comes after the stats of every earlier step
        assert (await engine.call(core_state))[0] == []
        before = engine.stats
        t0 = time.perf_counter()
        await asyncio.gather(*(collect(engine, f"s{i}", [3 + i, 4, 5], max_tokens=6) for i in range(4)))
        done = engine.stats  # published before the last outputs went out
        wall = time.perf_counter() - t0
        h = moved(before, done)
        assert h[TIME_TO_FIRST_TOKEN] == 4 and h[INTER_TOKEN_LATENCY] == 4 * 5  # one per later token (n=1)
        assert h[E2E_REQUEST_LATENCY] == h[REQUEST_QUEUE_TIME] == 4
        assert done.request_success["length"] - before.request_success["length"] == 4
        assert done.generation_tokens - before.generation_tokens == 24 and done.num_steps > before.num_steps
        # every step counted once with the tokens it computed: 4 prompts of 3 tokens, then 5 decodes each (the
        # 6th token is sampled, never computed)
        assert h[ITERATION_TOKENS] == done.num_steps - before.num_steps
        iteration = done.histograms[ITERATION_TOKENS].sum - before.histograms[ITERATION_TOKENS].sum
        assert iteration == 4 * 3 + 4 * 5
        loop = {k: getattr(done, k) - getattr(before, k)
                for k in ("loop_busy_seconds", "loop_emit_seconds", "loop_idle_seconds")}
        assert loop["loop_busy_seconds"] > 0 and loop["loop_emit_seconds"] > 0
        assert sum(loop.values()) < wall + 0.05  # seconds of the loop's own clock, within the requests' time
        ttft = done.histograms[TIME_TO_FIRST_TOKEN]
        assert ttft.cumulative()[-1] == (float("inf"), ttft.count) and ttft.sum > 0

        gen = engine.generate([9, 9, 9], SamplingParams(**GREEDY, max_tokens=300), "gone")
        await gen.__anext__()
        await gen.aclose()
        after = await engine.call(snapshot)  # runs in the engine core after the abort
        assert after.request_success["abort"] - done.request_success["abort"] == 1
        assert moved(done, after)[E2E_REQUEST_LATENCY] == 0  # a client that left is not timed
        assert after.num_free_blocks == after.num_blocks and after.num_requests_running == 0

    asyncio.run(main())


def test_a_caller_whose_event_loop_closed_does_not_stop_the_engine(engine: AsyncLLMEngine) -> None:
    loop = asyncio.new_event_loop()
    gen = engine.generate([4, 4, 4], SamplingParams(**GREEDY, max_tokens=300), "orphan")
    loop.run_until_complete(gen.__anext__())
    loop.close()  # no aclose(): the engine keeps producing outputs for a loop that is gone

    async def main() -> tuple[list[int], list[str], int, int]:
        tokens = await asyncio.wait_for(collect(engine, "next", [5, 6], max_tokens=4), timeout=60)
        return tokens, *await engine.call(core_state)

    tokens, live, free, total = asyncio.run(main())
    assert len(tokens) == 4 and live == [] and free == total  # the orphan was aborted, its blocks freed


def test_two_engines_step_at_once_in_one_process(tiny_model_dirs: dict[str, str]) -> None:
    """Each engine thread has its own forward context: two models stepping together never see each other's."""
    prompts = random_prompts(8, seed=21, min_len=20, max_len=60)
    names = ["llama", "qwen3"]
    engines = [AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=tiny_model_dirs[n], max_batch_size=8))
               for n in names]

    async def main() -> list[list[list[int]]]:
        async def run(i: int) -> list[list[int]]:
            return await asyncio.gather(*(collect(engines[i], f"e{i}-{j}", p, max_tokens=16)
                                          for j, p in enumerate(prompts)))
        return await asyncio.gather(run(0), run(1))

    try:
        got = asyncio.run(main())
    finally:
        for e in engines:
            e.shutdown()
    for name, ids in zip(names, got):
        ref = LLM(tiny_model_dirs[name]).generate(prompts, SamplingParams(**GREEDY, max_tokens=16))
        assert ids == [o.outputs[0].token_ids for o in ref], name
