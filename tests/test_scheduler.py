"""Scheduler: token budget, chunked prefill, priorities (FCFS inside one, aging), preemption, scheduler_delay.

Two drivers: the real engine on the tiny Llama (LLM(...).engine) and a model-free simulation that runs the
Scheduler and BlockManager directly with explicit `now` values, so that aging and batching windows need no
sleeps.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from kvgate.engine.block_manager import BlockManager
from kvgate.engine.llm import LLM
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.scheduler import Scheduler, SchedulerOutput
from kvgate.engine.sequence import Request, Sequence, SequenceStatus
from tiny_models import load_hf_model

BS = 16


def greedy(max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def prompts(n: int, seed: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


# ---- a model-free driver ------------------------------------------------------------------------------------------
class Sim:
    """Runs the Scheduler like the engine does, but 'computes' without a model: every sampled token is 7."""

    def __init__(self, num_blocks: int = 64, **kw) -> None:
        kw.setdefault("max_num_seqs", 4)
        kw.setdefault("max_num_batched_tokens", 256)
        kw.setdefault("max_model_len", num_blocks * BS)
        kw.setdefault("priority_aging_rate", 0.0)
        self.bm = BlockManager(num_blocks, BS)
        self.sched = Scheduler(self.bm, **kw)
        self.finished: list[str] = []
        self.seqs: dict[str, Sequence] = {}

    def add(self, rid: str, prompt_len: int = 20, max_tokens: int = 4, priority: int = 50, arrival: float = 0.0,
            max_batch_delay: float | None = None) -> Sequence:
        ids = [3 + (hash((rid, i)) % 500) for i in range(prompt_len)]
        req = Request(rid, None, ids, greedy(max_tokens), priority, max_batch_delay, arrival_time=arrival)
        seq = Sequence(req, 0, list(ids))
        req.seqs.append(seq)
        self.seqs[rid] = seq
        self.sched.add(seq)
        return seq

    def step(self, now: float) -> SchedulerOutput:
        out = self.sched.schedule(now=now)
        assert out.num_batched_tokens <= self.sched.max_num_batched_tokens
        assert len(self.sched.running) <= self.sched.max_num_seqs
        for seq, _ in out.scheduled:  # the scheduler counted the step's tokens as computed already
            self.bm.cache_full_blocks(seq)
            if seq.num_computed_tokens == len(seq):
                seq.token_ids.append(7)
                if seq.num_output_tokens >= seq.request.sampling_params.max_tokens:
                    self.sched.finish(seq, "length")
                    self.finished.append(seq.request.request_id)
        return out

    def run(self, now: float = 0.0, dt: float = 0.0, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return
            self.step(now)
            now += dt
        raise AssertionError(f"not done after {max_steps} steps: {self.sched.running} {self.sched.waiting}")


def rids(out: SchedulerOutput) -> list[str]:
    return [s.request.request_id for s, _ in out.scheduled]


# ---- engine helpers -------------------------------------------------------------------------------------------------
def record_schedules(engine) -> list[dict]:
    """Wrap engine.scheduler.schedule to log each step: (request id, new tokens, was a decode) and #running."""
    log: list[dict] = []
    sched = engine.scheduler
    orig = sched.schedule

    def wrapped(now: float | None = None, **kw) -> SchedulerOutput:
        out = orig(now, **kw)
        log.append({
            "items": [(s.request.request_id, n, i < out.num_decodes) for i, (s, n) in enumerate(out.scheduled)],
            "running": len(sched.running),
            "preempted": [s.request.request_id for s in out.preempted],
        })
        return out

    sched.schedule = wrapped
    return log


