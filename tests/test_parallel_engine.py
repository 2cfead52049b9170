"""Tensor and pipeline parallelism end to end, in real processes over gloo on this CPU: the engine (rank 0) drives
worker processes through the step messages, every rank loads its slices (and its stage's layers), and the greedy
tokens are transformers' own. Also the serving paths: `kvgate serve --tensor-parallel-size 2`, a two-"node" launch
(`kvgate worker` beside `serve --distributed-executor-backend external_launcher` over env://), a worker killed
under the engine core."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from pathlib import Path

import openai
import pytest

from kvgate.engine import LLM, SamplingParams
from kvgate.engine.arg_utils import ArgError, EngineArgs
from kvgate.engine.async_engine import AsyncEngineArgs, AsyncLLMEngine, EngineDeadError
from kvgate.engine.config import EngineConfig
from serve_helpers import CLI, free_port, serve
from tiny_models import (assert_engine_idle, assert_greedy_close, build_tiny_model, hf_greedy_with_logits,
                         random_prompts)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def greedy(llm: LLM, prompts: list[list[int]], sp: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]


@pytest.mark.parametrize("arch,tp,pp,layers", [
    ("llama3", 2, 1, None),  # an LM head of its own, vocabulary-split
    ("qwen2", 2, 1, None),  # qkv bias
    ("qwen3", 4, 1, None),  # q/k norm; 4 ranks over 2 KV heads: each KV head replicated on two ranks
    ("llama", 1, 2, 3),  # 3 layers on 2 stages (2 + 1); the tied head on the last stage, which has no embedding
    ("llama3", 2, 2, None),  # TP x PP
])
def test_greedy_tokens_are_transformers(tiny_model_dirs: dict[str, str], tmp_path: Path, arch: str, tp: int, pp: int,
                                        layers: int | None) -> None:
    path = tiny_model_dirs[arch] if layers is None else build_tiny_model(tmp_path / arch, arch,
                                                                             num_hidden_layers=layers)
    prompts = random_prompts(6, seed=tp + 10 * pp, max_len=40)
    want, logits = hf_greedy_with_logits(path, prompts, GREEDY.max_tokens)
    llm = LLM(path, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    try:
        world = tp * pp
        assert llm.engine.executor.world_size == world and len(llm.engine.executor.workers) == world - 1
        assert llm.engine.runner.num_kv_heads == max(1, 2 // tp)
        assert llm.engine.runner.num_layers == (2 if layers == 3 else 2 // pp)  # rank 0's stage
        assert_greedy_close(greedy(llm, prompts), want, logits)
        assert_engine_idle(llm)
        workers = llm.engine.executor.workers
    finally:
        llm.engine.shutdown()
    assert [p.returncode for p in workers] == [0] * (world - 1)  # told to stop, not killed


def test_preemption_forks_and_aborts_keep_every_rank_in_step(tiny_llama: str) -> None:
    """A KV cache so small that requests are preempted and recomputed, n=2 samples forked from a prompt, and an
    abort: the runners only ever see step messages, and their copies of the sequences stay those of the engine. With
    two pipeline stages two steps are in flight (each over other sequences), and the outputs are the same."""
    prompts = random_prompts(6, seed=3, min_len=20, max_len=40)
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    forked = SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=10, ignore_eos=True)
    results = {}
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        llm = LLM(tiny_llama, tensor_parallel_size=tp, pipeline_parallel_size=pp, num_gpu_blocks_override=12,
                  max_num_seqs=4)
        engine = llm.engine
        busy: list[int] = []  # steps already in flight when each step started
        start = engine.executor.start
        engine.executor.start = lambda step, *a: busy.append(len(engine.in_flight)) or start(step, *a)  # type: ignore
        try:
            for i, p in enumerate(prompts):
                engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
            engine.add_request("fork", {"prompt_token_ids": prompts[0]}, forked)
            engine.add_request("gone", {"prompt_token_ids": prompts[1]}, sp)
            outs, steps = {}, 0
            while engine.has_unfinished_requests():
                for o in engine.step():
                    if o.finished:
                        outs[o.request_id] = [c.token_ids for c in o.outputs]
                steps += 1
                if steps == 3:
                    engine.abort_request("gone")
                runner_state = engine.runner.state
                state, pending = runner_state.seqs, set(engine.block_manager.freed_seq_ids)
                live = {s.seq_id: s for r in engine.requests.values() for s in r.seqs if s.block_table}
                assert set(state) - pending <= set(live)
                for sid, st in state.items():
                    if sid in live and sid not in pending:
                        seq = live[sid]
                        assert runner_state.block_table(sid) == seq.block_table
                        assert st.token_ids == seq.token_ids[: len(st.token_ids)]
                        assert runner_state.num_tokens[st.row] == len(st.token_ids)
                        assert runner_state.last_token[st.row] == st.token_ids[-1]
                        assert len(seq.token_ids) - len(st.token_ids) <= 1  # at most the token just sampled
            assert engine.scheduler.num_preemptions > 0
            assert max(busy) == pp - 1  # with two stages, a step starts while the last one is still on them
            assert_engine_idle(llm)
            results[tp, pp] = outs
        finally:
            engine.shutdown()
    assert all("gone" not in r for r in results.values())
    assert results[2, 1] == results[1, 1] == results[1, 2]  # preempted, recomputed, forked, seeded alike


def test_dummy_weights_are_the_same_model_at_any_tp_and_pp(tiny_llama: str) -> None:
    """Dummy weights are drawn per parameter, whole, and sliced: TP=2 and PP=2 run the model TP=1 runs."""
    prompts = random_prompts(4, seed=5, max_len=30)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    runs = {}
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        llm = LLM(tiny_llama, load_format="dummy", tensor_parallel_size=tp, pipeline_parallel_size=pp, seed=3)
        try:
            runs[tp, pp] = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]
        finally:
            llm.engine.shutdown()
    for one, two in [*zip(runs[1, 1], runs[2, 1]), *zip(runs[1, 1], runs[1, 2])]:
        for step, (a, b) in enumerate(zip(one.token_ids, two.token_ids)):
            top = sorted((lp.logprob for lp in one.logprobs[step].values()), reverse=True)
            if a != b:  # only where TP=1 itself had a near-tie
                assert top[0] - top[1] < 1e-4, (step, one.token_ids, two.token_ids)
                break
            assert two.logprobs[step][b].logprob == pytest.approx(one.logprobs[step][a].logprob, abs=1e-4)


def test_default_model_gguf_at_tp_3() -> None:
    """SmolLM2-135M (9 heads, 3 KV heads) from its GGUF, split over three ranks: TP=1's tokens."""
    from kvgate.engine.models import gguf as kg

    try:
        path = kg.default_gguf_path()
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        pytest.skip(str(exc))
    prompts = [[1, 504, 3458, 5170, 28, 253, 4514, 30], [1, 1848, 314, 260, 3575, 282, 4649, 47]]
    out = {}
    for tp in (1, 3):
        llm = LLM(path, tensor_parallel_size=tp, max_model_len=256)
        try:
            out[tp] = greedy(llm, prompts, SamplingParams(temperature=0.0, max_tokens=10))
        finally:
            llm.engine.shutdown()
    assert out[3] == out[1]


