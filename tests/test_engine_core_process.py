"""The engine core in its own process: what only that mode has (a pipe, a child that can die, be restarted or fail to
Everything both modes share runs in both through the parametrized fixtures of test_async_engine and test_gateway."""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import threading
import time

import pytest

from kvgate.engine import SamplingParams
from kvgate.engine.async_engine import AsyncEngineArgs, AsyncLLMEngine, EngineDeadError
from kvgate.engine.core_process import RestartBudget
from kvgate.engine.sampling_params import RequestOutputKind

LONG = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=400, output_kind=RequestOutputKind.DELTA)
SHORT = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4)


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
    eng = start(tiny_llama, on_engine_core_death="exit")

    async def main() -> None:
        gen = eng.generate([5, 6, 7], LONG, "doomed")
        await gen.__anext__()
        eng._process.kill()  # SIGKILL: as if the kernel's OOM killer took it
        with pytest.raises(EngineDeadError, match="exited"):  # the stream ends with an error, it does not hang
            for _ in range(3):  # (after what reached it before the kill, if anything)
                await asyncio.wait_for(gen.__anext__(), timeout=30)
        with pytest.raises(EngineDeadError):
            async for _ in eng.generate([5], LONG, "after"):
                pass

    try:
        asyncio.run(main())
        assert eng.is_dead and eng.num_requests == 0 and "not restarted (on_engine_core_death is exit)" in eng.death
        assert eng.stats.num_requests_running == 0 and eng.stats.num_free_blocks == eng.stats.num_blocks
    finally:
        eng.shutdown()


def test_a_killed_core_process_is_restarted_within_its_budget(tiny_llama: str) -> None:
    died = threading.Event()
    eng = AsyncLLMEngine(AsyncEngineArgs(model=tiny_llama, engine_core_process=True, num_gpu_blocks_override=64,
                                         max_engine_core_restarts=1), on_dead=lambda _: died.set())

    async def main() -> None:
        await eng.wait_until_ready(timeout=120)
        gen = eng.generate([5, 6, 7], LONG, "doomed")
        await gen.__anext__()
        first = eng.core_pid
        os.kill(first, signal.SIGKILL)

        async def until_it_fails() -> None:  # after what reached it before the kill, if anything
            while True:
                await gen.__anext__()

        with pytest.raises(EngineDeadError, match=r"exited \(exit code -9\): restarting it"):
            await asyncio.wait_for(until_it_fails(), timeout=30)
        assert not eng.is_dead and eng.num_requests == 0
        outs = [o async for o in eng.generate([5, 6, 7], SHORT, "after")]  # waits for the new core, then served
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
        assert eng.core_pid != first and eng.num_restarts == 1 and eng.is_ready
        free, total = await eng.call(block_counts)
        assert free == total == 64
        os.kill(eng.core_pid, signal.SIGKILL)  # one restart within 60 s is spent: this death is for good
        assert await asyncio.to_thread(died.wait, 60)
        assert eng.is_dead and "not restarted (1 restarts within 60 s already)" in eng.death
        with pytest.raises(EngineDeadError, match="not restarted"):
            async for _ in eng.generate([5], SHORT, "refused"):
                pass

    try:
        asyncio.run(main())
    finally:
        eng.shutdown()


def test_a_load_failure_in_the_core_process_is_reported(tiny_llama: str) -> None:
    eng = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=tiny_llama, engine_core_process=True,
                                                          kv_cache_memory_bytes=1))
    with pytest.raises(EngineDeadError, match="KV cache budget of 1 bytes holds no block"):
        asyncio.run(eng.wait_until_ready(timeout=120))
    assert eng.is_dead and isinstance(eng.load_error, ValueError)
    assert not [p for p in multiprocessing.active_children() if p.name == "kvgate-engine-core"]  # none left


def test_the_restart_budget_counts_the_restarts_within_its_window() -> None:
    budget = RestartBudget(2, window_s=60.0)
    assert budget.take(0.0) and budget.take(10.0)
    assert not budget.take(59.0) and budget.used == 2  # refused: nothing counted
    assert budget.take(60.5) and budget.used == 2  # the first restart has left the window
    assert budget.spent() == "2 restarts within 60 s already"
    assert not RestartBudget(0).take(0.0) and RestartBudget(0).spent() == "max_engine_core_restarts is 0"


