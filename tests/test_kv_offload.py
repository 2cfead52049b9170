"""The KV offload tier (engine/kv_offload/): a block's round trip device -> CPU -> device is bit-exact, the
BlockManager saves what its prefix cache evicts and loads it back on a later hit, block digests are the same in
every process, and the engine's greedy tokens are the same with and without the tier when the working set is
many times the device's pool (at TP=1 and TP=2), and a request whose blocks are being loaded waits while the
others run (loads aside)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import httpx

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.engine import LLM, SamplingParams
from kvgate.engine.block_manager import BlockManager, block_digest
from kvgate.engine.kv_offload import AWAIT, LOAD, MARK, SAVE, OffloadStore, OffloadTier
from kvgate.engine.memory_monitor import MemoryMonitor
from kvgate.engine.sampling_params import SamplingParams as SP
from kvgate.engine.sequence import Request, Sequence
from tiny_models import assert_engine_idle


def seq_of(tokens: list[int], rid: str = "r") -> Sequence:
    req = Request(rid, None, list(tokens), SP(max_tokens=4))
    req.seqs.append(Sequence(req, 0, list(tokens)))
    return req.seqs[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_block_round_trip_through_the_tier_is_bit_exact(dtype: torch.dtype) -> None:
    kv = torch.randn(3, 2, 8, 4, 2, 16).to(dtype)  # layers, K/V, blocks, block size, heads, head dim
    store, tier = OffloadStore(kv, num_slots=4), OffloadTier(4, "lru")
    original = kv[:, :, 3].clone()
    tier.save(b"k", (1, 2), 3)
    store.apply(tier.take_ops())
    kv[:, :, 3] = torch.randn_like(original)  # the device block is reused
    assert tier.holds(b"k", (1, 2)) and not tier.holds(b"k", (1, 3))
    tier.load(b"k", 6)
    assert tier.ops == [(LOAD, 6, 0)]  # the first free slot held it
    store.apply(tier.take_ops())
    assert torch.equal(kv[:, :, 6].view(torch.uint8), original.view(torch.uint8))


@pytest.mark.parametrize("eviction", ["lru", "arc"])
def test_a_full_tier_never_evicts_a_block_being_loaded(eviction: str) -> None:
    """The room for a newly evicted device block would come from a block whose load is queued (its slot must hold
    it until the load ran): that block stays, and the new one is dropped instead."""
    tier = OffloadTier(2, eviction)
    tier.save(b"a", (1,), 0)
    tier.save(b"b", (2,), 1)
    tier.take_ops()
    tier.save(b"c", (3,), 2, keep=frozenset({b"a", b"b"}))
    assert tier.holds(b"a", (1,)) and tier.holds(b"b", (2,)) and not tier.holds(b"c", (3,))
    assert tier.take_ops() == [] and tier.stats.dropped_blocks == 1 and len(tier.policy) == 2
    tier.save(b"c", (3,), 2)  # nothing kept: the policy's victim goes
    assert len(tier) == 2 and tier.holds(b"c", (3,)) and tier.stats.evicted_blocks == 1


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([SAVE, LOAD]), st.integers(0, 5), st.integers(0, 4)), max_size=30))
def test_batched_copies_equal_the_copies_one_by_one(ops: list[tuple[int, int, int]]) -> None:
    """OffloadStore.apply batches the ops into phases (gathers, scatters, runs of slots); any order of saves and
    loads, blocks and slots reused, ends as running them one at a time would."""
    kv = torch.randn(2, 2, 6, 4, 2, 8)
    store = OffloadStore(kv.clone(), num_slots=5)
    store.slots.copy_(torch.randn_like(store.slots))
    want_kv, want_slots = kv.clone(), store.slots.clone()
    store.kv_cache.copy_(kv)
    for kind, block, slot in ops:
        if kind == SAVE:
            want_slots[slot] = want_kv[:, :, block]
        else:
            want_kv[:, :, block] = want_slots[slot]
    store.apply(ops)
    assert torch.equal(store.kv_cache, want_kv) and torch.equal(store.slots, want_slots)


def test_the_block_manager_saves_what_it_evicts_and_loads_it_on_a_hit() -> None:
    tier = OffloadTier(num_slots=16, eviction="arc")
    bm = BlockManager(num_blocks=4, block_size=4, offload=tier)
    doc = list(range(100, 112))  # 3 full blocks
    a = seq_of(doc + [1], "a")
    assert bm.allocate(a, len(a))
    a.num_computed_tokens = len(a)
    bm.cache_full_blocks(a)
    bm.free(a)
    assert tier.take_ops() == []  # nothing evicted yet
    b = seq_of(list(range(200, 216)), "b")  # 4 blocks: every cached block of a is reused
    assert bm.get_computed_blocks(b) == [] and bm.allocate(b, len(b))
    saves = tier.take_ops()
    assert sorted(op[0] for op in saves) == [SAVE] * 3 and len(tier) == 3
    b.num_computed_tokens = len(b)
    bm.cache_full_blocks(b)
    bm.free(b)
    c = seq_of(doc + [2, 3], "c")  # a's prefix again: all three blocks in the tier now
    hits = bm.get_computed_blocks(c)
    assert len(hits) == 3 and all(isinstance(h, bytes) for h in hits)
    assert bm.allocate(c, len(c), hits)
    ops = tier.take_ops()
    loads = [op for op in ops if op[0] == LOAD]
    assert [op[1] for op in loads] == c.block_table[:3] and c.num_computed_tokens == 12
    # each block reused was holding one of b's: saved before it is overwritten by the load
    assert ops[0][0] == SAVE and ops[1][0] == LOAD and ops[0][1] == ops[1][1] and len(ops) == 3 + 4
    assert bm.prefix_cache_hits == 12 and tier.stats.loaded_blocks == 3 and len(tier) == 7
    assert c.request.num_cached_tokens == 12 and a.request.num_cached_tokens == 0


def test_block_digests_are_the_same_in_every_process() -> None:
    code = ("from kvgate.engine.block_manager import block_digest as d; "
            "print(d(d(None, (1, 2, 3)), (4, 5, 6)).hex())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env=dict(os.environ, PYTHONHASHSEED=seed)).stdout for seed in ("1", "2")}
    assert outs == {block_digest(block_digest(None, (1, 2, 3)), (4, 5, 6)).hex() + "\n"}
    assert block_digest(None, (1, 2)) != block_digest(None, (2, 1)) != block_digest(b"x", (1, 2))


def documents(n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 500, (length,), generator=g).tolist() for _ in range(n)]


@pytest.mark.parametrize("tp,pp,asynchronous", [(1, 1, False), (1, 1, True), (2, 1, False), (1, 2, False)])
def test_greedy_tokens_are_the_same_with_the_tier_when_the_working_set_is_4x_the_pool(tiny_llama: str, tp: int,
                                                                                        pp: int, asynchronous: bool
                                                                                        ) -> None:
    """8 documents of 192 tokens (12 blocks each, 96 in all) over a device pool of 24 blocks, each asked twice
    with different questions: without the tier the second round recomputes every document, with it the documents
    come back from CPU memory, and the tokens are the same (with tensor parallelism each rank moves its heads'
    share of a block; with pipeline stages each its layers', steps in flight; with async scheduling a step's
    copies are queued while the step before still runs)."""
    docs = documents(8, 192)
    rounds = [[d + [7, 8, 9] for d in docs], [d + [10, 11] for d in docs]]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    results = {}
    for tier_gib in (0, 0.01):
        llm = LLM(tiny_llama, num_gpu_blocks_override=24, max_num_seqs=1 if pp == 1 else 2, tensor_parallel_size=tp,
                  pipeline_parallel_size=pp, kv_offloading_size=tier_gib, async_scheduling=asynchronous)
        try:
            outs = [[o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in r], sp)]
                    for r in rounds]
            bm = llm.engine.block_manager
            results[tier_gib] = (outs, bm.prefix_cache_hits, bm.offload)
            stats = MemoryMonitor(llm.engine).get_stats()
            if tier_gib:  # every block of the documents fits the tier: each second-round lookup is a hit
                assert 0 < stats["offload_cpu_used"] <= stats["offload_cpu_capacity"] < 0.011
                assert stats["offload_cpu_blocks"] >= 8 * 11 and stats["offload_cpu_hit_rate"] > 0.4
            else:
                assert stats["offload_cpu_capacity"] == 0 and stats["offload_cpu_hit_rate"] == 0
            assert_engine_idle(llm)
        finally:
            llm.engine.shutdown()
    (plain, plain_hits, none), (tiered, tier_hits, tier) = results[0], results[0.01]
    assert none is None and tiered == plain
    assert tier.stats.loaded_blocks >= 8 * 11 and tier_hits >= plain_hits + 8 * 11 * 16


def _loads_aside_engine(tiny_llama: str, asynchronous: bool, tp: int = 1):
    """An engine with the tier whose document's blocks (12) were evicted to it, its loads aside as on CUDA, each
    step's scheduled requests and offload ops logged. On the CPU the copies are made at once: rank 0 says a load
    batch is done only once the gate is open (or the engine has nothing else to do and waits for it)."""
    llm = LLM(tiny_llama, num_gpu_blocks_override=24, max_num_seqs=4, kv_offloading_size=0.01,
              async_scheduling=asynchronous, tensor_parallel_size=tp)
    engine, sp = llm.engine, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    tier, store, gate = engine.block_manager.offload, engine.runner.offload, {"open": False}
    tier.load_done = lambda ticket, wait=False: (gate["open"] or wait) and store.loaded(ticket, wait)
    doc, *others = documents(3, 192)
    for prompt in [doc + [7, 8, 9], *others]:  # the others evict every block of the document into the tier
        llm.generate([{"prompt_token_ids": prompt}], sp)
    steps: list[tuple[list[str], list[tuple]]] = []
    schedule = engine.scheduler.schedule

    def logged(*a, **kw):
        out = schedule(*a, **kw)
        steps.append(([s.request.request_id for s, _ in out.scheduled], list(tier.ops)))
        return out
    engine.scheduler.schedule = logged
    return llm, doc, gate, steps


def _step(engine, done: dict[str, list[int]], times: int | None = None) -> None:
    """Step the engine `times` times (None: until it is idle), keeping the finished requests' tokens."""
    while engine.has_unfinished_requests() if times is None else (times := times - 1) >= 0:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)