def run_engine(engine, max_steps: int = 5000) -> tuple[list[str], dict]:
    """Step until idle; return request ids in completion order and the final outputs."""
    order, final = [], {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return order, final
        for out in engine.step():
            if out.finished:
                assert out.request_id not in final
                order.append(out.request_id)
                final[out.request_id] = out
    raise AssertionError(f"engine not idle after {max_steps} steps: running={engine.scheduler.running} "
                         f"waiting={engine.scheduler.waiting}")


@torch.no_grad()
def assert_same_greedy(model_dir: str, ps: list[list[int]], got: list[list[int]], want: list[list[int]],
                       tol: float = 1e-3) -> None:
    """Equal greedy tokens, except that a sequence may part at a near-tie: a step where transformers' logits of
    the two picks (after the same prefix) differ by at most `tol`; the rest of it is then not compared."""
    assert len(got) == len(want)
    for prompt, g, w in zip(ps, got, want):
        for k, (a, b) in enumerate(zip(g, w)):
            if a != b:
                logits = load_hf_model(model_dir)(torch.tensor([prompt + g[:k]])).logits[0, -1]
                gap = float(logits[b] - logits[a])
                assert abs(gap) <= tol, f"step {k}: {a} != {b} (logit gap {gap:.3g}): {g} != {w}"
                break
        else:
            assert len(g) == len(w), (g, w)


def tokens_of(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def assert_idle_and_clean(engine) -> None:
    bm = engine.block_manager
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


@pytest.fixture(scope="module")
def model(tiny_llama: str) -> str:
    return tiny_llama


# ---- token budget and chunked prefill ---------------------------------------------------------------------------
def test_token_budget_and_seat_limit_per_step(model: str) -> None:
    ps = prompts(8, seed=1, lo=1, hi=60)
    llm = LLM(model, max_num_batched_tokens=16, max_num_seqs=3, num_gpu_blocks_override=64)
    log = record_schedules(llm.engine)
    outs = llm.generate(ps, greedy(10))
    assert log, "nothing was scheduled"
    for entry in log:
        assert sum(n for _, n, _ in entry["items"]) <= 16, entry
        assert len(entry["items"]) <= 3, entry
        assert entry["running"] <= 3, entry
    assert max(sum(n for _, n, _ in e["items"]) for e in log) == 16  # the budget is actually used
    assert all(len(o.outputs[0].token_ids) == 10 for o in outs)
    assert_idle_and_clean(llm.engine)
    # chunking changes nothing in the results
    ref = LLM(model, max_num_seqs=3, num_gpu_blocks_override=64).generate(ps, greedy(10))
    assert_same_greedy(model, ps, tokens_of(outs), tokens_of(ref))


def test_chunked_prefill_splits_a_long_prompt_and_mixes_it_with_decodes(model: str) -> None:
    llm = LLM(model, max_num_batched_tokens=16, max_num_seqs=4, num_gpu_blocks_override=64)
    engine = llm.engine
    log = record_schedules(engine)
    short, long = prompts(2, seed=2, lo=5, hi=5)[0], prompts(1, seed=3, lo=60, hi=60)[0]
    engine.add_request("short", short, greedy(30))
    engine.step()  # the short prompt is prefilled: it decodes from now on
    engine.add_request("long", long, greedy(4))
    _, final = run_engine(engine)
    chunks = [n for e in log for rid, n, dec in e["items"] if rid == "long" and not dec]
    assert sum(chunks) == 60 and len(chunks) >= 4 and max(chunks) <= 16, chunks
    mixed = [e for e in log if any(r == "short" and dec for r, _, dec in e["items"])
             and any(r == "long" and not dec for r, _, dec in e["items"])]
    assert mixed, "no step mixed a decode with a prefill chunk"
    for e in mixed:  # decodes come first in a step
        kinds = [dec for _, _, dec in e["items"]]
        assert kinds == sorted(kinds, reverse=True)
    ref = LLM(model, num_gpu_blocks_override=64).generate([short, long], [greedy(30), greedy(4)])
    assert_same_greedy(model, [short, long], tokens_of([final["short"], final["long"]]), tokens_of(ref))
    assert_idle_and_clean(engine)


def test_without_chunked_prefill_a_prompt_is_never_split(model: str) -> None:
    llm = LLM(model, enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=64,
              max_num_seqs=4, num_gpu_blocks_override=64)
    log = record_schedules(llm.engine)
    ps = prompts(5, seed=4, lo=20, hi=60)
    llm.generate(ps, greedy(3))
    for e in log:
        assert sum(n for _, n, _ in e["items"]) <= 64
    first = {}
    for e in log:
        for rid, n, dec in e["items"]:
            first.setdefault(rid, n)
    assert sorted(first.values()) == sorted(len(p) for p in ps)


def test_sim_budget_is_shared_between_decodes_and_chunks() -> None:
    sim = Sim(max_num_batched_tokens=10, max_num_seqs=3)
    sim.add("a", prompt_len=4, max_tokens=20)
    sim.step(0)
    sim.add("b", prompt_len=30, max_tokens=2)
    out = sim.step(0)
    assert [(s.request.request_id, n) for s, n in out.scheduled] == [("a", 1), ("b", 9)]
    sim.run()
    assert sim.finished == ["b", "a"]


# ---- priorities --------------------------------------------------------------------------------------------------
def test_higher_priority_is_admitted_first_when_saturated(model: str) -> None:
    llm = LLM(model, max_num_seqs=2, num_gpu_blocks_override=64, priority_aging_rate=0.0)
    engine = llm.engine
    ps = prompts(6, seed=5, lo=10, hi=30)
    for i in range(4):
        engine.add_request(f"low{i}", ps[i], greedy(6), priority=20)
    for i in range(2):
        engine.add_request(f"high{i}", ps[4 + i], greedy(6), priority=90)
    order, _ = run_engine(engine)
    assert set(order[:2]) == {"high0", "high1"}, order
    assert order[2:] == ["low0", "low1", "low2", "low3"], order  # FCFS among equals
    assert_idle_and_clean(engine)


def test_higher_priority_arriving_later_overtakes_running_low_priority(model: str) -> None:
    llm = LLM(model, max_num_seqs=2, num_gpu_blocks_override=64, priority_aging_rate=0.0)
    engine = llm.engine
    ps = prompts(5, seed=6, lo=10, hi=30)
    for i in range(3):
        engine.add_request(f"low{i}", ps[i], greedy(12), priority=20)
    engine.step()
    engine.step()  # low0 and low1 run
    assert {s.request.request_id for s in engine.scheduler.running} == {"low0", "low1"}
    engine.add_request("high0", ps[3], greedy(4), priority=90)
    engine.add_request("high1", ps[4], greedy(4), priority=90)
    order, final = run_engine(engine)
    assert set(order[:2]) == {"high0", "high1"}, order
    assert set(order) == {"low0", "low1", "low2", "high0", "high1"}
    assert engine.scheduler.num_preemptions >= 2  # both running low-priority requests made room
    assert all(len(o.outputs[0].token_ids) == (4 if r.startswith("high") else 12) for r, o in final.items())
    assert_idle_and_clean(engine)


def test_fcfs_within_a_priority_and_priority_order_across(model: str) -> None:
    llm = LLM(model, max_num_seqs=1, num_gpu_blocks_override=64, priority_aging_rate=0.0)
    engine = llm.engine
    ps = prompts(7, seed=7, lo=3, hi=20)
    prios = [50, 20, 50, 90, 20, 90, 50]
    for i, (p, prio) in enumerate(zip(ps, prios)):
        engine.add_request(f"r{i}", p, greedy(3), priority=prio)
    order, _ = run_engine(engine)
    assert order == ["r3", "r5", "r0", "r2", "r6", "r1", "r4"]


def test_default_priority_is_50(model: str) -> None:
    llm = LLM(model, max_num_seqs=1, num_gpu_blocks_override=64, priority_aging_rate=0.0)
    engine = llm.engine
    ps = prompts(3, seed=8, lo=3, hi=10)
    engine.add_request("p49", ps[0], greedy(2), priority=49)
    engine.add_request("default", ps[1], greedy(2))
    engine.add_request("p51", ps[2], greedy(2), priority=51)
    order, _ = run_engine(engine)
    assert order == ["p51", "default", "p49"]


def test_aging_lets_an_old_low_priority_request_go_first() -> None:
    for rate, expect in ((2.0, "old_low"), (0.0, "new_high")):
        sim = Sim(max_num_seqs=1, priority_aging_rate=rate)
        sim.add("old_low", priority=20, arrival=0.0)
        sim.add("new_high", priority=90, arrival=50.0)
        # at t=50: 20 + 2*50 = 120 > 90
        assert rids(sim.step(50.0)) == [expect]


def test_aging_prevents_starvation_under_a_stream_of_high_priority_requests() -> None:
    def steps_until_low_finishes(rate: float, max_steps: int = 400) -> int | None:
        sim = Sim(max_num_seqs=1, priority_aging_rate=rate)
        sim.add("low", prompt_len=8, max_tokens=2, priority=0, arrival=0.0)
        for t in range(max_steps):
            now = float(t)
            sim.add(f"high{t}", prompt_len=8, max_tokens=2, priority=100, arrival=now)  # one new each second
            sim.step(now)
            if "low" in sim.finished:
                return t
        return None

    assert steps_until_low_finishes(0.0) is None  # control: without aging it starves
    t = steps_until_low_finishes(5.0)
    assert t is not None and t < 100


def test_engine_aging_with_a_large_rate(model: str) -> None:
    llm = LLM(model, max_num_seqs=1, num_gpu_blocks_override=64, priority_aging_rate=1000.0)
    engine = llm.engine
    ps = prompts(3, seed=9, lo=3, hi=10)
    now = time.monotonic()
    engine.add_request("old_low", ps[0], greedy(2), priority=0, arrival_time=now - 1.0)  # +1000 points
    engine.add_request("high_a", ps[1], greedy(2), priority=100)
    engine.add_request("high_b", ps[2], greedy(2), priority=100)
    order, _ = run_engine(engine)
    assert order[0] == "old_low", order


# ---- preemption -------------------------------------------------------------------------------------------------
def test_preemption_victim_is_the_lowest_priority_newest() -> None:
    sim = Sim(num_blocks=4, max_num_seqs=4)
    sim.add("mid", prompt_len=16, max_tokens=8, priority=50, arrival=0.0)
    sim.add("low_old", prompt_len=16, max_tokens=8, priority=20, arrival=1.0)
    sim.add("low_new", prompt_len=16, max_tokens=8, priority=20, arrival=2.0)
    sim.add("high", prompt_len=16, max_tokens=8, priority=90, arrival=3.0)
    out = sim.step(3.0)  # all four prompts fill the 4 blocks exactly
    assert sorted(rids(out)) == ["high", "low_new", "low_old", "mid"]
    assert sim.bm.num_free_blocks == 0
    out = sim.step(3.0)  # each decode needs a 2nd block: the lowest-priority newest ones go, in that order
    assert [s.request.request_id for s in out.preempted] == ["low_new", "low_old"]
    assert sorted(rids(out)) == ["high", "mid"]
    assert sim.seqs["low_new"].status == SequenceStatus.WAITING
    assert sim.seqs["low_new"].num_computed_tokens == 0 and sim.seqs["low_new"].block_table == []
    assert sim.sched.num_preemptions == 2
    sim.run(3.0)
    assert sim.finished[:2] == ["high", "mid"]
    assert sim.bm.num_free_blocks == 4


def test_preemption_spares_the_highest_priority_request(model: str) -> None:
    llm = LLM(model, max_num_seqs=6, num_gpu_blocks_override=10, max_num_batched_tokens=64,
              priority_aging_rate=0.0)
    engine = llm.engine
    ps = prompts(6, seed=10, lo=20, hi=40)
    for i in range(5):
        engine.add_request(f"r{i}", ps[i], greedy(24), priority=30 + i)
    engine.add_request("vip", ps[5], greedy(24), priority=100)
    vip_seq = engine.requests["vip"].seqs[0]
    _, final = run_engine(engine)
    assert engine.scheduler.num_preemptions > 0
    assert vip_seq.num_preemptions == 0
    vip = final["vip"]
    assert len(vip.outputs[0].token_ids) == 24
    ref = LLM(model, num_gpu_blocks_override=64).generate(ps, greedy(24))
    assert_same_greedy(model, ps, tokens_of([final[f"r{i}"] for i in range(5)] + [vip]), tokens_of(ref))
    assert_idle_and_clean(engine)


def test_preemption_victim_engine_level(model: str) -> None:
    llm = LLM(model, max_num_seqs=6, num_gpu_blocks_override=10, max_num_batched_tokens=64,
              priority_aging_rate=0.0)
    engine = llm.engine
    preempted: list[str] = []
    orig = engine.scheduler._preempt

    def spy(victim: Sequence) -> None:
        # the victim must have the lowest priority of all running sequences, and be the newest of those
        lowest = min(s.priority for s in engine.scheduler.running)
        assert victim.priority == lowest
        newest = max(s.arrival_time for s in engine.scheduler.running if s.priority == lowest)
        assert victim.arrival_time == newest
        preempted.append(victim.request.request_id)
        orig(victim)

    engine.scheduler._preempt = spy
    ps = prompts(6, seed=11, lo=20, hi=40)
    for i, prio in enumerate([60, 20, 60, 20, 40, 90]):
        engine.add_request(f"r{i}", ps[i], greedy(24), priority=prio)
    run_engine(engine)
    assert preempted
    assert "r5" not in preempted
    assert_idle_and_clean(engine)


def test_no_preemption_when_disabled(model: str) -> None:
    llm = LLM(model, max_num_seqs=8, num_gpu_blocks_override=6, max_num_batched_tokens=32,
              enable_preemption=False)
    engine = llm.engine
    log = record_schedules(engine)
    ps = prompts(8, seed=12, lo=5, hi=50)
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, greedy(20), priority=[10, 90][i % 2])
    _, final = run_engine(engine)
    assert engine.scheduler.num_preemptions == 0
    assert not any(e["preempted"] for e in log)
    assert all(len(final[f"r{i}"].outputs[0].token_ids) == 20 for i in range(8))
    ref = LLM(model, num_gpu_blocks_override=64).generate(ps, greedy(20))
    assert_same_greedy(model, ps, tokens_of([final[f"r{i}"] for i in range(8)]), tokens_of(ref))
    assert_idle_and_clean(engine)


def test_no_preemption_when_disabled_with_parallel_sampling(model: str) -> None:
    """n > 1 with preemption off: the forked samples need blocks too, so admission must reserve them.

    Each request (2 samples of 16 prompt + 32 output tokens: 1 shared + 2 + 2 private blocks) fits alone in the
    6-block cache, so a correct scheduler runs them one after the other. If both are admitted, their 4
    sequences each hold 2 blocks and all need a 3rd at the same time: nothing can ever run again.
    """
    llm = LLM(model, max_num_seqs=8, num_gpu_blocks_override=6, enable_preemption=False)
    engine = llm.engine
    for i in range(2):
        engine.add_request(f"r{i}", [10 + i] * 16, greedy(32, n=2))
    _, final = run_engine(engine, max_steps=500)
    assert engine.scheduler.num_preemptions == 0
    assert all(len(o.outputs) == 2 and all(len(c.token_ids) == 32 for c in o.outputs) for o in final.values())
    assert_idle_and_clean(engine)


def test_parallel_sampling_respects_max_num_seqs(model: str) -> None:
    """Each of a request's n samples is a running sequence: two requests with n=3 do not fit 4 seats together."""
    llm = LLM(model, max_num_seqs=4, num_gpu_blocks_override=64)
    engine = llm.engine
    log = record_schedules(engine)
    ps = prompts(2, seed=14, lo=10, hi=20)
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, greedy(5, n=3))
    _, final = run_engine(engine)
    assert all(len(o.outputs) == 3 and all(len(c.token_ids) == 5 for c in o.outputs) for o in final.values())
    assert max(e["running"] for e in log) <= 4, [e["running"] for e in log]
    assert max(len(e["items"]) for e in log) <= 4
    assert_idle_and_clean(engine)


