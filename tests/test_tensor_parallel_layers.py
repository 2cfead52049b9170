"""The tensor-parallel layers (engine/models/parallel.py) in real processes over gloo: every rank loads its slices
from the same full weights, and the sharded QKV / o_proj / gate-up / down_proj / embedding / LM head give what the
full weights give (KV heads replicated where TP > num_kv_heads)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

HIDDEN, HEAD_DIM, HEADS, KV_HEADS, INTER, VOCAB = 32, 8, 4, 2, 48, 101  # a vocabulary no world size divides


def full_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)  # float64: sums in another order agree

    qkv_rows = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    return {"qkv": rnd(qkv_rows, HIDDEN), "qkv_bias": rnd(qkv_rows), "o": rnd(HIDDEN, HEADS * HEAD_DIM),
            "o_bias": rnd(HIDDEN), "gate_up": rnd(2 * INTER, HIDDEN), "down": rnd(HIDDEN, INTER),
            "embed": rnd(VOCAB, HIDDEN), "x": rnd(5, HIDDEN), "ids": torch.tensor([0, 7, 50, 51, 99, 100])}


def reference(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What one process computes with the full weights: q, k, v per head, and each layer's output."""
    qkv = F.linear(w["x"], w["qkv"], w["qkv_bias"])
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    gate, up = F.linear(w["x"], w["gate_up"]).chunk(2, dim=-1)
    return {"q": q.view(5, HEADS, HEAD_DIM), "k": k.view(5, KV_HEADS, HEAD_DIM), "v": v.view(5, KV_HEADS, HEAD_DIM),
            "o": F.linear(q, w["o"], w["o_bias"]), "mlp": F.linear(F.silu(gate) * up, w["down"]),
            "embed": F.embedding(w["ids"], w["embed"]), "logits": F.linear(w["x"], w["embed"])}


def rank_main(rank: int, world: int, init_file: str) -> None:
    torch.manual_seed(1234 + rank)  # parameters are created uninitialized: only the loaded slices may count
    torch.set_default_dtype(torch.float64)
    from kvgate.engine.distributed.parallel_state import destroy_model_parallel, get_world_group, init_model_parallel
    from kvgate.engine.models.parallel import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                                             VocabParallelEmbedding, local_units)

    init_model_parallel(world, 1, rank, "gloo", f"file://{init_file}")
    try:
        w, ref = full_weights(), None
        ref = reference(w)
        qkv = ColumnParallelLinear(HIDDEN, [(HEADS, HEAD_DIM), (KV_HEADS, HEAD_DIM), (KV_HEADS, HEAD_DIM)], True)
        o_proj = RowParallelLinear((HEADS, HEAD_DIM), HIDDEN, True)
        gate_up = ColumnParallelLinear(HIDDEN, [(INTER, 1), (INTER, 1)], False)
        down = RowParallelLinear((INTER, 1), HIDDEN, False)
        embed, head = VocabParallelEmbedding(VOCAB, HIDDEN), ParallelLMHead(VOCAB, HIDDEN)
        with torch.no_grad():
            for layer, name in ((qkv, "qkv"), (o_proj, "o"), (gate_up, "gate_up"), (down, "down"), (embed, "embed"),
                                (head, "embed")):
                layer.weight_loader(layer.weight, w[name])
                if getattr(layer, "bias", None) is not None:
                    layer.weight_loader(layer.bias, w[name + "_bias"])
            q, k, v = qkv(w["x"]).split(qkv.output_sizes, dim=-1)
            apart = ColumnParallelLinear(HIDDEN, [(HEADS, HEAD_DIM), (KV_HEADS, HEAD_DIM), (KV_HEADS, HEAD_DIM)], True)
            for param, whole in ((apart.weight, w["qkv"]), (apart.bias, w["qkv_bias"])):
                for i, part in enumerate(whole.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM])):
                    apart.weight_loader(param, part, i)  # q, k and v as a checkpoint holds them
            torch.testing.assert_close(apart(w["x"]), qkv(w["x"]), rtol=0, atol=0)
            q_first, q_n = local_units(HEADS, qkv.tp)
            kv_first, kv_n = local_units(KV_HEADS, qkv.tp)
            torch.testing.assert_close(q.view(5, q_n, HEAD_DIM), ref["q"][:, q_first:q_first + q_n])
            torch.testing.assert_close(k.view(5, kv_n, HEAD_DIM), ref["k"][:, kv_first:kv_first + kv_n])
            torch.testing.assert_close(v.view(5, kv_n, HEAD_DIM), ref["v"][:, kv_first:kv_first + kv_n])
            torch.testing.assert_close(o_proj(q), ref["o"])  # this rank's heads in, the sum over ranks out
            gate, up = gate_up(w["x"]).split(gate_up.output_sizes, dim=-1)
            torch.testing.assert_close(down(F.silu(gate) * up), ref["mlp"])
            torch.testing.assert_close(embed(w["ids"]), ref["embed"])
            torch.testing.assert_close(head.compute_logits(w["x"]), ref["logits"])
            everyone = get_world_group()
            assert everyone.min_over_ranks(10 + rank) == 10  # (the KV blocks every rank can hold)
            assert everyone.broadcast_object({"from": rank} if rank == 0 else None) == {"from": 0}
    finally:
        destroy_model_parallel()