@pytest.mark.parametrize("asynchronous,tp", [(False, 1), (True, 1), (False, 2)])
def test_a_request_whose_blocks_load_waits_while_the_others_run(tiny_llama: str, asynchronous: bool, tp: int
                                                                 ) -> None:
    """A decodes; B, whose 12-block prefix is in the tier, arrives, and C with the same prefix right after it.
    B's blocks are loaded as one batch; B and C (which shares B's blocks still being loaded) wait while A's steps
    run, until rank 0 says the batch is done; their first step waits for that batch (AWAIT), and no step of A's
    does. The tokens are those of an engine without the tier (at TP=2 the MARKs and AWAITs reach the other rank's
    process with the steps)."""
    llm, doc, gate, steps = _loads_aside_engine(tiny_llama, asynchronous, tp)
    engine, done = llm.engine, {}
    tier = engine.block_manager.offload
    long_sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = {"A": list(range(20, 40)), "B": doc + [10, 11], "C": doc + [12]}
    engine.add_request("A", {"prompt_token_ids": prompts["A"]}, long_sp)
    _step(engine, done, 3)
    engine.add_request("B", {"prompt_token_ids": prompts["B"]}, sp)
    engine.add_request("C", {"prompt_token_ids": prompts["C"]}, sp)
    loaded_before, first = tier.stats.loaded_blocks, len(steps)
    _step(engine, done, 6)
    assert [op[0] for op in steps[first][1]].count(LOAD) == 12 and (MARK, 0, b"") not in steps[first][1]
    for ids, ops in steps[first:]:  # (MARK 0 is added when the step's ops are taken)
        assert "A" in ids and "B" not in ids and "C" not in ids and not any(op[0] == AWAIT for op in ops)
    assert tier.loading and {s.loading for s in engine.scheduler.running} == {None, 0}
    gate["open"] = True
    _step(engine, done)
    assert tier.stats.loaded_blocks - loaded_before == 12  # B's prefix, loaded once (C shares it)
    ids, ops = next((ids, ops) for ids, ops in steps if "B" in ids)
    assert "C" in ids and (AWAIT, 0, b"") in ops and tier.ticket == 1 and not tier.loading
    assert_engine_idle(llm)
    llm.engine.shutdown()  # (its ranks' group first: the engine below is one of its own)
    plain = LLM(tiny_llama, num_gpu_blocks_override=24, max_num_seqs=4)
    want = {rid: plain.generate([{"prompt_token_ids": p}], long_sp if rid == "A" else sp)[0].outputs[0].token_ids
            for rid, p in prompts.items()}
    assert done == {rid: list(t) for rid, t in want.items()}