# ---- scheduler_delay ----------------------------------------------------------------------------------------------
def test_sim_scheduler_delay_holds_a_single_request_until_due() -> None:
    sim = Sim(max_num_seqs=4, scheduler_delay=10.0)
    sim.add("a", arrival=0.0)
    out = sim.step(1.0)
    assert out.is_empty and sim.sched.next_wakeup == pytest.approx(10.0)
    sim.add("b", arrival=2.0)
    out = sim.step(9.0)
    assert out.is_empty and sim.sched.next_wakeup == pytest.approx(10.0)  # the earliest deadline
    out = sim.step(10.0)
    assert sorted(rids(out)) == ["a", "b"]  # once one is due, everything waiting goes together
    assert sim.sched.next_wakeup is None


def test_sim_max_batch_delay_caps_the_window() -> None:
    sim = Sim(max_num_seqs=4, scheduler_delay=10.0)
    sim.add("now", arrival=0.0, max_batch_delay=0.0)
    assert rids(sim.step(0.0)) == ["now"]
    sim2 = Sim(max_num_seqs=4, scheduler_delay=10.0)
    sim2.add("soon", arrival=0.0, max_batch_delay=3.0)
    assert sim2.step(1.0).is_empty and sim2.sched.next_wakeup == pytest.approx(3.0)
    assert rids(sim2.step(3.0)) == ["soon"]
    sim3 = Sim(max_num_seqs=4, scheduler_delay=1.0)
    sim3.add("longer_cap", arrival=0.0, max_batch_delay=5.0)  # a cap never extends the window
    assert sim3.step(0.5).is_empty and sim3.sched.next_wakeup == pytest.approx(1.0)


