"""The engine core in its own process: what only that mode has (a pipe, a child that can die or fail to load).
Everything both modes share runs in both through the parametrized fixtures of test_async_engine and test_gateway."""
from __future__ import annotations

import asyncio

import pytest

from kvgate.engine import SamplingParams
from kvgate.engine.async_engine import AsyncEngineArgs, AsyncLLMEngine, EngineDeadError
from kvgate.engine.sampling_params import RequestOutputKind

LONG = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=400, output_kind=RequestOutputKind.DELTA)


def start(model: str, **kw) -> AsyncLLMEngine:
    eng = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=model, engine_core_process=True, **kw))
    asyncio.run(eng.wait_until_ready(timeout=120))
    assert eng.in_process and eng.engine is None  # nothing of the engine lives in this process
    return eng


def block_counts(e) -> tuple[int, int]:
    return e.block_manager.num_free_blocks, e.block_manager.num_blocks


def frozen_objects(e) -> int:
    import gc

    return gc.get_freeze_count()


def test_calls_cross_the_pipe_and_shutdown_ends_the_process(tiny_llama: str) -> None:
    eng = start(tiny_llama, num_gpu_blocks_override=64)

    async def main() -> tuple[tuple[int, int], int]:
        with pytest.raises(Exception, match="pickle"):  # a lambda cannot reach another process: said at once
            eng.call(lambda e: e.requests)
        return await eng.call(block_counts), await eng.call(frozen_objects)

    (free, total), frozen = asyncio.run(main())
    assert free == total == 64 and eng.stats.num_blocks == 64
    assert frozen > 10_000  # the core froze its loaded heap: full collections no longer walk torch and the model
    eng.shutdown()
    assert not eng._process.is_alive() and eng._process.exitcode == 0  # stopped through the pipe, not killed
    assert eng.is_dead


def test_a_dead_core_process_fails_its_streams_and_the_engine(tiny_llama: str) -> None:
    eng = start(tiny_llama)

    async def main() -> None:
        gen = eng.generate([5, 6, 7], LONG, "doomed")
        await gen.__anext__()
        eng._process.kill()  # SIGKILL: as if the kernel's OOM killer took it
        with pytest.raises(EngineDeadError, match="exited"):  # the stream ends with an error, it does not hang
            await asyncio.wait_for(gen.__anext__(), timeout=30)
        with pytest.raises(EngineDeadError):
            async for _ in eng.generate([5], LONG, "after"):
                pass

    try:
        asyncio.run(main())
        assert eng.is_dead and eng.num_requests == 0
    finally:
        eng.shutdown()


def test_a_load_failure_in_the_core_process_is_reported(tiny_llama: str) -> None:
    eng = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=tiny_llama, engine_core_process=True,
                                                          kv_cache_memory_bytes=1))
    with pytest.raises(EngineDeadError, match="KV cache budget of 1 bytes holds no block"):
        asyncio.run(eng.wait_until_ready(timeout=120))
    assert eng.is_dead and isinstance(eng.load_error, ValueError)
    eng._process.join(10)
    assert not eng._process.is_alive()