def test_the_core_processs_delta_tuples_make_the_same_outputs(tiny_llama: str) -> None:
    """The core's process streams one-sample DELTA outputs as plain tuples (outputs.DeltaTuple); the API process
    makes RequestOutputs of them equal to the engine's own: text held back while a stop string may form, a stop
    string's end, a shared prefix's cached tokens, an abort's last output. Other kinds stay objects."""
    from sampling_helpers import PROMPTS

    from kvgate.engine import LLM
    from kvgate.engine.outputs import from_delta_tuple

    delta = RequestOutputKind.DELTA
    shared = (PROMPTS[0] * 20)[:40]  # two whole blocks and more
    probe = LLM(tiny_llama, dtype="float32", seed=0).generate([PROMPTS[1]], SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0].text
    stop = probe[len(probe) // 2:len(probe) // 2 + 3]  # a stop string the greedy text meets halfway

    def run(delta_tuples: bool) -> list:
        engine = LLM(tiny_llama, dtype="float32", seed=0).engine
        engine.output_prompts, engine.delta_tuples = False, delta_tuples
        reqs = [("plain", shared, SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, output_kind=delta)),
                ("stop", PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind=delta,
                                                    stop=[stop])),
                ("n2", PROMPTS[2], SamplingParams(n=2, temperature=0, max_tokens=3, ignore_eos=True,
                                                  output_kind=delta)),
                ("final", PROMPTS[3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)),
                ("aborted", PROMPTS[4], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True,
                                                       output_kind=delta))]
        for rid, prompt, sp in reqs:
            engine.add_request(rid, {"prompt_token_ids": prompt}, sp)
        got, steps = [], 0
        while engine.has_unfinished_requests():
            outs = engine.step()
            got += outs
            steps += 1
            if steps == 4:
                got += engine.abort_request("aborted")
            if any((o[0], o[6]) == ("plain", True) if isinstance(o, tuple) else (o.request_id, o.finished)
                   == ("plain", True) for o in outs):  # its prompt's blocks are in the prefix cache now
                engine.add_request("prefix", {"prompt_token_ids": shared + [7, 8]}, SamplingParams(
                    temperature=0, max_tokens=3, ignore_eos=True, output_kind=delta))
        kinds = {type(o).__name__ for o in got}
        assert kinds == ({"tuple", "RequestOutput"} if delta_tuples else {"RequestOutput"}), kinds
        outs = [from_delta_tuple(o) if isinstance(o, tuple) else o for o in got]
        for o in outs:
            assert set(o.metrics) <= {"arrival_time", "first_token_time"} and "arrival_time" in o.metrics
            o.metrics = {k: 0 for k in o.metrics}  # times of day differ between the runs
        return outs

    objects, tuples = run(False), run(True)
    assert tuples == objects
    last = {o.request_id: o for o in objects}
    assert last["prefix"].num_cached_tokens == 32 and last["aborted"].outputs[0].finish_reason == "abort"
    assert last["stop"].outputs[0].stop_reason == stop and stop not in "".join(
        o.outputs[0].text for o in objects if o.request_id == "stop")


def core_texts(engine) -> dict[str, tuple[bool, str]]:
    return {rid: (r.sampling_params.detokenize, r.seqs[0].text) for rid, r in engine.requests.items()}


