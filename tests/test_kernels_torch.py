"""The torch attention backend and the CPU packed linear against plain dense math."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from kvgate.kernels.cpu_linear import PackedLinear, can_pack
from kvgate.kernels.metadata import AttentionMetadata
from kvgate.kernels.registry import get_attention_backend, register_kernel, registered_kernels
from kvgate.kernels.torch_ref import paged_decode_ref, paged_prefill_ref, store_kvcache_ref


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [q_len, h, d] at the last positions of k/v [kv_len, kvh, d]; plain loops over heads."""
    q_len, h, _ = q.shape
    kv_len, kvh, _ = k.shape
    out = torch.empty_like(q)
    for head in range(h):
        kh = head // (h // kvh)
        s = (q[:, head].double() @ k[:, kh].double().T) * scale
        allowed = torch.arange(kv_len)[None, :] <= torch.arange(q_len)[:, None] + (kv_len - q_len)
        s = s.masked_fill(~allowed, -math.inf)
        out[:, head] = (s.softmax(-1) @ v[:, kh].double()).to(q.dtype)
    return out


def paged_setup(seq_lens: list[int], block_size: int, kvh: int, d: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    blocks = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(blocks) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()  # shuffled, non-contiguous tables
    tables, used = [], 0
    for nb in blocks:
        tables.append(perm[used:used + nb])
        used += nb
    width = max(blocks)
    table_t = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    # unwritten slots hold large garbage: reading one past a sequence's length changes the result
    k_cache = 1e3 * torch.randn(num_blocks, block_size, kvh, d, generator=g)
    v_cache = 1e3 * torch.randn(num_blocks, block_size, kvh, d, generator=g)
    ks = [torch.randn(n, kvh, d, generator=g) for n in seq_lens]
    vs = [torch.randn(n, kvh, d, generator=g) for n in seq_lens]
    for t, k, v in zip(tables, ks, vs):
        slots = torch.tensor([t[p // block_size] * block_size + p % block_size for p in range(len(k))])
        store_kvcache_ref(k, v, k_cache, v_cache, slots)
    return table_t, k_cache, v_cache, ks, vs


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_paged_decode_matches_dense(block_size: int, group: int) -> None:
    lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5]
    kvh, d = 2, 16
    table, kc, vc, ks, vs = paged_setup(lens, block_size, kvh, d)
    q = torch.randn(len(lens), kvh * group, d)
    out = paged_decode_ref(q, kc, vc, table, torch.tensor(lens), d ** -0.5)
    for i in range(len(lens)):
        ref = dense_attention(q[i:i + 1], ks[i], vs[i], d ** -0.5)
        torch.testing.assert_close(out[i:i + 1], ref, atol=1e-5, rtol=1e-5)


def test_paged_prefill_with_cached_prefix_matches_dense() -> None:
    lens, new = [20, 33, 7], [5, 33, 1]  # 15 cached + 5 new; all new; 6 cached + 1 new
    kvh, d, h = 2, 16, 4
    table, kc, vc, ks, vs = paged_setup(lens, 16, kvh, d, seed=1)
    q = torch.randn(sum(new), h, d)
    starts = [0, 5, 38, 39]
    out = paged_prefill_ref(q, kc, vc, table, starts, lens, d ** -0.5)
    for i in range(3):
        ref = dense_attention(q[starts[i]:starts[i + 1]], ks[i], vs[i], d ** -0.5)
        torch.testing.assert_close(out[starts[i]:starts[i + 1]], ref, atol=1e-5, rtol=1e-5)


def test_torch_backend_mixed_batch_and_padding_slots() -> None:
    """Decodes first, then a prefill; a padded slot (-1) is not written."""
    kvh, d, h, bs = 2, 16, 4, 16
    lens = [9, 17]
    table, kc, vc, ks, vs = paged_setup([8, 0 + 1], bs, kvh, d, seed=2)
    table = torch.tensor([[table[0, 0].item(), 0], [table[1, 0].item(), 0]], dtype=torch.int32)
    # seq 0: decode one token at position 8; seq 1: prefill 16 more tokens after one cached token
    k_new, v_new = torch.randn(17, kvh, d), torch.randn(17, kvh, d)
    free = [b for b in range(kc.shape[0]) if b not in table[:, 0].tolist()]
    table[1, 1] = free[0]
    slots = [table[0, 0].item() * bs + 8] + [table[1, p // bs].item() * bs + p % bs for p in range(1, 17)]
    slots_t = torch.tensor(slots)
    md = AttentionMetadata(slot_mapping=slots_t, query_start_loc=torch.tensor([0, 1, 17], dtype=torch.int32),
                           seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=table, num_decodes=1,
                           max_query_len=16, max_seq_len=17, block_size=bs, query_start_loc_cpu=[0, 1, 17],
                           seq_lens_cpu=lens)
    q = torch.randn(17, h, d)
    out = get_attention_backend("torch")(q, k_new, v_new, kc, vc, md, d ** -0.5)
    k0 = torch.cat([ks[0], k_new[:1]])
    v0 = torch.cat([vs[0], v_new[:1]])
    torch.testing.assert_close(out[:1], dense_attention(q[:1], k0, v0, d ** -0.5), atol=1e-5, rtol=1e-5)
    k1 = torch.cat([ks[1], k_new[1:]])
    v1 = torch.cat([vs[1], v_new[1:]])
    torch.testing.assert_close(out[1:], dense_attention(q[1:], k1, v1, d ** -0.5), atol=1e-5, rtol=1e-5)
    before = kc.clone()
    md = dataclasses.replace(md, slot_mapping=torch.tensor([-1] + slots[1:]))  # a new step: its own scratch
    k2 = torch.randn(17, kvh, d)
    get_attention_backend("torch")(q, k2, torch.randn(17, kvh, d), kc, vc, md, d ** -0.5)
    assert torch.equal(kc.view(-1, kvh, d)[slots[0]], before.view(-1, kvh, d)[slots[0]])
    assert torch.equal(kc.view(-1, kvh, d)[slots[1:]], k2[1:])


def test_registry_names_and_errors(tmp_path) -> None:
    assert "torch" in registered_kernels()
    with pytest.raises(ValueError, match="registered: .*torch"):
        get_attention_backend("no-such-kernel")
    register_kernel("torch-alias", get_attention_backend("torch"))
    assert get_attention_backend("torch-alias") is get_attention_backend("torch")
    with pytest.raises(FileNotFoundError):
        register_kernel("missing-lib", tmp_path / "libnothing.so")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 16, 300])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_matches_f_linear(rows: int, bias: bool, dtype: torch.dtype) -> None:
    if not can_pack(torch.device("cpu"), dtype):
        pytest.skip(f"oneDNN packing unavailable for {dtype} on this CPU")
    w, b = torch.randn(96, 64, dtype=dtype), torch.randn(96, dtype=dtype) if bias else None
    x = torch.randn(rows, 64, dtype=dtype)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    out = PackedLinear(w, b)(x)
    assert out.dtype == dtype
    torch.testing.assert_close(out, F.linear(x, w, b), **tol)
    x3 = torch.randn(2, rows, 64, dtype=dtype)  # leading dims are kept
    torch.testing.assert_close(PackedLinear(w, b)(x3), F.linear(x3, w, b), **tol)
