"""OffloadStore: every rank's half of the KV offload tier (engine/kv_offload/tier.py decides, this copies): the
slots (pinned CPU memory on CUDA) holding this rank's share of each offloaded block (its KV heads, its stage's
layers), and the SAVE / LOAD copies of a step, queued on the device's stream before the step's forward."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvgate.engine.kv_offload.tier import SAVE


@dataclass
class OffloadStore:
    kv_cache: torch.Tensor  # the runner's [layers, 2, blocks, block_size, kv_heads, head_dim]
    num_slots: int
    slots: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        kv = self.kv_cache
        shape = (self.num_slots, kv.shape[0], kv.shape[1], *kv.shape[3:])
        self.slots = torch.empty(shape, dtype=kv.dtype, pin_memory=kv.is_cuda)

    def apply(self, ops: list[tuple[int, int, int]]) -> None:
        """Run the copies with the effect of running them one by one in order, batched: the ops split into phases
        whose SAVEs may all run before their LOADs (the usual pattern, a block saved and then loaded over, makes one
        phase); per phase one gather of the saved blocks on the device and one scatter of the loaded ones, with one
        host copy per run of consecutive slots."""
        for saves, loads in _phases(ops):
            if saves:
                blocks, slots = zip(*saves)
                staged = self.kv_cache[:, :, list(blocks)].movedim(2, 0).contiguous()  # [n, layers, 2, ...]
                for i, j, first in _slot_runs(slots):
                    self.slots[first:first + j - i].copy_(staged[i:j], non_blocking=True)
            if loads:
                blocks, slots = zip(*loads)
                kv = self.kv_cache
                staged = torch.empty((len(loads), *self.slots.shape[1:]), dtype=kv.dtype, device=kv.device)
                for i, j, first in _slot_runs(slots):
                    staged[i:j].copy_(self.slots[first:first + j - i], non_blocking=True)
                kv.index_copy_(2, torch.tensor(blocks, device=kv.device), staged.movedim(0, 2))


def _phases(ops: list[tuple[int, int, int]]) -> list[tuple[list[tuple[int, int]], list[tuple[int, int]]]]:
    """Split ops into phases of (saves, loads), each (block, slot), such that running a phase's saves, then its
    loads, phase after phase, equals running the ops in order: an op starts a new phase where it would read what a
    load of the phase writes, write what a load of the phase reads, or hit a block or slot the phase uses twice."""
    phases: list[tuple[list[tuple[int, int]], list[tuple[int, int]]]] = []
    saves: list[tuple[int, int]] = []
    loads: list[tuple[int, int]] = []
    saved_slots: set[int] = set()
    loaded_blocks: set[int] = set()
    read_slots: set[int] = set()
    for kind, block, slot in ops:
        if kind == SAVE:
            clash = block in loaded_blocks or slot in read_slots or slot in saved_slots
        else:
            clash = block in loaded_blocks
        if clash:
            phases.append((saves, loads))
            saves, loads = [], []
            saved_slots, loaded_blocks, read_slots = set(), set(), set()
        if kind == SAVE:
            saves.append((block, slot))
            saved_slots.add(slot)
        else:
            loads.append((block, slot))
            loaded_blocks.add(block)
            read_slots.add(slot)
    if saves or loads:
        phases.append((saves, loads))
    return phases


def _slot_runs(slots: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(i, j, first slot) for each run slots[i:j] of consecutive slot numbers."""
    runs, i = [], 0
    for j in range(1, len(slots) + 1):
        if j == len(slots) or slots[j] != slots[j - 1] + 1:
            runs.append((i, j, slots[i]))
            i = j
    return runs
