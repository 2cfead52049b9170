"""The KV offload tier (vLLM's CPU offloading, the seed's LMCache): blocks the device's prefix cache evicts are
copied to CPU memory, and a later prefix lookup that misses on the device finds them there and copies them back
instead of recomputing them.

Two halves, as the blocks themselves:
- OffloadTier (the engine, with the BlockManager): which block contents the tier holds, each in a slot, kept by an
  eviction policy (engine/kv_offload/policy.py: ARC or LRU), and the copies the ranks must make before the next step:
  SAVE (device block -> slot) when a cached block is about to be reused, LOAD (slot -> device block) for a prefix
  hit in the tier. The copies travel in the step's StepInput, in the order they were decided.
- OffloadStore (every rank's ModelRunner): the slots themselves (pinned CPU memory on CUDA), this rank's share of
  each block (its KV heads, its stage's layers), and the copies, queued on the device's stream before the step's
  forward: a SAVE reads a block before the step overwrites it, a LOAD writes one before the step reads it, and the
  host never waits for either.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvgate.engine.kv_offload.policy import make_policy

SAVE, LOAD = 0, 1  # the kinds of copy (engine/kv_offload/store.py runs them)


@dataclass
class OffloadStats:
    queries: int = 0  # prompt tokens looked up in the tier (full blocks the device cache did not hold)
    hits: int = 0  # of those, tokens found there (and loaded)
    saved_blocks: int = 0  # blocks copied into the tier
    loaded_blocks: int = 0  # blocks copied back (prefix hits in the tier)
    evicted_blocks: int = 0  # blocks the policy dropped from the full tier
    dropped_blocks: int = 0  # evicted device blocks not saved: the tier's room was held by blocks being loaded


class OffloadTier:
    def __init__(self, num_slots: int, eviction: str = "arc", block_bytes: int = 0) -> None:
        self.num_slots = num_slots
        self.block_bytes = block_bytes  # one block on every rank together (for the byte counters)
        self.policy = make_policy(eviction, num_slots)
        self.slots: dict[bytes, int] = {}  # block digest -> its slot
        self.token_ids: dict[bytes, tuple[int, ...]] = {}  # compared on a hit, as the device cache does
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.ops: list[tuple[int, int, int]] = []  # (SAVE or LOAD, device block, slot), in order
        self.stats = OffloadStats()

    def __len__(self) -> int:
        return len(self.slots)

    def holds(self, key: bytes, token_ids: tuple[int, ...]) -> bool:
        return key in self.slots and self.token_ids[key] == token_ids

    def save(self, key: bytes, token_ids: tuple[int, ...], block_id: int, keep: frozenset[bytes] = frozenset()
             ) -> None:
        """The device is about to reuse `block_id`, which holds the block `key`: keep a copy (unless the tier holds
        that content already), evicting what the policy says, but never a block of `keep` (about to be loaded: its
        slot must hold it until then); when the policy picks one of those, `key` is not saved."""
        if key in self.slots:
            self.policy.access(key)
            return
        evicted = self.policy.access(key)  # (at most one key, for both policies)
        if any(old in keep for old in evicted):
            self.policy.remove(key)  # undo: back as it was, the kept one now the most recently used
            for old in evicted:
                self.policy.access(old)
            self.stats.dropped_blocks += 1
            return
        for old in evicted:
            self.free_slots.append(self.slots.pop(old))
            del self.token_ids[old]
            self.stats.evicted_blocks += 1
        slot = self.free_slots.pop()
        self.slots[key], self.token_ids[key] = slot, token_ids
        self.ops.append((SAVE, block_id, slot))
        self.stats.saved_blocks += 1

    def load(self, key: bytes, block_id: int) -> None:
        """Copy the block `key` into the device block `block_id` (it stays in the tier too)."""
        self.policy.access(key)
        self.ops.append((LOAD, block_id, self.slots[key]))
        self.stats.loaded_blocks += 1

    def take_ops(self) -> list[tuple[int, int, int]]:
        ops, self.ops = self.ops, []
        return ops