def test_tensor_parallel_size_is_checked_against_the_model(tiny_llama: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ArgError, match=r"tensor_parallel_size must divide the 4 attention heads, .* got 3"):
        EngineConfig.from_args(EngineArgs(model=tiny_llama, tensor_parallel_size=3))
    with pytest.raises(ArgError, match="distributed_executor_backend uni runs one rank"):
        EngineArgs(model=tiny_llama, tensor_parallel_size=2, distributed_executor_backend="uni").check()
    with pytest.raises(ArgError, match="pipeline_parallel_size must be at most the 2 layers of LlamaForCausalLM, "
                                       "got 3"):
        EngineConfig.from_args(EngineArgs(model=tiny_llama, pipeline_parallel_size=3))
    monkeypatch.setenv("KVGATE_PP_LAYER_PARTITION", "2,1")  # the tiny Llama has 2 layers
    with pytest.raises(ArgError, match=r"pipeline_parallel_size 2, KVGATE_PP_LAYER_PARTITION: the layer partition "
                                       r"'2,1' must give each of the 2 pipeline stages at least one layer, 2 in"):
        EngineConfig.from_args(EngineArgs(model=tiny_llama, pipeline_parallel_size=2))
    r = subprocess.run([*CLI, "serve", tiny_llama, "--pipeline-parallel-size", "2"], capture_output=True, text=True,
                       timeout=120)  # refused before any rank starts: exit status 2, with the reason
    assert r.returncode == 2 and "KVGATE_PP_LAYER_PARTITION: the layer partition '2,1'" in r.stderr
    monkeypatch.delenv("KVGATE_PP_LAYER_PARTITION")
    assert EngineArgs(distributed_executor_backend="external").executor_backend == "external_launcher"
    assert EngineArgs(tensor_parallel_size=2).executor_backend == "mp"