class LazySlice:
    """A safetensors slice stand-in that counts the elements read through it."""

    def __init__(self, full: torch.Tensor) -> None:
        self.full, self.read = full, 0

    def get_shape(self) -> list[int]:
        return list(self.full.shape)

    def __getitem__(self, key) -> torch.Tensor:
        out = self.full[key]
        self.read += out.numel()
        return out


def test_a_rank_reads_only_its_slices_of_a_lazy_tensor() -> None:
    from kvgate.engine.distributed.parallel_state import TensorParallelGroup
    from kvgate.engine.models.parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    w = full_weights()
    for rank in range(4):
        tp = TensorParallelGroup(rank, 4)
        qkv = ColumnParallelLinear(HIDDEN, [(HEADS, HEAD_DIM), (KV_HEADS, HEAD_DIM), (KV_HEADS, HEAD_DIM)], False, tp)
        down = RowParallelLinear((INTER, 1), HIDDEN, False, tp)
        embed = VocabParallelEmbedding(VOCAB, HIDDEN, tp)
        parts = [LazySlice(t) for t in w["qkv"].float().split([HEADS * HEAD_DIM] + [KV_HEADS * HEAD_DIM] * 2)]
        for i, part in enumerate(parts):
            qkv.weight_loader(qkv.weight, part, i)
        lazy_down, lazy_embed = LazySlice(w["down"].float()), LazySlice(w["embed"].float())
        down.weight_loader(down.weight, lazy_down)
        embed.weight_loader(embed.weight, lazy_embed)
        assert sum(p.read for p in parts) == qkv.weight.numel()  # a quarter of q, one of the two KV heads
        assert lazy_down.read == down.weight.numel() == HIDDEN * INTER // 4
        assert lazy_embed.read == (embed.end - embed.start) * HIDDEN
        with pytest.raises(ValueError, match=r"has shape \(48, 32\), expected \(32, 48\)"):
            down.weight_loader(down.weight, w["down"].T)


@pytest.mark.parametrize("world", [1, 2, 4])  # 4 ranks over 2 KV heads: each KV head on two ranks
def test_sharded_layers_equal_the_full_weights(world: int, tmp_path: Path) -> None:
    mp.spawn(rank_main, args=(world, str(tmp_path / "rendezvous")), nprocs=world, join=True)


def test_a_split_that_does_not_divide_is_refused() -> None:
    from kvgate.engine.distributed.parallel_state import TensorParallelGroup
    from kvgate.engine.models.parallel import local_units

    with pytest.raises(ValueError, match="6 units cannot be split evenly over 4 tensor-parallel ranks"):
        local_units(6, TensorParallelGroup(0, 4))
    with pytest.raises(ValueError, match="3 units cannot be replicated evenly over 4"):
        local_units(3, TensorParallelGroup(0, 4))
    assert [local_units(2, TensorParallelGroup(r, 4)) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
