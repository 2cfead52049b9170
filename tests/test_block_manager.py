"""Unit tests of BlockManager with fake sequences: allocation, ref counts, prefix hash chain, LRU eviction, fork."""

from __future__ import annotations

import itertools

import pytest

from kvgate.engine.block_manager import BlockManager, block_digest
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.sequence import Request, Sequence

BS = 16
_ids = itertools.count()


def make_seq(token_ids: list[int], num_prompt: int | None = None) -> Sequence:
    """A Sequence of a fresh Request; the first `num_prompt` tokens (default: all) are the prompt."""
    prompt = list(token_ids[: len(token_ids) if num_prompt is None else num_prompt])
    req = Request(f"r{next(_ids)}", None, prompt, SamplingParams(temperature=0, max_tokens=8))
    seq = Sequence(req, 0, list(token_ids))
    req.seqs.append(seq)
    return seq


def tokens(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    """Pretend the model ran over all of seq's tokens (allocate them, mark computed, register full blocks)."""
    computed = bm.get_computed_blocks(seq) if not seq.block_table else []
    assert bm.allocate(seq, len(seq), computed)
    seq.num_computed_tokens = len(seq)
    bm.cache_full_blocks(seq)


def snapshot(bm: BlockManager) -> tuple:
    return (list(bm.free_queue), dict(bm.cached), [(b.ref_count, b.hash, b.token_ids) for b in bm.blocks],
            bm.prefix_cache_queries, bm.prefix_cache_hits)


def assert_all_free(bm: BlockManager) -> None:
    assert bm.num_free_blocks == bm.num_blocks
    assert sorted(bm.free_queue) == list(range(bm.num_blocks))
    assert all(b.ref_count == 0 for b in bm.blocks)


# ---- allocate / free --------------------------------------------------------------------------------------------
def test_allocate_and_free_return_every_block() -> None:
    bm = BlockManager(10, BS)
    a, b = make_seq(tokens(40)), make_seq(tokens(17, 300))
    assert bm.allocate(a, 40) and bm.allocate(b, 17)
    assert len(a.block_table) == 3 and len(b.block_table) == 2
    assert len(set(a.block_table) | set(b.block_table)) == 5
    assert bm.num_free_blocks == 5
    assert all(bm.blocks[i].ref_count == 1 for i in a.block_table + b.block_table)
    # growing an existing table only adds the missing blocks
    assert bm.allocate(b, 33)
    assert len(b.block_table) == 3 and bm.num_free_blocks == 4
    bm.free(a)
    bm.free(b)
    assert a.block_table == [] and b.block_table == []
    assert_all_free(bm)


def test_allocate_exactly_all_blocks_then_fail() -> None:
    bm = BlockManager(3, BS)
    a = make_seq(tokens(48))
    assert bm.allocate(a, 48)
    assert bm.num_free_blocks == 0
    b = make_seq(tokens(1, 7))
    assert not bm.allocate(b, 1)
    assert b.block_table == []
    bm.free(a)
    assert_all_free(bm)


def test_allocate_fails_without_side_effects_when_short() -> None:
    bm = BlockManager(4, BS)
    a = make_seq(tokens(40))
    assert bm.allocate(a, 40)  # 3 of 4 blocks
    table_a = list(a.block_table)
    before = snapshot(bm)
    b = make_seq(tokens(20, 300))
    assert not bm.allocate(b, 20)  # needs 2, one is free
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert snapshot(bm) == before
    # growing a sequence that is already partly allocated: also all or nothing
    assert not bm.allocate(a, 80)  # needs 5 in all, 4 exist
    assert a.block_table == table_a
    assert snapshot(bm) == before
    bm.free(a)
    assert_all_free(bm)


def test_allocate_with_prefix_hits_fails_without_side_effects() -> None:
    bm = BlockManager(3, BS)
    a = make_seq(tokens(33))
    compute_all(bm, a)
    table_a = list(a.block_table)
    bm.free(a)  # its 2 full blocks stay cached in the free queue
    b = make_seq(tokens(33) + tokens(30, 400))  # 63 tokens: 4 blocks, 2 of them cached
    hits = bm.get_computed_blocks(b)
    assert hits == table_a[:2]
    before = snapshot(bm)
    assert not bm.allocate(b, len(b), hits)
    assert b.block_table == [] and b.num_computed_tokens == 0 and b.num_hashed_blocks == 0
    assert snapshot(bm) == before
    # the hits are still usable afterwards
    c = make_seq(tokens(33) + tokens(10, 400))  # 43 tokens: 3 blocks, 2 cached
    hits = bm.get_computed_blocks(c)
    assert len(hits) == 2
    assert bm.allocate(c, len(c), hits)  # 2 cached free blocks reclaimed + 1 new one: exactly the pool
    assert c.block_table[:2] == hits and c.num_computed_tokens == 32
    assert bm.num_free_blocks == 0
    bm.free(c)
    assert_all_free(bm)


def test_free_twice_is_detected() -> None:
    bm = BlockManager(4, BS)
    a = make_seq(tokens(20))
    assert bm.allocate(a, 20)
    table = list(a.block_table)
    bm.free(a)
    a.block_table = table
    with pytest.raises(AssertionError):
        bm.free(a)


def test_needs_at_least_one_block() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        BlockManager(0, BS)


# ---- prefix caching -------------------------------------------------------------------------------------------
def test_prefix_hash_chain_reuse_and_ref_counts() -> None:
    bm = BlockManager(16, BS)
    shared = tokens(32)
    a = make_seq(shared + tokens(8, 300))
    compute_all(bm, a)
    b = make_seq(shared + tokens(5, 400))
    hits = bm.get_computed_blocks(b)
    assert hits == a.block_table[:2]
    assert bm.allocate(b, len(b), hits)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]  # the partial last block is private
    assert b.num_computed_tokens == 32 and b.num_hashed_blocks == 2
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    assert bm.blocks[b.block_table[2]].ref_count == 1
    assert bm.prefix_cache_hits == 32 and bm.prefix_cache_queries == len(a) + len(b)
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table] == [1, 1, 1]
    bm.free(b)
    assert_all_free(bm)