def test_sim_enough_waiting_requests_fill_the_batch_without_waiting() -> None:
    sim = Sim(max_num_seqs=3, scheduler_delay=10.0)
    for r in "abc":
        sim.add(r, arrival=0.0)
    assert sorted(rids(sim.step(0.0))) == ["a", "b", "c"]


def test_sim_preempted_work_is_not_held_again() -> None:
    sim = Sim(num_blocks=2, max_num_seqs=2, scheduler_delay=10.0)
    sim.add("a", prompt_len=16, max_tokens=2, priority=90, arrival=0.0)
    sim.add("b", prompt_len=16, max_tokens=2, priority=20, arrival=0.0)
    assert sorted(rids(sim.step(0.0))) == ["a", "b"]  # two waiting fill the two seats
    out = sim.step(0.0)
    assert [s.request.request_id for s in out.preempted] == ["b"]
    assert sim.finished == ["a"]
    # b waits alone with a free seat, well inside its 10 s window: preempted work is not held again
    assert rids(sim.step(1.0)) == ["b"]
    assert sim.sched.next_wakeup is None


def test_engine_scheduler_delay(model: str) -> None:
    llm = LLM(model, max_num_seqs=3, num_gpu_blocks_override=64, scheduler_delay=10.0)
    engine = llm.engine
    ps = prompts(4, seed=15, lo=3, hi=10)
    engine.add_request("held", ps[0], greedy(2))
    assert engine.step() == []
    assert engine.scheduler.next_wakeup is not None
    assert engine.scheduler.waiting and not engine.scheduler.running
    engine.abort_request("held")

    engine.add_request("capped", ps[1], greedy(2), max_batch_delay=0)
    outs = engine.step()
    assert [o.request_id for o in outs] == ["capped"]
    run_engine(engine)

    log = record_schedules(engine)
    for i in range(3):  # enough to fill max_num_seqs: admitted at once
        engine.add_request(f"fill{i}", ps[1 + i], greedy(2))
    outs = engine.step()
    assert sorted(rid for rid, _, _ in log[-1]["items"]) == ["fill0", "fill1", "fill2"]
    assert sorted(o.request_id for o in outs) == ["fill0", "fill1", "fill2"]
    run_engine(engine)
    assert_idle_and_clean(engine)
