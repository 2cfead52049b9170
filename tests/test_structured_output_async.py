"""Guided decoding through AsyncLLMEngine, with the engine core on a thread and in its own process (where
StructuredOutputsParams crosses the pipe): valid output, an invalid spec fails its own stream with a ValueError while
the others finish, a request whose grammar compiles while nothing else runs is woken, nothing is left behind."""
from __future__ import annotations

import asyncio
import json
import pickle

import jsonschema
import pytest

from kvgate.engine import SamplingParams
from kvgate.engine.async_engine import AsyncEngineArgs, AsyncLLMEngine
from kvgate.engine.structured_output import StructuredOutputsParams

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module", params=["core-thread", "core-process"])
def engine(request: pytest.FixtureRequest, tiny_llama: str):
    eng = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=tiny_llama, max_batch_size=8,
                                                          num_gpu_blocks_override=64,
                                                          engine_core_process=request.param == "core-process"))
    yield eng
    eng.shutdown()


def core_state(e) -> tuple[list[str], int, int, int, int]:
    """Runs in the engine core: live request ids, free and all KV blocks, guided requests waiting and active."""
    so = e.structured_output_manager
    return list(e.requests), e.block_manager.num_free_blocks, e.block_manager.num_blocks, len(so.waiting), \
        len(so.active)


async def final_text(eng: AsyncLLMEngine, rid: str, sp: SamplingParams) -> str:
    last = None
    async for out in eng.generate("Person:", sp, rid):
        last = out
    assert last is not None and last.finished
    return last.outputs[0].text


def test_params_pickle() -> None:
    sp = SamplingParams(structured_outputs=StructuredOutputsParams(json=PERSON))
    assert pickle.loads(pickle.dumps(sp)) == sp


def test_guided_requests_through_the_async_engine(engine: AsyncLLMEngine) -> None:
    async def main() -> None:
        await engine.wait_until_ready(timeout=120)
        good = [SamplingParams(temperature=1.0, seed=i, max_tokens=30,
                               structured_outputs=StructuredOutputsParams(json=PERSON)) for i in range(3)]
        bad = SamplingParams(max_tokens=30, structured_outputs=StructuredOutputsParams(regex="[a-z"))
        results = await asyncio.gather(*(final_text(engine, f"g{i}", sp) for i, sp in enumerate(good)),
                                       final_text(engine, "bad", bad),
                                       final_text(engine, "plain", SamplingParams(max_tokens=5)),
                                       return_exceptions=True)
        for text in results[:3]:
            jsonschema.validate(json.loads(text), PERSON)
        assert isinstance(results[3], ValueError) and "structured_outputs.regex" in str(results[3])
        assert isinstance(results[4], str)
        # alone in the engine: the core waits for the compilation (not spinning) and is woken when it is ready
        alone = SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=StructuredOutputsParams(
            choice=["north", "south", "east", "west"]))
        assert await final_text(engine, "alone", alone) in ("north", "south", "east", "west")
        assert await engine.call(core_state) == ([], 64, 64, 0, 0)

    asyncio.run(main())
