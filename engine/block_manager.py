"""Paged KV blocks: allocation, ref counts, prefix hashing (a hash chain over full blocks) and LRU eviction."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvgate.engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and registered in (or known to) the prefix cache
    token_ids: tuple[int, ...] = ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # free blocks in eviction order: the front is taken first (least recently used / worthless)
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
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

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of seq's tokens (never the block of its last token, so that at least
        one token is computed and its logits exist); none for a request that skips reading the prefix cache (a
        pooling request whose pooling needs every token's hidden state)."""
        if not self.enable_prefix_caching or seq.request.skip_reading_prefix_cache:
            return []
        bs, hits, parent = self.block_size, [], None
        for i in range((len(seq) - 1) // bs):
            ids = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = hash((parent, ids))
            bid = self.cached.get(h)
            if bid is None or self.blocks[bid].token_ids != ids:  # token ids are compared on a hash hit
                break
            hits.append(bid)
            parent = h
        return hits

    def allocate(self, seq: Sequence, num_tokens: int, computed: list[int] | None = None) -> bool:
        """Make seq's block table cover `num_tokens` tokens, first reusing `computed` (prefix-cache hits, only
        for a sequence with no blocks yet). Returns False, changing nothing, when blocks are short."""
        if not computed and num_tokens <= len(seq.block_table) * self.block_size:
            return True  # the common decode step: the last block still has room
        computed = computed or []
        assert not computed or not seq.block_table
        new = self.blocks_needed(num_tokens) - len(seq.block_table) - len(computed)
        reclaimed = sum(1 for b in computed if self.blocks[b].ref_count == 0)  # hits that sit in the free queue
        if new > self.num_free_blocks - reclaimed:
            return False
        if computed:
            self.prefix_cache_queries += len(seq)
            self.prefix_cache_hits += len(computed) * self.block_size
            for bid in computed:
                block = self.blocks[bid]
                if block.ref_count == 0:
                    del self.free_queue[bid]
                block.ref_count += 1
                seq.block_table.append(bid)
            seq.num_hashed_blocks = len(computed)
            seq.num_computed_tokens = len(computed) * self.block_size
        elif (self.enable_prefix_caching and not seq.block_table and seq.num_computed_tokens == 0
              and not seq.request.skip_reading_prefix_cache):
            self.prefix_cache_queries += len(seq)
        for _ in range(max(new, 0)):
            bid, _ = self.free_queue.popitem(last=False)
            block = self.blocks[bid]
            if block.hash is not None and self.cached.get(block.hash) == bid:
                del self.cached[block.hash]  # evict its cached content
            block.hash, block.token_ids, block.ref_count = None, (), 1
            seq.block_table.append(bid)
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that became full (all tokens computed) in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(seq.num_hashed_blocks, seq.num_computed_tokens // bs):
            parent = self.blocks[seq.block_table[i - 1]].hash if i > 0 else None
            ids = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            block = self.blocks[seq.block_table[i]]
            block.hash, block.token_ids = hash((parent, ids)), ids
            self.cached.setdefault(block.hash, block.block_id)  # the first copy stays the cached one
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, seq.num_computed_tokens // bs)

    def free(self, seq: Sequence) -> None:
        """Drop seq's references, tail first, so that a sequence's last blocks are evicted before its first."""
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