def test_differing_token_breaks_the_chain() -> None:
    bm = BlockManager(16, BS)
    base = tokens(48)
    a = make_seq(base + [7])
    compute_all(bm, a)
    assert len(bm.cached) == 3

    in_second = list(base)
    in_second[20] = 9  # block 1 differs: only block 0 is reused, and nothing after the break
    s = make_seq(in_second + [7])
    assert bm.get_computed_blocks(s) == a.block_table[:1]

    in_first = list(base)
    in_first[0] = 9  # block 0 differs: blocks 1 and 2 hold equal tokens but have another parent
    s = make_seq(in_first + [7])
    assert bm.get_computed_blocks(s) == []

    last = list(base)
    last[47] = 9
    s = make_seq(last + [7])
    assert bm.get_computed_blocks(s) == a.block_table[:2]


def test_same_block_content_at_another_position_is_not_reused() -> None:
    bm = BlockManager(16, BS)
    blk = tokens(16)
    a = make_seq(tokens(16, 300) + blk + [1])
    compute_all(bm, a)
    s = make_seq(blk + [1])  # a's 2nd block content, but as the first block
    assert bm.get_computed_blocks(s) == []


def test_last_block_is_never_taken_from_the_cache() -> None:
    bm = BlockManager(16, BS)
    a = make_seq(tokens(48) + [5])
    compute_all(bm, a)
    assert len(bm.cached) == 3
    exact = make_seq(tokens(32))  # two full cached blocks, but the 2nd holds its last token
    assert bm.get_computed_blocks(exact) == a.block_table[:1]
    one_more = make_seq(tokens(33))
    assert bm.get_computed_blocks(one_more) == a.block_table[:2]
    single = make_seq(tokens(16))
    assert bm.get_computed_blocks(single) == []
    # allocating with the hits leaves at least one token to compute
    hits = bm.get_computed_blocks(exact)
    assert bm.allocate(exact, len(exact), hits)
    assert exact.num_computed_tokens == 16 < len(exact)
    bm.free(exact)
    bm.free(a)
    assert_all_free(bm)


def test_hash_hit_compares_token_ids() -> None:
    bm = BlockManager(8, BS)
    a = make_seq(tokens(16) + [1])
    compute_all(bm, a)
    victim_block = a.block_table[0]
    bm.free(a)
    other = tokens(16, 300)
    # a (forced) collision: the hash of `other`'s first block points at a block holding different tokens
    bm.cached[block_digest(None, tuple(other))] = victim_block
    s = make_seq(other + [1])
    assert bm.get_computed_blocks(s) == []
    compute_all(bm, s)
    assert s.block_table[0] != victim_block
    assert bm.blocks[victim_block].ref_count == 0
    # control: with matching token ids the same fake entry would be a hit
    bm.free(s)
    bm.blocks[victim_block].token_ids = tuple(other)
    assert bm.get_computed_blocks(make_seq(other + [1])) == [victim_block]


def test_prefix_caching_disabled() -> None:
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = make_seq(tokens(40))
    compute_all(bm, a)
    assert bm.cached == {}
    b = make_seq(tokens(40))
    assert bm.get_computed_blocks(b) == []
    bm.free(a)
    assert_all_free(bm)


def test_reset_prefix_cache_keeps_blocks_in_use() -> None:
    bm = BlockManager(8, BS)
    a = make_seq(tokens(33))
    b = make_seq(tokens(33, 300))
    compute_all(bm, a)
    compute_all(bm, b)
    bm.free(a)
    bm.reset_prefix_cache()
    assert bm.get_computed_blocks(make_seq(tokens(33))) == []
    assert bm.get_computed_blocks(make_seq(tokens(33, 300))) == b.block_table[:2]
    bm.free(b)
    assert_all_free(bm)


# ---- LRU eviction ------------------------------------------------------------------------------------------------
def _cached_seq(bm: BlockManager, start: int) -> tuple[Sequence, int]:
    """A 17-token sequence (1 full block + 1 partial), computed, cached and freed; returns it and its full block."""
    s = make_seq(tokens(16, start) + [start])
    compute_all(bm, s)
    full = s.block_table[0]
    bm.free(s)
    return s, full


