"""OffloadStore: every rank's half of the KV offload tier (engine/kv_offload/tier.py decides, this copies): the
slots (pinned CPU memory on CUDA) holding this rank's share of each offloaded block (its KV heads, its stage's
layers), and the SAVE / LOAD copies of a step, queued before the step's forward (on CUDA the LOADs on a stream of
their own, beside the steps: a MARK records the end of a load batch, an AWAIT makes the step wait for one); with a
disk tier (engine/kv_offload/disk.py), the SPILLs of slots to files, FETCHes of files into slots and DELETEs of
files, handed to the disk's threads in order, and the CONFIRMs of fetches, where the ranks tell each other how
their reads went."""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import torch

from kvgate.engine.distributed.parallel_state import get_world_group
from kvgate.engine.kv_offload.disk import DiskStore
from kvgate.engine.kv_offload.tier import AWAIT, CONFIRM, DELETE, FETCH, LOAD, MARK, SAVE, SPILL


@dataclass
class OffloadStore:
    kv_cache: torch.Tensor  # the runner's [layers, 2, blocks, block_size, kv_heads, head_dim]
    num_slots: int
    disk_dir: str | None = None  # this rank's directory of the disk tier (None: no disk tier)
    slots: torch.Tensor = field(init=False)
    disk: DiskStore | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        kv = self.kv_cache
        shape = (self.num_slots, kv.shape[0], kv.shape[1], *kv.shape[3:])
        self.slots = torch.empty(shape, dtype=kv.dtype, pin_memory=kv.is_cuda)
        # CUDA: the device -> CPU copies of SAVEs run on a stream of their own, next to the step's forward (which
        # waits only for the gather of the blocks it overwrites); _saved is recorded after the last of them
        self._stream = torch.cuda.Stream(kv.device) if kv.is_cuda else None
        self._saved: torch.cuda.Event | None = None
        # loads aside (CUDA): LOADs on a stream of their own; the end of each load batch (ticket -> event, dropped
        # once a step waited for it), the last ticket marked, and the slots loads may still read (slot -> event)
        self.aside = kv.is_cuda
        self._load_stream = torch.cuda.Stream(kv.device) if kv.is_cuda else None
        self._loaded: dict[int, torch.cuda.Event] = {}
        self._marked = -1
        self._reading: dict[int, torch.cuda.Event] = {}
        self.confirmed: dict[int, bool] = {}  # rank 0: slot -> whether every rank's fetch into it arrived intact
        if self.disk_dir is not None:
            self.disk = DiskStore(self.disk_dir, self.slots)

    def apply(self, ops: list[tuple]) -> None:
        """Run the ops with the effect of running them one by one in order, batched: the ops split into phases
        whose disk ops may run first, then the SAVEs, then the LOADs (the usual pattern, a block saved and then
        loaded over, makes one phase); per phase one gather of the saved blocks on the device and one scatter of the
        loaded ones, with one host copy per run of consecutive slots."""
        for io, saves, loads in _phases(ops):
            for kind, slot, key in io:
                if kind == DELETE:
                    self.disk.delete(key)  # type: ignore[union-attr]
                    continue
                if kind == CONFIRM:
                    continue  # below, together
                if kind == MARK:
                    self._mark(slot)
                    continue
                if kind == AWAIT:
                    self._await(slot)
                    continue
                # the host reads (SPILL) or writes (FETCH) the slot: a read or a SAVE copy still landing there first
                self._settle((slot,))
                if self._saved is not None:
                    self._saved.synchronize()
                if kind == FETCH and slot in self._reading:  # (a LOAD may still read what it overwrites)
                    self._reading.pop(slot).synchronize()
                (self.disk.spill if kind == SPILL else self.disk.fetch)(slot, key)  # type: ignore[union-attr]
            confirms = [slot for kind, slot, _ in io if kind == CONFIRM]
            if confirms:
                self._confirm(confirms)
            if saves:
                blocks, slots = zip(*saves)
                self._settle(slots)
                staged = self.kv_cache[:, :, list(blocks)].movedim(2, 0).contiguous()  # [n, layers, 2, ...]
                self._copy_out(staged, slots)
            if loads:
                self._load(loads)

    def loaded(self, ticket: int, wait: bool = False) -> bool:
        """Rank 0: whether the load batch `ticket` is done (waiting for it when `wait`)."""
        if ticket > self._marked:
            return False
        event = self._loaded.get(ticket)
        if event is None:
            return True  # (a step waited for it, or a later one, already)
        if wait:
            event.synchronize()
        return event.query()

    def _load(self, loads: list[tuple[int, int]]) -> None:
        """Copy slots into device blocks: on CUDA on the load stream, after what the device's stream has queued
        (steps still using the blocks, the gathers of their saves) and the copies of SAVEs into those slots."""
        blocks, slots = zip(*loads)
        self._settle(slots, loading=True)
        kv, stream = self.kv_cache, self._load_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
            if self._saved is not None:
                stream.wait_event(self._saved)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            staged = torch.empty((len(loads), *self.slots.shape[1:]), dtype=kv.dtype, device=kv.device)
            for i, j, first in _slot_runs(slots):
                staged[i:j].copy_(self.slots[first:first + j - i], non_blocking=True)
            kv.index_copy_(2, torch.tensor(blocks, device=kv.device), staged.movedim(0, 2))
            if stream is not None:
                event = torch.cuda.Event()
                event.record()
                self._reading.update((slot, event) for slot in slots)

    def _mark(self, ticket: int) -> None:
        """The LOADs so far are the load batch `ticket`."""
        self._marked = ticket
        if self._load_stream is not None:
            event = torch.cuda.Event()
            event.record(self._load_stream)
            self._loaded[ticket] = event

    def _await(self, ticket: int) -> None:
        """The device's stream waits for the load batch `ticket` (and so for every batch before it)."""
        event = self._loaded.get(ticket)
        if event is not None:
            torch.cuda.current_stream().wait_event(event)
        for t in [t for t in self._loaded if t <= ticket]:
            del self._loaded[t]

    def take_confirmed(self, slot: int) -> bool | None:
        """Rank 0: whether every rank's fetch into `slot` arrived intact (told once; None: not confirmed yet)."""
        return self.confirmed.pop(slot, None)

    def _confirm(self, slots: list[int]) -> None:
        """Every rank says whether its fetch into each slot arrived intact (waiting for its own reads), and rank 0
        keeps the verdicts: a block that some rank could not read is recomputed, and no rank loads it. (Rank 0's own
        results were taken by the tier already: only fetches intact there are confirmed.)"""
        world = get_world_group()
        mine = []
        for slot in slots:
            ok = self.disk.wait(slot)  # type: ignore[union-attr]
            mine.append(ok is True or (world.rank == 0 and ok is None))
        every = world.all_gather_object(mine)
        if world.rank == 0:
            for i, slot in enumerate(slots):
                self.confirmed[slot] = all(flags[i] for flags in every)

    def _copy_out(self, staged: torch.Tensor, slots: tuple[int, ...]) -> None:
        """Copy the gathered blocks into their slots: on CUDA on the copy stream, after the gather, the forward not
        waiting for it (the staged blocks are kept until the copy is done)."""
        if self._stream is None:
            for i, j, first in _slot_runs(slots):
                self.slots[first:first + j - i].copy_(staged[i:j])
            return
        self._stream.wait_stream(torch.cuda.current_stream())
        for event in {id(e): e for e in (self._reading.pop(s, None) for s in slots) if e is not None}.values():
            self._stream.wait_event(event)  # a LOAD still reading the slot
        with torch.cuda.stream(self._stream):
            for i, j, first in _slot_runs(slots):
                self.slots[first:first + j - i].copy_(staged[i:j], non_blocking=True)
            staged.record_stream(self._stream)
            self._saved = torch.cuda.Event()
            self._saved.record()

    def _settle(self, slots: tuple[int, ...], loading: bool = False) -> None:
        """Wait for fetches still filling these slots (on a rank other than 0, whose engine waited for its own); a
        block to load that did not arrive intact here leaves this rank unable to step."""
        disk = self.disk
        if disk is None or disk.idle:
            return
        for slot in slots:
            if disk.wait(slot) is False and loading:
                raise RuntimeError(f"rank {os.environ.get('RANK', 0)}: the KV disk tier's file of the block to load "
                                   f"into slot {slot} was missing or corrupt here, and intact on rank 0")