def test_api_processes_sharing_a_core_detokenize_what_needs_no_stop_string(tiny_llama: str) -> None:
    """With the core serving several API processes, a request without stop strings reaches the core with
    detokenize=False and its text is made in its API process: the same outputs as an engine that detokenizes. A
    request with stop strings is detokenized by the core, which matches them on the text; so is every request of a
    core that serves one API process."""
    from sampling_helpers import PROMPTS

    from kvgate.engine import LLM

    delta = RequestOutputKind.DELTA
    kinds = [SamplingParams(temperature=1.0, seed=3, max_tokens=20, ignore_eos=True, output_kind=delta),
             SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=20, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[PROMPTS[2][0]],
                            skip_special_tokens=False, output_kind=delta)]
    offline = LLM(tiny_llama, seed=0)
    want = [[(c.index, c.text, c.finish_reason) for c in offline.generate([{"prompt_token_ids": p}], sp)[0].outputs]
            for p, sp in zip(PROMPTS, kinds)]
    assert any(text for w in want for _, text, _ in w)

    async def outputs(eng: AsyncLLMEngine, i: int, sp: SamplingParams) -> list:
        texts: dict[int, str] = {}
        async for o in eng.generate({"prompt_token_ids": PROMPTS[i]}, sp, f"q{i}"):
            for c in o.outputs:
                texts[c.index] = texts.get(c.index, "") + c.text if sp.output_kind is delta else c.text
        return [(c.index, texts[c.index], c.finish_reason) for c in o.outputs]

    async def main(eng: AsyncLLMEngine) -> tuple[list, dict]:
        long = eng.generate([5, 6, 7], LONG, "long")
        stopped = eng.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True,
                                                         stop=["never said"], output_kind=delta), "stopped")
        await long.__anext__(), await stopped.__anext__()
        seen = await eng.call(core_texts)
        await long.aclose(), await stopped.aclose()
        return await asyncio.gather(*(outputs(eng, i, sp) for i, sp in enumerate(kinds))), seen

    shared = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=tiny_llama, engine_core_process=True, seed=0),
                                             clients=2)
    try:
        asyncio.run(shared.wait_until_ready(timeout=120))
        shared.shared_core.clients[0].close()  # the other API process's pipe: that client leaves at once
        got, seen = asyncio.run(main(shared))
        assert seen["0/long"] == (False, "")  # the core made no text
        assert seen["0/stopped"][0] is True and seen["0/stopped"][1]  # it matches stop strings on its own text
        assert got == want
    finally:
        shared.shutdown()
    single = start(tiny_llama, seed=0)
    try:
        got, seen = asyncio.run(main(single))
        assert seen["long"][0] is True and seen["long"][1]  # one API process: the core makes the text
        assert got == want
    finally:
        single.shutdown()


def test_one_core_serves_two_api_processes_pipes(tiny_llama: str) -> None:
    """kvgate serve --api-server-count 2's core: two engines on two pipes of one core process (here both in this
    process). The same request id on both stays two requests; each gets only its own outputs; one leaving aborts
    its requests and the other keeps serving; the core's death kills both, with no restart."""
    from kvgate.engine import LLM
    from kvgate.engine.core_process import CoreProcess

    first = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=tiny_llama, engine_core_process=True), clients=2)
    asyncio.run(first.wait_until_ready(timeout=120))
    shared = first.shared_core
    assert shared is not None and len(shared.clients) == 1
    second = AsyncLLMEngine(first.args, core=CoreProcess(None, shared.clients[0], shared.config, shared.stats, None))
    asyncio.run(second.wait_until_ready(timeout=60))
    assert second.in_process and second.core_pid is None and second.tokenizer is not None
    prompts = {first: [5, 6, 7, 8], second: [9, 10, 11]}
    offline = LLM(tiny_llama)
    want = {e: offline.generate([{"prompt_token_ids": p}], SHORT)[0].outputs[0].token_ids for e, p in prompts.items()}

    async def tokens(eng: AsyncLLMEngine, rid: str, params: SamplingParams = SHORT) -> list[int]:
        out = []
        async for o in eng.generate(prompts[eng], params, rid):
            out = o.outputs[0].token_ids
        return list(out)

    async def both() -> tuple[list[int], list[int]]:
        return await asyncio.gather(tokens(first, "same"), tokens(second, "same"))

    assert asyncio.run(both()) == [want[first], want[second]]
    deadline = time.monotonic() + 10  # the idle core sends its latest stats to both (throttled while it steps)
    while first.stats.generation_tokens != second.stats.generation_tokens or first.stats.num_requests_running or \
            second.stats.num_requests_running:
        assert time.monotonic() < deadline, (first.stats, second.stats)
        time.sleep(0.01)
    assert first.stats.generation_tokens == 2 * SHORT.max_tokens

    async def second_leaves_midway() -> tuple[list[str], int, int]:
        gen = second.generate(prompts[second], LONG, "long")
        await gen.__anext__()
        second.shutdown()  # its pipe closes: the core aborts what it had in flight
        with pytest.raises(EngineDeadError):
            async for _ in gen:
                pass
        assert await tokens(first, "after") == want[first]  # the first one is served as before
        free, total = await first.call(block_counts)
        return await first.call(running_ids), free, total

    running, free, total = asyncio.run(second_leaves_midway())
    assert running == [] and free == total
    assert first._process.is_alive()  # the core stops only with its last client

    os.kill(first.core_pid, signal.SIGKILL)
    first._thread.join(30)
    assert first.is_dead and "not restarted (it served several API processes)" in first.death
    first.shutdown()


def running_ids(e) -> list[str]:
    return list(e.requests)
