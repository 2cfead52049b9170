"""Paged KV blocks: allocation, ref counts, prefix hashing (a digest chain over full blocks) and LRU eviction; with
an offload tier (engine/kv_offload/), evicted cached blocks are saved there and prefix hits in it loaded back."""
from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from kvgate.engine.kv_offload import OffloadTier
from kvgate.engine.sequence import Sequence


def block_digest(parent: bytes | None, token_ids: tuple[int, ...]) -> bytes:
    """A full block's key: sha256 of its parent's digest and its token ids (int64, little-endian), the same in
    every process and after a restart (Python's hash() is neither)."""
    ids = array("q", token_ids)
    if sys.byteorder == "big":
        ids.byteswap()
    return hashlib.sha256((parent or b"") + ids.tobytes()).digest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set once the block is full and registered in (or known to) the prefix cache
    token_ids: tuple[int, ...] = ()
    ticket: int | None = None  # loads aside: the offload tier's load batch that writes it


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 offload: OffloadTier | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # free blocks in eviction order: the front is taken first (least recently used / worthless)
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}  # block digest -> block id
        self.offload = offload if enable_prefix_caching else None
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found
        self.freed_seq_ids: list[int] = []  # sequences whose blocks were dropped since take_freed (runners forget them)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def get_computed_blocks(self, seq: Sequence) -> list[int | bytes] | None:
        """Cached blocks holding a prefix of seq's tokens, in order: a device block's id, or the digest of a block
        in the offload tier (to be loaded); never the block of its last token, so that at least one token is
        computed and its logits exist. Nothing for a request that skips reading the prefix cache (a pooling request
        whose pooling needs every token's hidden state). None while some of the prefix is being read from the disk
        tier (its fetches started here): the request waits for them."""
        if not self.enable_prefix_caching or seq.request.skip_reading_prefix_cache:
            return []
        bs, hits, parent, tier = self.block_size, [], None, self.offload
        fetching, cpu_hits = False, set()
        for i in range((len(seq) - 1) // bs):
            ids = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = block_digest(parent, ids)
            bid = self.cached.get(h)
            if bid is not None and self.blocks[bid].token_ids == ids:  # token ids are compared on a hit
                hits.append(bid)
            elif tier is not None and h in tier.fetching:
                fetching = True
            elif tier is not None and tier.holds(h, ids):
                hits.append(h)
                cpu_hits.add(h)
            elif tier is not None and tier.on_disk(h):
                if not tier.fetch(h, ids, cpu_hits):  # (the CPU hits before it stay)
                    break  # no room now: the rest is computed, or (fetches of its prefix running) asked again
                tier.stats.disk_queries += bs
                tier.stats.disk_hits += bs
                fetching = True
            else:
                break
            parent = h
        return None if fetching else hits

    def allocate(self, seq: Sequence, num_tokens: int, computed: list[int | bytes] | None = None) -> bool:
        """Make seq's block table cover `num_tokens` tokens, first reusing `computed` (prefix-cache hits from
        get_computed_blocks, only for a sequence with no blocks yet: device blocks are shared, offloaded ones
        loaded into new blocks). Returns False, changing nothing, when blocks are short."""
        if not computed and num_tokens <= len(seq.block_table) * self.block_size:
            return True  # the common decode step: the last block still has room
        computed = computed or []
        assert not computed or not seq.block_table
        shared = [b for b in computed if isinstance(b, int)]
        new = self.blocks_needed(num_tokens) - len(seq.block_table) - len(shared)
        reclaimed = sum(1 for b in shared if self.blocks[b].ref_count == 0)  # hits that sit in the free queue
        if new > self.num_free_blocks - reclaimed:
            return False
        if seq.request.num_cached_tokens is None and not seq.block_table:  # its first blocks
            seq.request.num_cached_tokens = len(computed) * self.block_size
        if self.offload is not None and not seq.block_table and not seq.request.skip_reading_prefix_cache:
            stats, bs = self.offload.stats, self.block_size
            stats.queries += ((len(seq) - 1) // bs - len(shared)) * bs
            stats.hits += (len(computed) - len(shared)) * bs
            if self.offload.disk is not None:  # what missed in CPU memory missed on disk too (found: fetched first)
                stats.disk_queries += ((len(seq) - 1) // bs - len(computed)) * bs
        if computed:
            self.prefix_cache_queries += len(seq)
            self.prefix_cache_hits += len(computed) * self.block_size
            for bid in shared:  # out of the free queue first: no new block may be taken from them
                block = self.blocks[bid]
                if block.ref_count == 0:
                    del self.free_queue[bid]
                block.ref_count += 1
            loading = frozenset(h for h in computed if isinstance(h, bytes))
            tier = self.offload
            for hit in computed:
                if isinstance(hit, bytes):  # in the offload tier: a new block, loaded before the next step
                    bid = self._take_free_block(loading)
                    block = self.blocks[bid]
                    block.hash, block.token_ids = hit, tier.token_ids[hit]  # type: ignore[union-attr]
                    self.cached[hit] = bid
                    tier.load(hit, bid)  # type: ignore[union-attr]
                    if tier.loads_aside:  # type: ignore[union-attr]
                        block.ticket = seq.loading = tier.ticket  # type: ignore[union-attr]
                    hit = bid
                elif self.blocks[hit].ticket is not None and not tier.loaded(self.blocks[hit].ticket):  # type: ignore
                    seq.loading = max(seq.loading or 0, self.blocks[hit].ticket)  # shared while still loading
                seq.block_table.append(hit)
            seq.num_hashed_blocks = len(computed)
            seq.num_computed_tokens = len(computed) * self.block_size
        elif (self.enable_prefix_caching and not seq.block_table and seq.num_computed_tokens == 0
              and not seq.request.skip_reading_prefix_cache):
            self.prefix_cache_queries += len(seq)
        for _ in range(self.blocks_needed(num_tokens) - len(seq.block_table)):
            seq.block_table.append(self._take_free_block())
        return True

    def _take_free_block(self, loading: frozenset[bytes] = frozenset()) -> int:
        """The front of the free queue, its cached content evicted (into the offload tier, if there is one; the
        tier keeps the blocks of `loading`, which are being loaded)."""
        bid, _ = self.free_queue.popitem(last=False)
        block = self.blocks[bid]
        if block.hash is not None and self.cached.get(block.hash) == bid:
            del self.cached[block.hash]
            if self.offload is not None:
                self.offload.save(block.hash, block.token_ids, bid, loading)
        block.hash, block.token_ids, block.ref_count, block.ticket = None, (), 1, None
        return bid

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that became full (all tokens computed, or being computed by a step in flight, which
        runs before any step that could read them) in the prefix cache."""
        bs = self.block_size
        if not self.enable_prefix_caching or seq.num_computed_tokens < (seq.num_hashed_blocks + 1) * bs:
            return  # (hot, once per sequence and step: most steps fill no block)
        full = min(seq.num_computed_tokens, len(seq.token_ids)) // bs  # a pending token's id is not known yet
        for i in range(seq.num_hashed_blocks, full):
            parent = self.blocks[seq.block_table[i - 1]].hash if i > 0 else None
            ids = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            block = self.blocks[seq.block_table[i]]
            block.hash, block.token_ids = block_digest(parent, ids), ids
            self.cached.setdefault(block.hash, block.block_id)  # the first copy stays the cached one
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)

    def loaded(self, seq: Sequence) -> bool:
        """Loads aside: whether the blocks seq waits for are loaded (on rank 0); once they are, its next step waits
        for them on every rank."""
        tier = self.offload
        if not tier.loaded(seq.loading):  # type: ignore[union-attr, arg-type]
            return False
        tier.await_loads(seq.loading)  # type: ignore[union-attr, arg-type]
        seq.loading = None
        return True

    def free(self, seq: Sequence) -> None:
        """Drop seq's references, tail first, so that a sequence's last blocks are evicted before its first (blocks
        still being loaded: the next step waits for them before anything may overwrite them)."""
        if seq.loading is not None:
            self.offload.await_loads(seq.loading)  # type: ignore[union-attr]
            seq.loading = None
        if seq.block_table:
            self.freed_seq_ids.append(seq.seq_id)
        for bid in reversed(seq.block_table):
            block = self.blocks[bid]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {bid} freed twice"
            if block.ref_count == 0:
                self.free_queue[bid] = None
                if block.hash is None or self.cached.get(block.hash) != bid:
                    self.free_queue.move_to_end(bid, last=False)  # holds nothing reusable: evict first
        seq.block_table = []
        seq.num_hashed_blocks = 0

    def take_freed(self) -> list[int]:
        freed, self.freed_seq_ids = self.freed_seq_ids, []
        return freed

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Share the parent's full computed blocks with a child (n > 1); the child recomputes the rest."""
        full = parent.num_computed_tokens // self.block_size
        for bid in parent.block_table[:full]:
            self.blocks[bid].ref_count += 1
        child.block_table = parent.block_table[:full]
        child.num_computed_tokens = full * self.block_size
        child.num_hashed_blocks = min(parent.num_hashed_blocks, full)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            if block.ref_count == 0:
                block.hash, block.token_ids = None, ()
        self.cached = {h: b for h, b in self.cached.items() if self.blocks[b].ref_count > 0}