def _phases(ops: list[tuple]) -> list[tuple[list[tuple[int, int, bytes]], list[tuple[int, int]],
                                             list[tuple[int, int]]]]:
    """Split ops into phases of (disk ops, saves, loads) (saves and loads as (block, slot)) such that running a
    phase's disk ops, then its saves, then its loads, phase after phase, equals running the ops in order: an op
    starts a new phase where it would read what a copy of the phase writes, write what one reads, or hit a block or
    slot the phase uses twice, or a MARK follows loads."""
    phases: list = []
    io: list[tuple[int, int, bytes]] = []
    saves: list[tuple[int, int]] = []
    loads: list[tuple[int, int]] = []
    saved_slots: set[int] = set()
    loaded_blocks: set[int] = set()
    read_slots: set[int] = set()
    fetched_slots: set[int] = set()
    for kind, a, b in ops:
        if kind == SAVE:
            clash = a in loaded_blocks or b in read_slots or b in saved_slots or b in fetched_slots
        elif kind == LOAD:
            clash = a in loaded_blocks or b in fetched_slots
        elif kind in (SPILL, FETCH, CONFIRM):
            clash = a in saved_slots or a in read_slots or a in fetched_slots
        elif kind == MARK:
            clash = bool(loads)  # after the loads it marks
        else:
            clash = False
        if clash:
            phases.append((io, saves, loads))
            io, saves, loads = [], [], []
            saved_slots, loaded_blocks, read_slots, fetched_slots = set(), set(), set(), set()
        if kind == SAVE:
            saves.append((a, b))
            saved_slots.add(b)
        elif kind == LOAD:
            loads.append((a, b))
            loaded_blocks.add(a)
            read_slots.add(b)
        else:
            io.append((kind, a, b))
            if kind == FETCH:
                fetched_slots.add(a)
    if io or saves or loads:
        phases.append((io, saves, loads))
    return phases


def _slot_runs(slots: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(i, j, first slot) for each run slots[i:j] of consecutive slot numbers."""
    runs, i = [], 0
    for j in range(1, len(slots) + 1):
        if j == len(slots) or slots[j] != slots[j - 1] + 1:
            runs.append((i, j, slots[i]))
            i = j
    return runs
