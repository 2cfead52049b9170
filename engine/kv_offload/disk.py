"""DiskStore: every rank's disk tier below its CPU slots. A block the full CPU tier evicts is spilled (its slot's
bytes, this rank's share) to a file; a later prefix hit on disk is fetched back into a slot, then loaded like any
CPU hit. The files outlive the process: a fresh engine on the same directory serves the prefixes they hold.

A few background threads per rank do the reads, writes and deletes, each block's in the order the engine asked
for them (a block always goes to the same thread), so that a fetch of a block just spilled finds its file; the step
never waits on the disk (rank 0's engine admits a request whose blocks are fetched only once they are in their
slots).

Layout: <kv_offloading_disk_dir>/<identity>/rank<r>/<block digest hex>.kv, where the identity digests the model
(path, config, weights' format and seed), the dtypes, the block size and the parallel layout: files of another
model or layout are never read. A file is a header (magic, the block digest, the payload's length and checksum)
then the payload (the checksum is a CRC-32: it catches torn and damaged files, not forgeries). It is written to a
temporary name and renamed, so a crash leaves no torn file under a block's name (temporaries are deleted at start),
and a file whose checksum does not match is deleted, never served.
A write that fails (a full or unwritable disk) logs a warning once and turns the disk tier off (`broken`): blocks
then stay in the CPU tier alone.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import zlib

import torch

logger = logging.getLogger(__name__)

MAGIC = b"KVGATE-KV1\0"
HEADER = struct.Struct(f"<{len(MAGIC)}s32sQI")  # magic, block digest, payload bytes, payload CRC-32
THREADS = 4
SUFFIX = ".kv"


def rank_directory(config, rank: int) -> str:
    """This rank's directory of the disk tier: <kv_offloading_disk_dir>/<identity>/rank<rank>."""
    a = config.args
    path = os.path.realpath(config.model_path)
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(path, f) for f in os.listdir(path) if f.endswith((".safetensors", ".gguf", ".bin")))
    identity = {
        "model": path, "weights": [(os.path.basename(f), os.path.getsize(f)) for f in files],
        "load_format": config.load_format,  # dummy weights depend on the seed and where they are drawn
        "seed": [a.seed, config.device.type] if config.load_format == "dummy" else None,
        "config": dataclasses.asdict(config.model_config), "dtype": str(config.dtype),
        "kv_cache_dtype": str(config.kv_cache_dtype), "block_size": a.block_size,
        "layout": [a.tensor_parallel_size, a.pipeline_parallel_size],
    }
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return os.path.join(a.kv_offloading_disk_dir, digest, f"rank{rank}")


def encode(key: bytes, payload: bytes) -> bytes:
    return HEADER.pack(MAGIC, key, len(payload), zlib.crc32(payload))


def decode(key: bytes, data: bytes | bytearray, nbytes: int) -> memoryview | None:
    """The payload of a block file's bytes, or None when it is not the intact file of block `key`."""
    if len(data) != HEADER.size + nbytes:
        return None
    magic, stored_key, length, checksum = HEADER.unpack_from(data)
    payload = memoryview(data)[HEADER.size:]
    if magic != MAGIC or stored_key != key or length != nbytes or zlib.crc32(payload) != checksum:
        return None
    return payload


