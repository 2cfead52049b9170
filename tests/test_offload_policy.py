"""The KV offload tier's eviction policies (engine/kv_offload/policy.py): LRU, and ARC's scan resistance and
adaptation, with ARC's invariants under random traffic (hypothesis)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.engine.kv_offload.policy import ARCPolicy, LRUPolicy, make_policy


def run(policy, keys) -> list:
    evicted = []
    for k in keys:
        evicted += policy.access(k)
    return evicted


def test_lru_evicts_the_least_recently_used() -> None:
    p = LRUPolicy(2)
    assert run(p, ["a", "b", "a", "c"]) == ["b"]  # a was used again after b
    assert "a" in p and "c" in p and "b" not in p and len(p) == 2
    p.remove("a")
    assert run(p, ["d"]) == [] and len(p) == 2


def test_arc_keeps_frequent_keys_through_a_scan_lru_does_not() -> None:
    hot = ["h1", "h2"]
    scan = [f"s{i}" for i in range(20)]
    for policy, survives in ((ARCPolicy(4), True), (LRUPolicy(4), False)):
        run(policy, hot + hot)  # each hot key twice: frequent (ARC's T2)
        run(policy, scan)  # one pass over 20 keys seen once
        assert all(k in policy for k in hot) is survives, type(policy).__name__
        assert len(policy) == 4


def test_arc_adapts_toward_recency_after_ghost_hits_in_b1() -> None:
    p = ARCPolicy(4)
    assert run(p, ["x", "x", "a", "b", "c", "d"]) == ["a"]  # x frequent; a leaves T1 for the ghost list B1
    assert "a" not in p and "a" in p.b1 and p.p == 0
    evicted = p.access("a")  # a ghost hit: recency would have kept it
    assert p.p > 0 and "a" in p.t2 and len(evicted) == 1 and len(p) == 4


def test_arc_adapts_toward_frequency_after_ghost_hits_in_b2() -> None:
    p = ARCPolicy(2)
    run(p, ["a", "a", "b", "b"])  # both frequent
    p.p = 2.0  # as if recency had been favoured
    run(p, ["c", "d"])  # c evicts from T2 (T1 empty) ... the frequent keys leave for B2
    ghost = next(iter(p.b2))
    p.access(ghost)
    assert p.p < 2.0 and ghost in p.t2


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.lists(st.integers(0, 15), max_size=200), st.sampled_from(["arc", "lru"]))
def test_invariants_under_random_traffic(capacity: int, keys: list[int], name: str) -> None:
    p = make_policy(name, capacity)
    resident: set[int] = set()
    for k in keys:
        evicted = p.access(k)
        assert k in p and k not in evicted
        assert len(set(evicted)) == len(evicted) and set(evicted) <= resident
        resident = (resident | {k}) - set(evicted)
        assert {x for x in range(16) if x in p} == resident and len(p) == len(resident) <= capacity
        if name == "arc":
            assert len(p.t1) + len(p.b1) <= capacity and len(p.t1) + len(p.t2) + len(p.b1) + len(p.b2) <= 2 * capacity
            assert 0 <= p.p <= capacity and not (set(p.t1) | set(p.t2)) & (set(p.b1) | set(p.b2))


def test_bad_policy_names_and_capacities_are_refused() -> None:
    with pytest.raises(ValueError, match="kv_offloading_eviction must be one of lru, arc, got 'fifo'"):
        make_policy("fifo", 4)
    with pytest.raises(ValueError, match="capacity of at least 1, got 0"):
        ARCPolicy(0)