def test_a_request_aborted_while_its_blocks_load_leaves_nothing_behind(tiny_llama: str) -> None:
    """B is aborted while its blocks are being loaded: the next step waits for that load batch before anything may
    reuse the blocks, C (sharing them) still runs once the batch is done, and every block is free at the end."""
    llm, doc, gate, steps = _loads_aside_engine(tiny_llama, False)
    engine, done = llm.engine, {}
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("A", {"prompt_token_ids": list(range(20, 40))}, SamplingParams(max_tokens=8))
    engine.add_request("B", {"prompt_token_ids": doc + [10, 11]}, sp)
    engine.add_request("C", {"prompt_token_ids": doc + [12]}, sp)
    _step(engine, done, 2)
    assert all(ids == ["A"] for ids, _ in steps)  # B and C wait for their load batch
    engine.abort_request("B")
    assert engine.block_manager.offload.ops == [(AWAIT, 0, b"")]  # (MARK 0 went with the first step's ops)
    gate["open"] = True
    _step(engine, done)
    want = LLM(tiny_llama, num_gpu_blocks_override=24).generate([{"prompt_token_ids": doc + [12]}], sp)
    assert done["C"] == list(want[0].outputs[0].token_ids) and "B" not in done
    assert_engine_idle(llm)


def test_a_second_turn_reports_its_cached_tokens_in_usage_the_tier_keeping_them(tiny_llama: str, tmp_path) -> None:
    """`kvgate serve` with a device pool of 24 blocks and the tier: a conversation's first turn, then other traffic
    that evicts every block of it from the device, then the second turn (the first turn's messages and reply
    again, and a new question): its usage says how many prompt tokens came from the cache (the tier here), streamed
    and not; without the tier the same second turn finds none."""
    import openai

    from serve_helpers import free_port, serve

    g = torch.Generator().manual_seed(1)
    words = " ".join(f"w{int(i)}" for i in torch.randint(0, 400, (40,), generator=g))
    first = [{"role": "system", "content": f"Answer from this document: {words}"},
             {"role": "user", "content": "What is the first word?"}]
    cached = {}
    for tier in ("0", "0.01"):
        port = free_port()
        args = [tiny_llama, "--port", str(port), "--served-model-name", "tiny", "--num-gpu-blocks-override", "24",
                "--max-num-seqs", "1", "--kv-offloading-size", tier]
        with serve(args, tmp_path / f"serve-{tier}.log", port) as (base, _):
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
            chat = dict(model="tiny", max_tokens=8, temperature=0)
            r1 = client.chat.completions.create(messages=first, **chat)
            assert r1.usage.prompt_tokens > 100 and r1.usage.prompt_tokens_details.cached_tokens == 0
            for k in range(3):  # other documents: every block of the first turn leaves the device
                client.completions.create(model="tiny", prompt=[(k * 37 + j) % 500 for j in range(300)],
                                          max_tokens=2)
            second = first + [{"role": "assistant", "content": r1.choices[0].message.content},
                              {"role": "user", "content": "And the second?"}]
            r2 = client.chat.completions.create(messages=second, **chat)
            stream = client.chat.completions.create(messages=second, stream=True,
                                                    stream_options={"include_usage": True}, **chat)
            last = list(stream)[-1]
            cached[tier] = (r2.usage.prompt_tokens_details.cached_tokens,
                            last.usage.prompt_tokens_details.cached_tokens, r1.usage.prompt_tokens)
            metrics = httpx.get(f"{base}/metrics", timeout=10).text
            hits = float(re.search(r'^kvgate:kv_offload_cpu_hits_total\{model_name="tiny"\} (\S+)$', metrics,
                                   re.M).group(1))
            assert (hits == cached[tier][0]) if tier != "0" else hits == 0  # the tier's own count agrees
    assert cached["0"][0] == 0  # evicted, and no tier
    with_tier, streamed, first_len = cached["0.01"]
    assert with_tier >= (first_len // 16 - 1) * 16 and with_tier % 16 == 0
    assert streamed >= with_tier  # the streamed repeat finds at least as much (on the device by then)


def test_a_tier_too_small_for_one_block_is_refused_before_anything_loads(tiny_llama: str) -> None:
    from kvgate.engine.arg_utils import ArgError, EngineArgs
    from kvgate.engine.config import EngineConfig
    from serve_helpers import CLI

    with pytest.raises(ArgError, match=r"kv_offloading_size must hold at least one KV block of LlamaForCausalLM "
                                       r"\(\d+ bytes with block_size 16\), got 1e-09 GiB"):
        EngineConfig.from_args(EngineArgs(model=tiny_llama, kv_offloading_size=1e-9))
    EngineConfig.from_args(EngineArgs(model=tiny_llama, kv_offloading_size=1e-9, enable_prefix_caching=False))
    with pytest.raises(ArgError, match="kv_offloading_eviction must be one of"):
        EngineArgs(model=tiny_llama, kv_offloading_eviction="fifo").check()
    r = subprocess.run([*CLI, "serve", tiny_llama, "--kv-offloading-size", "1e-9"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "kv_offloading_size must hold at least one KV block" in r.stderr
