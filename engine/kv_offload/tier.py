"""The KV offload tier (vLLM's CPU offloading, the seed's LMCache): blocks the device's prefix cache evicts are
copied to CPU memory, and a later prefix lookup that misses on the device finds them there and copies them back
instead of recomputing them.

Two halves, as the blocks themselves:
- OffloadTier (the engine, with the BlockManager): which block contents the tier holds, each in a slot, kept by an
  eviction policy (engine/kv_offload/policy.py: ARC or LRU), and the copies the ranks must make before the next step:
  SAVE (device block -> slot) when a cached block is about to be reused, LOAD (slot -> device block) for a prefix
  hit in the tier. The copies travel in the step's StepInput, in the order they were decided.
  With `loads_aside` (on CUDA) the LOADs run beside the steps, on a stream of their own: the blocks a step queues
  are one load batch (a ticket; MARK records its end on every rank), their request waits, others run, and it runs
  once rank 0's batch is done (`load_done`); its first step AWAITs the ticket on every rank, so that no step waits for
  another request's copies. A request that shares a block still being loaded waits for that ticket too.
- OffloadStore (every rank's ModelRunner): the slots themselves (pinned CPU memory on CUDA), this rank's share of
  each block (its KV heads, its stage's layers), and the copies, queued before the step's forward: a SAVE reads a
  block before the step overwrites it, a LOAD writes one before a step reads it, and the host never waits for either.

With a disk tier below (kv_offloading_disk_dir), a block the full CPU tier evicts is SPILLed to a file on every
rank, and the tier keeps an index of the blocks on disk (its own policy, as big as kv_offloading_disk_size allows,
DELETEing the files it drops). A prefix hit on disk FETCHes the block into a slot (a background read on every
rank); its request waits, others run, until rank 0's read is done (`poll`), and the block is then a CPU hit. With
more than one rank, every rank's read must have arrived intact: once rank 0's has, the next step CONFIRMs the slot
(the ranks gather how their reads went), and a block some rank could not read is recomputed like a missing one.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import AbstractSet, Callable

from kvgate.engine.kv_offload.policy import make_policy

# the ops (engine/kv_offload/store.py runs them): (SAVE, device block, slot), (LOAD, device block, slot),
# (SPILL, slot, block digest), (FETCH, slot, block digest), (DELETE, 0, block digest), (CONFIRM, slot, block digest),
# (MARK, ticket, b""): the LOADs before it are that ticket's batch; (AWAIT, ticket, b""): the next forward waits for it
SAVE, LOAD, SPILL, FETCH, DELETE, CONFIRM, MARK, AWAIT = range(8)
FETCHED_KEPT_S = 60.0  # how long a block read back from disk is kept for the request that asked for it


@dataclass
class OffloadStats:
    queries: int = 0  # prompt tokens looked up in the tier (full blocks the device cache did not hold)
    hits: int = 0  # of those, tokens found there (and loaded)
    saved_blocks: int = 0  # blocks copied into the tier
    loaded_blocks: int = 0  # blocks copied back (prefix hits in the tier)
    evicted_blocks: int = 0  # blocks the policy dropped from the full tier
    dropped_blocks: int = 0  # evicted device blocks not saved: the tier's room was held by blocks being loaded
    disk_queries: int = 0  # prompt tokens looked up on disk (missed on the device and in CPU memory)
    disk_hits: int = 0  # of those, tokens found there (fetched, then loaded)
    spilled_blocks: int = 0  # blocks written to disk
    fetched_blocks: int = 0  # blocks read back from disk intact
    failed_fetches: int = 0  # blocks whose file was missing or corrupt on some rank (recomputed)


class OffloadTier:
    def __init__(self, num_slots: int, eviction: str = "arc", block_bytes: int = 0, disk_blocks: int = 0,
                 on_disk: list[bytes] | None = None, fetch_result: Callable[[int], bool | None] | None = None,
                 disk_broken: Callable[[], bool] = lambda: False,
                 confirm_result: Callable[[int], bool | None] | None = None,
                 load_done: Callable[[int, bool], bool] | None = None) -> None:
        """`load_done(ticket, wait)`: with loads aside, whether rank 0 finished that load batch (waiting for it when
        `wait`); `disk_blocks`: the disk tier's capacity (0: none); `on_disk`: the blocks its files hold already, least
        recently written first; `fetch_result(slot)`: how rank 0's fetch into a slot went (None: still reading);
        `disk_broken()`: rank 0's disk failed a write (no more spills); `confirm_result(slot)`: with several ranks,
        whether every rank's fetch into the slot went well, once a CONFIRM of it ran (None: not yet)."""
        self.num_slots = num_slots
        self.block_bytes = block_bytes  # one block on every rank together (for the byte counters)
        self.policy = make_policy(eviction, num_slots)
        self.slots: dict[bytes, int] = {}  # block digest -> its slot
        self.token_ids: dict[bytes, tuple[int, ...]] = {}  # compared on a hit, as the device cache does
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.ops: list[tuple] = []  # in order
        self.stats = OffloadStats()
        self.disk = make_policy("lru", disk_blocks) if disk_blocks > 0 else None  # the blocks on disk
        self.fetching: dict[bytes, int] = {}  # block digest -> the slot its file is read into (or confirmed in)
        self.confirming: set[bytes] = set()  # of those, read intact on rank 0, the other ranks asked (CONFIRM)
        self.fetched: dict[bytes, float] = {}  # read back and not loaded yet: kept in its slot (since when)
        self.fetch_result, self.disk_broken, self.confirm_result = fetch_result, disk_broken, confirm_result
        self.load_done = load_done
        self.ticket = 0  # the load batch the LOADs queued now belong to
        self.done_through = -1  # every batch up to this one is known to be loaded on rank 0
        self._loads_queued = False
        for key in on_disk or []:
            self._to_disk(key)

    def __len__(self) -> int:
        return len(self.slots)

    def holds(self, key: bytes, token_ids: tuple[int, ...]) -> bool:
        return key in self.slots and self.token_ids[key] == token_ids

    def on_disk(self, key: bytes) -> bool:
        return self.disk is not None and key in self.disk and key not in self.slots

    def save(self, key: bytes, token_ids: tuple[int, ...], block_id: int, keep: AbstractSet[bytes] = frozenset()
             ) -> None:
        """The device is about to reuse `block_id`, which holds the block `key`: keep a copy (unless the tier holds
        that content already), evicting what the policy says, but never a block of `keep` (about to be loaded: its
        slot must hold it until then); when the policy picks one of those, `key` is not saved."""
        if key in self.slots:
            self.policy.access(key)
            return
        slot = self._take_slot(key, token_ids, keep)
        if slot is None:
            self.stats.dropped_blocks += 1
            return
        self.ops.append((SAVE, block_id, slot))
        self.stats.saved_blocks += 1

    def _take_slot(self, key: bytes, token_ids: tuple[int, ...], keep: AbstractSet[bytes]) -> int | None:
        """A slot for `key`, the block the policy evicts for it spilled to disk (if there is a disk tier); None,
        changing nothing, when the policy would evict a block of `keep`, or one fetched and not loaded yet."""
        evicted = self.policy.access(key)  # (at most one key, for both policies)
        if any(old in keep or old in self.fetching or old in self.fetched for old in evicted):
            self.policy.remove(key)  # undo: back as it was, the kept one now the most recently used
            for old in evicted:
                self.policy.access(old)
            return None
        for old in evicted:
            slot = self.slots.pop(old)
            del self.token_ids[old]
            self.free_slots.append(slot)
            self.stats.evicted_blocks += 1
            if self.disk is not None and old not in self.disk and not self.disk_broken():
                self.ops.append((SPILL, slot, old))
                self.stats.spilled_blocks += 1
                self._to_disk(old)
        slot = self.free_slots.pop()
        self.slots[key], self.token_ids[key] = slot, token_ids
        return slot

    def _to_disk(self, key: bytes) -> None:
        for old in self.disk.access(key):  # type: ignore[union-attr]
            self.ops.append((DELETE, 0, old))

    def fetch(self, key: bytes, token_ids: tuple[int, ...], keep: AbstractSet[bytes] = frozenset()) -> bool:
        """Start reading the block `key` from disk into a slot; False when the blocks fetched and not loaded yet
        hold half the slots (the other half stays for the device's evictions and the CPU hits), or when no slot is
        free of blocks about to be loaded (try again later)."""
        if len(self.fetching) + len(self.fetched) >= max(1, self.num_slots // 2):
            return False
        slot = self._take_slot(key, token_ids, keep)
        if slot is None:
            return False
        self.disk.access(key)  # type: ignore[union-attr]
        self.fetching[key] = slot
        self.ops.append((FETCH, slot, key))
        return True

    def poll(self) -> None:
        """Take in the fetches rank 0 finished (with several ranks: that every rank finished intact): an intact block
        is a CPU hit now; a missing or corrupt one is forgotten (and its files deleted on every rank)."""
        now = time.monotonic()
        for key in [k for k, t in self.fetched.items() if now - t > FETCHED_KEPT_S]:
            del self.fetched[key]  # its request went away (aborted): an ordinary CPU block now
        unsent = {op[2] for op in self.ops if op[0] in (FETCH, CONFIRM)}  # (not sent to the ranks yet)
        for key, slot in list(self.fetching.items()):
            if key in unsent:
                continue
            if key in self.confirming:
                ok = self.confirm_result(slot)  # type: ignore[misc]
            else:
                ok = self.fetch_result(slot)  # type: ignore[misc]
                if ok and self.confirm_result is not None:  # the other ranks' reads: asked in the next step
                    self.confirming.add(key)
                    self.ops.append((CONFIRM, slot, key))
                    continue
            if ok is None:
                continue
            del self.fetching[key]
            self.confirming.discard(key)
            if ok:
                self.stats.fetched_blocks += 1
                self.fetched[key] = now  # kept until loaded (its request is about to come back)
                continue
            self.stats.failed_fetches += 1
            self.policy.remove(key)
            self.free_slots.append(self.slots.pop(key))
            del self.token_ids[key]
            self.disk.remove(key)  # type: ignore[union-attr]
            self.ops.append((DELETE, 0, key))

    def load(self, key: bytes, block_id: int) -> None:
        """Copy the block `key` into the device block `block_id` (it stays in the tier too)."""
        self.policy.access(key)
        self.fetched.pop(key, None)
        self.ops.append((LOAD, block_id, self.slots[key]))
        self.stats.loaded_blocks += 1
        self._loads_queued = True

    # ---- loads aside --------------------------------------------------------------------------------------------
    @property
    def loads_aside(self) -> bool:
        return self.load_done is not None

    def loaded(self, ticket: int, wait: bool = False) -> bool:
        """Whether the load batch `ticket` is done on rank 0 (batches end in order)."""
        if ticket <= self.done_through:
            return True
        if ticket >= self.ticket or not self.load_done(ticket, wait):  # type: ignore[misc]
            return False
        self.done_through = ticket
        return True

    def await_loads(self, ticket: int) -> None:
        """The next forward (on every rank) waits for the load batch `ticket`: a request of it runs, or its blocks
        are given back (another step may then overwrite or save them)."""
        if ticket == self.ticket:
            self._mark()  # (queued this step: marked first)
        self.ops.append((AWAIT, ticket, b""))

    @property
    def loading(self) -> bool:
        """Some marked load batch is not known to be done."""
        return self.done_through < self.ticket - 1

    def _mark(self) -> None:
        if self._loads_queued and self.loads_aside:
            self.ops.append((MARK, self.ticket, b""))
            self.ticket += 1
        self._loads_queued = False

    def take_ops(self) -> list[tuple]:
        self._mark()
        ops, self.ops = self.ops, []
        return ops