def test_worker_without_a_rendezvous_says_what_is_missing(tiny_llama: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    r = subprocess.run([*CLI, "worker", tiny_llama, "--tensor-parallel-size", "2"], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2
    assert "RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set" in r.stderr


def _chat(base: str) -> str:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x")
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Say hello"}],
                                       max_tokens=8, temperature=0)
    assert r.usage.completion_tokens == 8 or r.choices[0].finish_reason == "stop"
    return r.choices[0].message.content


def test_serve_and_a_two_node_launch_answer_as_one_rank_does(tiny_llama: str, tmp_path: Path) -> None:
    """`kvgate serve --tensor-parallel-size 2` (mp workers), then the launch of two hosts on one: rank 0 serves with
    the external launcher's environment, rank 1 is `kvgate worker`, both from MASTER_ADDR/MASTER_PORT."""
    common = [tiny_llama, "--served-model-name", "tiny", "--engine-core-process"]
    answers = {}
    port = free_port()
    with serve([*common, "--port", str(port)], tmp_path / "tp1.log", port) as (base, _):
        answers["tp1"] = _chat(base)
    port = free_port()
    with serve([*common, "--port", str(port), "--tensor-parallel-size", "2"], tmp_path / "mp.log", port) as (base, _):
        answers["mp"] = _chat(base)
    port, master = free_port(), free_port()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master), WORLD_SIZE="2", LOCAL_RANK="0")
    log = open(tmp_path / "worker.log", "w")
    worker = subprocess.Popen([*CLI, "worker", tiny_llama, "--tensor-parallel-size", "2"],
                              env=dict(env, RANK="1"), stdout=log, stderr=subprocess.STDOUT)
    try:
        with serve([*common, "--port", str(port), "--tensor-parallel-size", "2", "--distributed-executor-backend",
                    "external_launcher"], tmp_path / "head.log", port, env=dict(env, RANK="0")) as (base, _):
            answers["external"] = _chat(base)
        assert worker.wait(60) == 0, (tmp_path / "worker.log").read_text()  # the head's stop ended it too
    finally:
        if worker.poll() is None:
            worker.kill()
        log.close()
    assert answers["mp"] == answers["tp1"] and answers["external"] == answers["tp1"]


