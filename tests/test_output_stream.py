"""RequestOutputStream: unread DELTA outputs merge into one, other kinds replace, errors end the stream; a
consumer that falls behind the engine reads fewer, bigger outputs and still gets every token."""
from __future__ import annotations

import asyncio

from tiny_models import random_prompts

from kvgate.engine import LLM, SamplingParams
from kvgate.engine.async_engine import AsyncEngineArgs, AsyncLLMEngine
from kvgate.engine.output_stream import RequestOutputStream
from kvgate.engine.outputs import CompletionOutput, Logprob, RequestOutput
from kvgate.engine.sampling_params import RequestOutputKind


def out(samples: list[tuple[int, str, list[int]]], finished: bool = False, reason: str | None = None) -> RequestOutput:
    return RequestOutput("r", None, [1, 2], [CompletionOutput(i, text, ids, -1.0 * len(ids),
                                                              [{t: Logprob(-0.5)} for t in ids],
                                                              reason if finished else None) for i, text, ids in samples],
                         finished)


def test_delta_outputs_merge_until_read() -> None:
    async def main() -> None:
        s = RequestOutputStream(asyncio.get_running_loop(), delta=True)
        s.push(out([(0, "a", [1]), (1, "x", [7])]))
        s.push(out([(0, "b", [2])]))  # sample 1 had nothing new this step
        s.push(out([(0, "c", [3]), (1, "y", [8])], finished=True, reason="length"))
        got = await s.get()
        assert got.finished
        a, b = got.outputs
        assert (a.index, a.text, a.token_ids, a.finish_reason) == (0, "abc", [1, 2, 3], "length")
        assert (b.index, b.text, b.token_ids) == (1, "xy", [7, 8])
        assert [list(e) for e in a.logprobs] == [[1], [2], [3]]
        s.push(out([(0, "d", [4])]))
        assert (await s.get()).outputs[0].text == "d"  # read outputs are not merged again

    asyncio.run(main())


def test_cumulative_outputs_replace_and_errors_end_the_stream() -> None:
    async def main() -> None:
        s = RequestOutputStream(asyncio.get_running_loop(), delta=False)
        s.push(out([(0, "a", [1])]))
        s.push(out([(0, "ab", [1, 2])]))
        assert (await s.get()).outputs[0].token_ids == [1, 2]
        s.push(ValueError("bad"))
        s.push(out([(0, "abc", [1, 2, 3])]))
        try:
            await s.get()
        except ValueError as e:
            assert str(e) == "bad"
        else:
            raise AssertionError("the error was lost")

    asyncio.run(main())


def test_slow_consumer_reads_merged_outputs_with_every_token(tiny_llama: str) -> None:
    """A reader that stops after its first output until the engine has produced every token gets the rest in
    one read, token for token what the offline engine gives."""
    prompt = random_prompts(1, seed=4, min_len=5, max_len=20)[0]
    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=24, output_kind=RequestOutputKind.DELTA)
    want = LLM(tiny_llama).generate([prompt], sp)[0].outputs[0]
    eng = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=tiny_llama))

    async def main() -> list[RequestOutput]:
        reads = []
        async for o in eng.generate(prompt, sp, "slow"):
            reads.append(o)
            while eng.stats.generation_tokens < 24:  # the engine runs on; this reader does not read
                await asyncio.sleep(0.01)
        return reads

    try:
        reads = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        eng.shutdown()
    assert len(reads) == 2 and reads[-1].finished
    assert [t for r in reads for t in r.outputs[0].token_ids] == want.token_ids
    assert "".join(r.outputs[0].text for r in reads) == want.text