class DiskStore:
    def __init__(self, directory: str, slots: torch.Tensor) -> None:
        self.directory = directory
        self.slots = slots  # the rank's CPU slots [num_slots, ...]: spills read them, fetches write them
        self.nbytes = slots[0].numel() * slots.element_size()
        self.broken = False  # a write failed: the tier is off
        self.results: dict[int, bool] = {}  # slot -> fetched intact (True) or not (False); absent while pending
        self._pending: set[int] = set()
        self._done = threading.Condition()
        self._queues: list[queue.Queue] = [queue.Queue() for _ in range(THREADS)]
        os.makedirs(directory, exist_ok=True)
        for q in self._queues:
            threading.Thread(target=self._run, args=(q,), name="kvgate-kv-disk", daemon=True).start()

    def path(self, key: bytes) -> str:
        return os.path.join(self.directory, key.hex() + SUFFIX)

    def scan(self) -> list[bytes]:
        """The blocks on disk, least recently written first; temporaries (of a crash mid-write) are deleted."""
        found = []
        for entry in os.scandir(self.directory):
            if not entry.name.endswith(SUFFIX):
                _unlink(entry.path)
                continue
            try:
                key = bytes.fromhex(entry.name[:-len(SUFFIX)])
            except ValueError:
                continue
            if len(key) == 32:
                found.append((entry.stat().st_mtime, key))
        return [key for _, key in sorted(found)]

    def keep_common(self, every_rank: list[list[bytes]], rank: int) -> list[bytes]:
        """Given each rank's scan (rank order), delete this rank's files of blocks that some rank has no file of (a
        rank's write that failed, its file deleted as corrupt, a directory copied in part): such a block cannot be
        read back whole. Returns the blocks every rank holds, in this rank's order (least recently written first)."""
        common = set(every_rank[0]).intersection(*every_rank[1:])
        for key in every_rank[rank]:
            if key not in common:
                _unlink(self.path(key))
        return [key for key in every_rank[rank] if key in common]

    # ---- asked by the step's ops (engine/kv_offload/store.py), in order ----------------------------------------------
    def spill(self, slot: int, key: bytes) -> None:
        """Write the slot's block to disk (a copy is taken now: the slot is reused at once)."""
        if not self.broken:
            data = self.slots[slot].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            self._queue(key).put(("write", key, data))

    def fetch(self, slot: int, key: bytes) -> None:
        """Read the block's file into the slot; `results[slot]` says how it went."""
        with self._done:
            self._pending.add(slot)
            self.results.pop(slot, None)
        self._queue(key).put(("read", key, slot))

    def delete(self, key: bytes) -> None:
        self._queue(key).put(("delete", key, None))

    @property
    def idle(self) -> bool:
        """No fetch running or unreported."""
        return not (self._pending or self.results)

    def poll(self, slot: int) -> bool | None:
        """How the fetch into `slot` went: None while it runs, else whether the block arrived intact (told once)."""
        with self._done:
            return None if slot in self._pending else self.results.pop(slot, False)

    def wait(self, slot: int) -> bool | None:
        """Until a fetch into `slot` is done: whether the block arrived intact (None: no fetch into it unreported)."""
        with self._done:
            self._done.wait_for(lambda: slot not in self._pending)
            return self.results.pop(slot, None)

    def flush(self) -> None:
        """Until every request so far is done (tests, shutdown)."""
        for q in self._queues:
            q.join()

    def _queue(self, key: bytes) -> queue.Queue:
        return self._queues[key[0] % THREADS]  # a block's requests on one thread, in order

    # ---- the thread ------------------------------------------------------------------------------------------------
    def _run(self, requests: queue.Queue) -> None:
        while True:
            kind, key, arg = requests.get()
            try:
                if kind == "write":
                    self._write(key, arg)
                elif kind == "read":
                    ok = self._read(key, arg)
                    with self._done:
                        self.results[arg] = ok
                        self._pending.discard(arg)
                        self._done.notify_all()
                else:
                    _unlink(self.path(key))
            finally:
                requests.task_done()

    def _write(self, key: bytes, data: bytes) -> None:
        if self.broken:
            return
        path = self.path(key)
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(encode(key, data))
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            _unlink(tmp)
            was, self.broken = self.broken, True
            if not was:
                logger.warning("the KV disk tier in %s failed to write a block (%s): it is off now, blocks stay in "
                               "the CPU tier alone", self.directory, e)

    def _read(self, key: bytes, slot: int) -> bool:
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                data = bytearray(size if size == HEADER.size + self.nbytes else 0)
                f.readinto(data)
        except OSError:
            return False
        payload = decode(key, data, self.nbytes)
        if payload is None:
            logger.warning("deleted a torn or corrupt KV block file %s", path)
            _unlink(path)
            return False
        self.slots[slot].view(-1).view(torch.uint8).copy_(torch.frombuffer(payload, dtype=torch.uint8))
        return True


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