def worker_pids(pid: int) -> list[int]:
    """The worker processes that `pid` (the engine core) started, from /proc."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    return [c for c in children if b"kvgate.engine.worker" in Path(f"/proc/{c}/cmdline").read_bytes()]


def test_a_killed_worker_takes_the_engine_core_down_and_it_restarts_whole(tiny_llama: str) -> None:
    eng = AsyncLLMEngine(AsyncEngineArgs(model=tiny_llama, engine_core_process=True, tensor_parallel_size=2,
                                         max_engine_core_restarts=1))
    long = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=400)

    async def main() -> None:
        await eng.wait_until_ready(timeout=120)
        (first,) = worker_pids(eng.core_pid)
        gen = eng.generate([5, 6, 7], long, "doomed")
        await gen.__anext__()
        os.kill(first, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="restarting it"):
            await asyncio.wait_for(gen.__anext__(), timeout=60)
        async def after() -> list:
            return [o async for o in eng.generate([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4), "after")]

        outs = await asyncio.wait_for(after(), 120)  # waits for the new core, then served
        assert outs[-1].finished and eng.num_restarts == 1
        (second,) = worker_pids(eng.core_pid)
        assert second != first

    try:
        asyncio.run(main())
    finally:
        eng.shutdown()


def gone(pid: int) -> bool:
    try:
        return "\nState:\tZ" in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True


def test_a_hung_worker_fails_its_step_after_the_timeout_and_an_idle_one_waits_as_long_as_it_likes(
        tiny_llama: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With KVGATE_EXECUTE_MODEL_TIMEOUT_SECONDS=10: idle for longer than that, the workers still answer; a worker
    stopped (SIGSTOP) mid-stream makes rank 0's all-reduce give up after 10 s, the engine core exits and a new one
    (new workers) serves; the stopped worker went with its core."""
    monkeypatch.setenv("KVGATE_EXECUTE_MODEL_TIMEOUT_SECONDS", "10")
    eng = AsyncLLMEngine(AsyncEngineArgs(model=tiny_llama, engine_core_process=True, tensor_parallel_size=2,
                                         max_engine_core_restarts=1))
    short = SamplingParams(temperature=0.0, max_tokens=4)

    async def served(request_id: str) -> bool:
        outs = [o async for o in eng.generate([5, 6, 7], short, request_id)]
        return outs[-1].finished

    async def main() -> None:
        await eng.wait_until_ready(timeout=120)
        (first,) = worker_pids(eng.core_pid)
        await asyncio.sleep(12)  # idle past the timeout: the wait for the next step has none
        assert await asyncio.wait_for(served("after idle"), 60) and eng.num_restarts == 0
        gen = eng.generate([5, 6, 7], SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4000), "hung")
        await gen.__anext__()
        os.kill(first, signal.SIGSTOP)
        with pytest.raises(EngineDeadError, match="restarting it"):
            while True:
                await asyncio.wait_for(gen.__anext__(), timeout=60)
        assert await asyncio.wait_for(served("after the hang"), 120) and eng.num_restarts == 1
        (second,) = worker_pids(eng.core_pid)
        assert second != first and gone(first)

    try:
        asyncio.run(main())
    finally:
        eng.shutdown()


def test_the_step_timeout_must_be_a_positive_number(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvgate.engine.worker import execute_model_timeout_s

    assert execute_model_timeout_s() == 300.0
    for bad in ("0", "-5", "soon", "nan"):
        monkeypatch.setenv("KVGATE_EXECUTE_MODEL_TIMEOUT_SECONDS", bad)
        with pytest.raises(ValueError, match=f"KVGATE_EXECUTE_MODEL_TIMEOUT_SECONDS must be a number of seconds > 0, "
                                             f"not '{bad}'"):
            execute_model_timeout_s()


def test_pipeline_stages_split_the_layers_evenly_first_stages_taking_the_rest() -> None:
    from kvgate.engine.models.llama import stage_layers

    assert [list(stage_layers(3, 2, s)) for s in range(2)] == [[0, 1], [2]]
    assert [list(stage_layers(5, 3, s)) for s in range(3)] == [[0, 1], [2, 3], [4]]
    assert [list(stage_layers(4, 4, s)) for s in range(4)] == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match="3 pipeline stages need at least as many layers, the model has 2"):
        stage_layers(2, 3, 0)
    assert [list(stage_layers(5, 2, s, "4,1")) for s in range(2)] == [[0, 1, 2, 3], [4]]  # KVGATE_PP_LAYER_PARTITION
    for bad in ("4,2", "5,0", "2,2,1", "a,b"):
        with pytest.raises(ValueError, match=f"the layer partition '{bad}' must give each of the 2 pipeline stages"):
            stage_layers(5, 2, 0, bad)


def test_each_rank_names_its_gpu_with_an_index(tiny_llama: str) -> None:
    """torch.cuda.set_device refuses a device without an index: rank 0 of `--device cuda` is cuda:0, the next cuda:1,
    and counting starts at the configured GPU."""
    import dataclasses

    import torch

    from kvgate.engine.worker import rank_config

    cpu = EngineConfig.from_args(EngineArgs(model=tiny_llama))
    assert rank_config(cpu, 1) is cpu
    for configured, local_rank, expected in (("cuda", 0, "cuda:0"), ("cuda", 1, "cuda:1"), ("cuda:2", 1, "cuda:3")):
        config = dataclasses.replace(cpu, device=torch.device(configured))
        assert rank_config(config, local_rank).device == torch.device(expected)