def _hit(bm: BlockManager, start: int) -> bool:
    return bool(bm.get_computed_blocks(make_seq(tokens(16, start) + [start])))


def test_unhashed_free_blocks_are_reused_before_cached_ones() -> None:
    bm = BlockManager(8, BS)
    for start in (100, 200, 300):
        _cached_seq(bm, start)
    assert len(bm.cached) == 3
    # 5 blocks hold nothing reusable (3 partial tails + 2 never used): they go first
    grab = make_seq(tokens(5 * BS, 1000))
    assert bm.allocate(grab, len(grab))
    assert len(bm.cached) == 3
    assert all(_hit(bm, start) for start in (100, 200, 300))
    bm.free(grab)
    assert bm.num_free_blocks == 8


def test_cached_free_blocks_are_evicted_oldest_first() -> None:
    bm = BlockManager(6, BS)
    fulls = {start: _cached_seq(bm, start)[1] for start in (100, 200, 300)}  # freed in this order
    # take the 3 blocks with nothing cached
    filler = make_seq(tokens(3 * BS, 1000))
    assert bm.allocate(filler, len(filler))
    assert all(_hit(bm, s) for s in (100, 200, 300))

    one = make_seq([1])
    assert bm.allocate(one, 1)
    assert one.block_table == [fulls[100]]  # least recently freed
    assert (_hit(bm, 100), _hit(bm, 200), _hit(bm, 300)) == (False, True, True)
    two = make_seq([2])
    assert bm.allocate(two, 1)
    assert two.block_table == [fulls[200]]
    assert (_hit(bm, 200), _hit(bm, 300)) == (False, True)
    for s in (filler, one, two):
        bm.free(s)
    assert bm.num_free_blocks == 6


def test_reusing_a_cached_block_makes_it_most_recent() -> None:
    bm = BlockManager(6, BS)
    fulls = {start: _cached_seq(bm, start)[1] for start in (100, 200, 300)}
    # touch the oldest one: a hit takes it out of the free queue, freeing puts it back as the newest
    again = make_seq(tokens(16, 100) + [100])
    hits = bm.get_computed_blocks(again)
    assert hits == [fulls[100]]
    assert bm.allocate(again, len(again), hits)
    bm.free(again)
    filler = make_seq(tokens(3 * BS, 1000))
    assert bm.allocate(filler, len(filler))
    order = []
    for _ in range(3):
        s = make_seq([3])
        assert bm.allocate(s, 1)
        order.append(s.block_table[0])
    assert order == [fulls[200], fulls[300], fulls[100]]


def test_a_sequence_tail_is_evicted_before_its_head() -> None:
    bm = BlockManager(4, BS)
    a = make_seq(tokens(64))
    compute_all(bm, a)  # 4 full blocks, all cached
    table = list(a.block_table)
    bm.free(a)
    s = make_seq([1])
    assert bm.allocate(s, 1)
    assert s.block_table == [table[-1]]
    b = make_seq(tokens(49))
    assert bm.get_computed_blocks(b) == table[:3]


# ---- fork (n > 1) ------------------------------------------------------------------------------------------------
def test_fork_shares_full_blocks_only() -> None:
    bm = BlockManager(16, BS)
    parent = make_seq(tokens(40))
    compute_all(bm, parent)
    child = Sequence(parent.request, 1, list(parent.token_ids))
    parent.request.seqs.append(child)
    bm.fork(parent, child)
    assert child.block_table == parent.block_table[:2]
    assert child.num_computed_tokens == 32
    assert [bm.blocks[i].ref_count for i in parent.block_table] == [2, 2, 1]
    # the child computes the rest itself into a private block
    assert bm.allocate(child, len(child))
    assert child.block_table[:2] == parent.block_table[:2]
    assert child.block_table[2] != parent.block_table[2]
    assert bm.blocks[child.block_table[2]].ref_count == 1
    bm.free(parent)
    assert [bm.blocks[i].ref_count for i in child.block_table] == [1, 1, 1]
    bm.free(child)
    assert_all_free(bm)


def test_fork_of_a_block_aligned_parent_and_short_prompt() -> None:
    bm = BlockManager(8, BS)
    parent = make_seq(tokens(32))
    compute_all(bm, parent)
    kids = [Sequence(parent.request, i, list(parent.token_ids)) for i in (1, 2)]
    for k in kids:
        bm.fork(parent, k)
    assert [bm.blocks[i].ref_count for i in parent.block_table] == [3, 3]
    short = make_seq(tokens(5))
    compute_all(bm, short)
    kid = Sequence(short.request, 1, list(short.token_ids))
    bm.fork(short, kid)
    assert kid.block_table == [] and kid.num_computed_tokens == 0
    assert bm.blocks[short.block_table[0]].ref_count == 1
    for s in [parent, *kids, short, kid]:
        bm.free(s)
    assert_all_free(bm)
