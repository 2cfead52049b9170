"""The Triton kernels against their torch twins, on the CPU through Triton's interpreter.

TRITON_INTERPRET=1 must be set before the first import of a kvgate.kernels.triton_* module (@triton.jit
decides compiled or interpreted when it runs); triton itself may already be imported (transformers does).
Caches hold NaN in every slot that no sequence wrote, and outputs are NaN before each run, so a kernel that
reads past a sequence's length or leaves an element unwritten fails. The torch twins get the same written
values with finite garbage elsewhere (their masked softmax would turn a NaN into NaN).

bf16: triton 3.6's interpreter does tl.dot on the raw uint16 bits of bf16 operands, so under the interpreter
the kernels convert bf16 K/V to fp32 before tl.dot (`use_upcast`); these tests cover bf16 loads, stores and
conversions that way, and the GPU session checks bf16 tensor-core math at real shapes.
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from kvgate.kernels import triton_decode, triton_prefill  # noqa: E402
from kvgate.kernels.metadata import AttentionMetadata  # noqa: E402
from kvgate.kernels.registry import get_attention_backend, registered_kernels  # noqa: E402
from kvgate.kernels.torch_ref import (  # noqa: E402
    paged_decode_ref,
    paged_prefill_ref,
    store_kvcache_ref,
    torch_attention_backend,
)
from kvgate.kernels.triton_attention import (  # noqa: E402
    interpreted,
    paged_decode,
    paged_prefill,
    store_kvcache,
    triton_attention_backend,
)

# the interpreter itself uses a numpy idiom that numpy >= 1.25 deprecates
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


class Paged:
    """Sequences of random K/V in a shuffled paged cache: `nan` caches (NaN where unwritten) for the kernels,
    `ref` caches (large finite garbage where unwritten) for the torch twins."""

    def __init__(self, seq_lens: list[int], block_size: int, kvh: int, d: int, dtype: torch.dtype, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        blocks = [(n + block_size - 1) // block_size for n in seq_lens]
        num_blocks = sum(blocks) + 2
        perm = torch.randperm(num_blocks, generator=g).tolist()  # shuffled, non-contiguous tables
        self.tables, used = [], 0
        for nb in blocks:
            self.tables.append(perm[used:used + nb])
            used += nb
        width = max(blocks)
        self.table = torch.tensor([t + [0] * (width - len(t)) for t in self.tables], dtype=torch.int32)
        shape = (num_blocks, block_size, kvh, d)
        self.k_ref = (1e3 * torch.randn(shape, generator=g)).to(dtype)
        self.v_ref = (1e3 * torch.randn(shape, generator=g)).to(dtype)
        self.k_nan = torch.full(shape, float("nan"), dtype=dtype)
        self.v_nan = torch.full(shape, float("nan"), dtype=dtype)
        self.ks = [torch.randn(n, kvh, d, generator=g).to(dtype) for n in seq_lens]
        self.vs = [torch.randn(n, kvh, d, generator=g).to(dtype) for n in seq_lens]
        self.block_size = block_size
        for i, (k, v) in enumerate(zip(self.ks, self.vs)):
            slots = self.slots(i, 0, len(k))
            store_kvcache_ref(k, v, self.k_ref, self.v_ref, slots)
            store_kvcache_ref(k, v, self.k_nan, self.v_nan, slots)

    def slots(self, i: int, start: int, end: int) -> torch.Tensor:
        t, bs = self.tables[i], self.block_size
        return torch.tensor([t[p // bs] * bs + p % bs for p in range(start, end)], dtype=torch.long)


def nan_like(x: torch.Tensor) -> torch.Tensor:
    return torch.full_like(x, float("nan"))


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not out.isnan().any(), "unwritten or NaN-polluted output elements"
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_interpreted_and_registered() -> None:
    assert interpreted()
    assert "triton" in registered_kernels()
    assert get_attention_backend("triton") is triton_attention_backend


def test_registry_does_not_import_triton() -> None:
    code = ("import sys; import kvgate.kernels.registry as r; assert 'triton' not in sys.modules; "
            "assert 'triton' in r.registered_kernels()")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kvh,d", [(2, 64), (3, 128)])  # 3: a non-power-of-2 head count is masked
def test_store_kvcache_matches_ref_and_skips_padding(dtype: torch.dtype, kvh: int, d: int) -> None:
    g = torch.Generator().manual_seed(1)
    num_blocks, bs, t = 4, 16, 9
    kv = torch.randn(t, 2 * kvh + 1, d, generator=g).to(dtype)
    k, v = kv[:, :kvh], kv[:, kvh + 1:]  # non-contiguous views, as split from a fused qkv
    slots = torch.randperm(num_blocks * bs, generator=g)[:t]
    slots[[2, 5]] = -1
    kc, vc = (torch.full((num_blocks, bs, kvh, d), float("nan"), dtype=dtype) for _ in range(2))
    kc_ref, vc_ref = kc.clone(), vc.clone()
    store_kvcache(k, v, kc, vc, slots)
    store_kvcache_ref(k, v, kc_ref, vc_ref, slots)
    assert torch.equal(kc.isnan(), kc_ref.isnan()) and torch.equal(vc.isnan(), vc_ref.isnan())
    assert torch.equal(kc.nan_to_num(), kc_ref.nan_to_num()) and torch.equal(vc.nan_to_num(), vc_ref.nan_to_num())
    assert int((~kc.isnan()).all(-1).all(-1).sum()) == t - 2  # the two padded tokens wrote nothing


# (block_size, gqa group, head_dim, dtype, forced partition_size or None for the default rule)
DECODE_CASES = [
    (16, 1, 64, torch.float32, 16),
    (16, 2, 128, torch.float16, 32),
    (32, 4, 64, torch.float32, None),
    (32, 8, 64, torch.bfloat16, 16),
    (64, 4, 128, torch.float16, 64),
    (64, 2, 64, torch.float32, 48),  # a partition of 3 tiles of 16
    (16, 4, 256, torch.float16, 32),
    (32, 2, 80, torch.float32, 32),  # head_dim padded to 128 and masked
]


@pytest.mark.parametrize("bs,group,d,dtype,psize", DECODE_CASES)
def test_paged_decode_matches_ref(bs: int, group: int, d: int, dtype: torch.dtype, psize: int | None) -> None:
    lens = [1, bs - 1, bs, bs + 1, 2 * bs + 7]
    if psize:
        lens += [2 * psize, 2 * psize + 1]  # on and just past a partition boundary
    kvh = 2
    p = Paged(lens, bs, kvh, d, dtype, seed=bs + group)
    q = torch.randn(len(lens), kvh * group, d, generator=torch.Generator().manual_seed(bs + group)).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = paged_decode(q, p.k_nan, p.v_nan, p.table, seq_lens, d ** -0.5, max(lens), out=nan_like(q),
                       partition_size=psize)
    ref = paged_decode_ref(q.float(), p.k_ref.float(), p.v_ref.float(), p.table, seq_lens, d ** -0.5)
    assert_close(out, ref, dtype)


def test_decode_default_rule_splits_long_contexts(monkeypatch: pytest.MonkeyPatch) -> None:
    dev = torch.device("cpu")  # the rule pretends to run on an H200 (132 SMs) here
    parts, size = triton_decode.choose_partitions(1, 8, 16384, dev)
    assert parts > 8 and size % triton_decode.DECODE_TILE_N == 0 and parts * size >= 16384
    assert triton_decode.choose_partitions(256, 8, 16384, dev)[0] == 1  # a full GPU needs no split
    assert triton_decode.choose_partitions(1, 8, 200, dev)[0] == 1  # too short to split
    # the default path with the rule forced to split small contexts
    monkeypatch.setattr(triton_decode, "MIN_PARTITION_TOKENS", 16)
    monkeypatch.setattr(triton_decode, "DECODE_TILE_N", 16)
    lens = [70, 5, 33]
    p = Paged(lens, 16, 1, 64, torch.float32, seed=5)
    q = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(5))
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    assert triton_decode.choose_partitions(3, 1, 70, dev) == (3, 32)  # 4 wanted, 32-token tiles give 3
    out = paged_decode(q, p.k_nan, p.v_nan, p.table, seq_lens, 0.125, out=nan_like(q))
    assert_close(out, paged_decode_ref(q, p.k_ref, p.v_ref, p.table, seq_lens, 0.125), torch.float32)


# (block_size, gqa group, head_dim, dtype, (block_m, block_n) or None for the defaults)
PREFILL_CASES = [
    (16, 1, 64, torch.float32, (16, 16)),
    (16, 2, 64, torch.float16, (32, 16)),
    (32, 4, 128, torch.float32, None),
    (32, 8, 64, torch.bfloat16, (16, 16)),
    (64, 2, 128, torch.float16, None),  # a short step's default: 64-row tiles
    (64, 2, 128, torch.float16, (128, 64)),  # a long step's (prefill_config)
    (16, 2, 256, torch.float16, (32, 32)),
    (16, 1, 80, torch.float32, (32, 16)),
]


@pytest.mark.parametrize("bs,group,d,dtype,tiles", PREFILL_CASES)
def test_paged_prefill_matches_ref(bs: int, group: int, d: int, dtype: torch.dtype,
                                   tiles: tuple[int, int] | None) -> None:
    # (cached, new): fresh prompts, a prefix hit of whole blocks, chunks after partial blocks, one token
    pairs = [(0, 1), (0, bs + 1), (bs, 5), (bs - 1, 1), (bs + 3, 2 * 16 + 7)]
    lens = [c + n for c, n in pairs]
    kvh = 2
    p = Paged(lens, bs, kvh, d, dtype, seed=bs * group)
    starts = [0]
    for _, n in pairs:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], kvh * group, d, generator=torch.Generator().manual_seed(len(starts))).to(dtype)
    k_new = torch.cat([k[c:] for k, (c, _) in zip(p.ks, pairs)])  # this step's K/V, also in the cache
    v_new = torch.cat([v[c:] for v, (c, _) in zip(p.vs, pairs)])
    block_m, block_n = tiles or (None, None)
    out = paged_prefill(q, k_new, v_new, p.k_nan, p.v_nan, p.table, torch.tensor(starts, dtype=torch.int32),
                        torch.tensor(lens, dtype=torch.int32), max(n for _, n in pairs), d ** -0.5,
                        out=nan_like(q), block_m=block_m, block_n=block_n)
    ref = paged_prefill_ref(q.float(), p.k_ref.float(), p.v_ref.float(), p.table, starts, lens, d ** -0.5)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("block_m,seq_chunk", [(16, 64), (32, 64), (16, 4)])
def test_paged_prefill_finds_each_tiles_sequence(block_m: int, seq_chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA graph's layout: the prompts' rows start after D decode rows, padding rows follow them, and absent
    sequences (no tokens) fill the grid's sequence count. Every tile finds its sequence (nine prompts of 1 to 70
    tokens, several tiles each at block_m 16, starts that are not multiples of block_m; the sequences' starts read
    in one chunk or in four); nothing outside the prompts' rows is written."""
    monkeypatch.setattr(triton_prefill, "SEQ_CHUNK", seq_chunk)
    bs, kvh, group, d, dtype = 16, 2, 2, 32, torch.float32
    cached = [0, 5, 0, 16, 0, 3, 0, 0, 40]
    new = [17, 1, 33, 16, 70, 2, 15, 49, 9]
    lens = [c + n for c, n in zip(cached, new)]
    p = Paged(lens, bs, kvh, d, dtype, seed=block_m)
    decodes, padding, absent = 5, 11, 4
    starts = [decodes]
    for n in new:
        starts.append(starts[-1] + n)
    rows = starts[-1] + padding
    starts_abs = starts + [starts[-1]] * absent  # absent sequences: no tokens
    table = torch.cat([p.table, torch.zeros(absent, p.table.shape[1], dtype=torch.int32)])
    seq_lens = torch.tensor(lens + [1] * absent, dtype=torch.int32)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(rows, kvh * group, d, generator=g)
    k_new = torch.randn(rows, kvh, d, generator=g)
    v_new = torch.randn(rows, kvh, d, generator=g)
    prompt_rows = slice(decodes, starts[-1])
    k_new[prompt_rows] = torch.cat([k[c:] for k, c in zip(p.ks, cached)])
    v_new[prompt_rows] = torch.cat([v[c:] for v, c in zip(p.vs, cached)])
    out = paged_prefill(q, k_new, v_new, p.k_nan, p.v_nan, table, torch.tensor(starts_abs, dtype=torch.int32),
                        seq_lens, max(new), d ** -0.5, out=nan_like(q), block_m=block_m, block_n=16)
    ref = paged_prefill_ref(q[prompt_rows], p.k_ref, p.v_ref, p.table, [s - decodes for s in starts], lens, d ** -0.5)
    assert_close(out[prompt_rows], ref, dtype)
    assert out[:decodes].isnan().all() and out[starts[-1]:].isnan().all()  # decode and padding rows untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_backend_mixed_batch_matches_torch_backend(dtype: torch.dtype) -> None:
    """Three decodes then three prefills (fresh, chunk after a cached prefix, padding tokens with slot -1):
    the same output and the same cache as torch_attention_backend."""
    bs, kvh, group, d = 16, 2, 4, 64
    cached = [40, 16, 3, 0, 21, 0]
    new = [1, 1, 1, 19, 12, 5]
    lens = [c + n for c, n in zip(cached, new)]
    p = Paged(lens, bs, kvh, d, dtype, seed=7)
    for i, c in enumerate(cached):  # the new tokens' slots are not written yet
        p.k_ref.view(-1, kvh, d)[p.slots(i, c, lens[i])] = 7.0
        p.v_ref.view(-1, kvh, d)[p.slots(i, c, lens[i])] = 7.0
    starts = [0]
    for n in new:
        starts.append(starts[-1] + n)
    slots = torch.cat([p.slots(i, c, lens[i]) for i, c in enumerate(cached)])
    slots[starts[5]:] = -1  # padding: the last prompt stores nothing (as in the engine's profile run)
    md = AttentionMetadata(
        slot_mapping=slots, query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=p.table, num_decodes=3,
        max_query_len=max(new), max_seq_len=max(lens), block_size=bs, query_start_loc_cpu=starts, seq_lens_cpu=lens)
    q = torch.randn(starts[-1], kvh * group, d, generator=torch.Generator().manual_seed(len(starts))).to(dtype)
    k_new = torch.cat([k[c:] for k, c in zip(p.ks, cached)])
    v_new = torch.cat([v[c:] for v, c in zip(p.vs, cached)])
    kc, vc = p.k_ref.clone(), p.v_ref.clone()
    out = triton_attention_backend(q, k_new, v_new, kc, vc, md, d ** -0.5)
    kc_ref, vc_ref = p.k_ref.float(), p.v_ref.float()  # the twin in fp32 (fp16 values are exact in it)
    ref = torch_attention_backend(q.float(), k_new.float(), v_new.float(), kc_ref, vc_ref, md, d ** -0.5)
    assert torch.equal(kc.float(), kc_ref) and torch.equal(vc.float(), vc_ref)
    assert (kc.view(-1, kvh, d)[p.slots(5, 0, 5)] == 7.0).all()  # padded slots untouched
    assert_close(out, ref, dtype)


def test_reduce_kernel_has_one_variant_for_every_partition_count() -> None:
    """A server must not compile a new reduce kernel whenever a step's partition count changes."""
    assert {triton_decode.parts_pad(n) for n in range(1, triton_decode.MAX_PARTITIONS + 1)} == {
        triton_decode.MAX_PARTITIONS}
    assert triton_decode.parts_pad(triton_decode.MAX_PARTITIONS + 1) == 2 * triton_decode.MAX_PARTITIONS
