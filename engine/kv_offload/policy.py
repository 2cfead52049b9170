"""Which blocks the KV offload tier keeps when it is full: LRU, or ARC (adaptive replacement, Megiddo and Modha,
FAST 2003: a recency list and a frequency list whose split adapts to the workload through ghost lists of keys
recently evicted from each).

A policy tracks keys only (the tier holds the data). `access(key)` says the key is (now) in the tier, inserted or
hit; it returns the keys evicted to make room, in eviction order. A policy never evicts the key just accessed.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Hashable


class LRUPolicy:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"an eviction policy needs a capacity of at least 1, got {capacity}")
        self.capacity = capacity
        self.keys: OrderedDict[Hashable, None] = OrderedDict()  # least recently used first

    def __contains__(self, key: Hashable) -> bool:
        return key in self.keys

    def __len__(self) -> int:
        return len(self.keys)

    def access(self, key: Hashable) -> list[Hashable]:
        if key in self.keys:
            self.keys.move_to_end(key)
            return []
        self.keys[key] = None
        evicted = []
        while len(self.keys) > self.capacity:
            evicted.append(self.keys.popitem(last=False)[0])
        return evicted

    def remove(self, key: Hashable) -> None:
        self.keys.pop(key, None)


class ARCPolicy:
    """T1: keys seen once recently; T2: keys seen at least twice; B1, B2: ghosts (keys only) of what left T1 and T2.
    `p` is T1's target size: a hit in B1 (recency would have kept it) grows it, a hit in B2 shrinks it."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"an eviction policy needs a capacity of at least 1, got {capacity}")
        self.capacity = capacity
        self.p = 0.0
        self.t1: OrderedDict[Hashable, None] = OrderedDict()  # each list: least recently used first
        self.t2: OrderedDict[Hashable, None] = OrderedDict()
        self.b1: OrderedDict[Hashable, None] = OrderedDict()
        self.b2: OrderedDict[Hashable, None] = OrderedDict()

    def __contains__(self, key: Hashable) -> bool:
        return key in self.t1 or key in self.t2

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def access(self, key: Hashable) -> list[Hashable]:
        c, evicted = self.capacity, []
        if key in self.t1 or key in self.t2:  # a hit: now frequent
            (self.t1 if key in self.t1 else self.t2).pop(key)
            self.t2[key] = None
            return evicted
        if key in self.b1:  # recency would have kept it: favour T1
            self.p = min(c, self.p + max(len(self.b2) / len(self.b1), 1))
            self._replace(False, evicted)
            del self.b1[key]
            self.t2[key] = None
            return evicted
        if key in self.b2:  # frequency would have kept it: favour T2
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1))
            self._replace(True, evicted)
            del self.b2[key]
            self.t2[key] = None
            return evicted
        if len(self.t1) + len(self.b1) == c:  # a new key, L1 full
            if len(self.t1) < c:
                self.b1.popitem(last=False)
                self._replace(False, evicted)
            else:
                evicted.append(self.t1.popitem(last=False)[0])  # its ghost is not kept
        elif len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) >= c:
            if len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) >= 2 * c:
                self.b2.popitem(last=False)
            self._replace(False, evicted)  # (only when the tier is full)
        self.t1[key] = None
        return evicted

    def _replace(self, in_b2: bool, evicted: list[Hashable]) -> None:
        """Evict one key, from T1 or T2 as p says, into its ghost list (when the tier is full)."""
        if len(self.t1) + len(self.t2) < self.capacity:
            return
        if self.t1 and (len(self.t1) > self.p or (in_b2 and len(self.t1) == self.p)):
            key = self.t1.popitem(last=False)[0]
            self.b1[key] = None
        else:
            key = self.t2.popitem(last=False)[0]
            self.b2[key] = None
        evicted.append(key)

    def remove(self, key: Hashable) -> None:
        for lst in (self.t1, self.t2, self.b1, self.b2):
            lst.pop(key, None)


POLICIES = {"lru": LRUPolicy, "arc": ARCPolicy}


def make_policy(name: str, capacity: int) -> LRUPolicy | ARCPolicy:
    try:
        return POLICIES[name](capacity)
    except KeyError:
        raise ValueError(f"kv_offloading_eviction must be one of {', '.join(POLICIES)}, got {name!r}") from None
