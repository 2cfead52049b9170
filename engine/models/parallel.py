"""Tensor-parallel layers (Megatron-style, vLLM's names): each rank of the tensor-parallel group holds a slice of a
weight and loads only that slice from the full checkpoint tensor (`weight_loader`).

- ColumnParallelLinear: the output features are split. Its output is a list of sections (QKV: q, k, v heads;
  gate/up: two halves), each made of units (a head of head_dim rows, or one row) that are split evenly over the
  ranks; a section with fewer units than ranks (KV heads under TP > num_kv_heads) is replicated: each unit goes to
  world_size / units consecutive ranks. No communication.
- RowParallelLinear: the input features are split the same way (o_proj by heads, down_proj by rows); the partial
  products are summed with one all-reduce, then the bias is added once.
- VocabParallelEmbedding / ParallelLMHead: the vocabulary is split in contiguous ranges (the last one padded); an
  embedding looks up the ids of its range and all-reduces; the LM head all-gathers the logits of every range, so
  every rank holds the whole logits (only the engine's rank samples from them).
At world size 1 each layer is a plain linear or embedding over the full weight (and the CPU path packs the linears,
`packable`).

Every parameter carries `weight_loader(param, full[, section])` and `full_shape` (its shape in the checkpoint), as in
vLLM: the model's loader hands the full checkpoint tensor, or a lazy safetensors slice that only reads the rows or
columns asked for, and a wrong shape is a ValueError naming both shapes."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvgate.engine.distributed.parallel_state import TensorParallelGroup, get_tp_group

Section = tuple[int, int]  # (number of units, rows per unit)


def shape_of(full) -> tuple[int, ...]:
    """The shape of a tensor or of a lazy safetensors slice."""
    return tuple(full.get_shape()) if hasattr(full, "get_shape") else tuple(full.shape)


def check_shape(full, expected: tuple[int, ...]) -> None:
    if shape_of(full) != tuple(expected):
        raise ValueError(f"has shape {shape_of(full)}, expected {tuple(expected)}")


def _attach(module: nn.Module, param: nn.Parameter | None, full_shape: tuple[int, ...]) -> None:
    if param is not None:
        param.weight_loader = module.weight_loader  # type: ignore[attr-defined]
        param.full_shape = full_shape  # type: ignore[attr-defined]


def local_units(num_units: int, tp: TensorParallelGroup) -> tuple[int, int]:
    """(first unit, number of units) of `num_units` that rank tp.rank holds."""
    if num_units >= tp.world_size:
        if num_units % tp.world_size:
            raise ValueError(f"{num_units} units cannot be split evenly over {tp.world_size} tensor-parallel ranks")
        per = num_units // tp.world_size
        return tp.rank * per, per
    if tp.world_size % num_units:
        raise ValueError(f"{num_units} units cannot be replicated evenly over {tp.world_size} tensor-parallel ranks")
    return tp.rank // (tp.world_size // num_units), 1


def _slices(sections: list[Section], tp: TensorParallelGroup) -> list[tuple[int, int]]:
    """(start row in the full tensor, rows) of each section's local part."""
    out, offset = [], 0
    for units, rows in sections:
        first, n = local_units(units, tp)
        out.append((offset + first * rows, n * rows))
        offset += units * rows
    return out


class ColumnParallelLinear(nn.Module):
    def __init__(self, in_features: int, sections: list[Section], bias: bool,
                 tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.tp = tp or get_tp_group()
        self.sections = sections
        self.slices = _slices(sections, self.tp)
        self.output_sizes = [rows for _, rows in self.slices]  # the local size of each section
        self.weight = nn.Parameter(torch.empty(sum(self.output_sizes), in_features))
        self.bias = nn.Parameter(torch.empty(sum(self.output_sizes))) if bias else None
        rows = sum(units * per for units, per in sections)
        _attach(self, self.weight, (rows, in_features))
        _attach(self, self.bias, (rows,))

    @property
    def packable(self) -> bool:
        return self.tp.world_size == 1

    def weight_loader(self, param: nn.Parameter, full, section: int | None = None) -> None:
        """Copy this rank's rows of the full (unsharded) weight or bias into `param`: of every section at once, or,
        with `section`, of that section alone (a checkpoint holds q, k and v, or gate and up, apart)."""
        if section is None:
            check_shape(full, param.full_shape)
            param.data.copy_(torch.cat([full[start:start + n] for start, n in self.slices]))
            return
        units, per = self.sections[section]
        check_shape(full, (units * per,) + tuple(param.full_shape[1:]))
        offset = sum(self.output_sizes[:section])
        start = self.slices[section][0] - sum(u * r for u, r in self.sections[:section])
        n = self.output_sizes[section]
        param.data[offset:offset + n].copy_(full[start:start + n])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    def __init__(self, input_units: Section, out_features: int, bias: bool,
                 tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.tp = tp or get_tp_group()
        ((self.start, self.n),) = _slices([input_units], self.tp)
        self.weight = nn.Parameter(torch.empty(out_features, self.n))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        _attach(self, self.weight, (out_features, input_units[0] * input_units[1]))
        _attach(self, self.bias, (out_features,))

    @property
    def packable(self) -> bool:
        return self.tp.world_size == 1

    def weight_loader(self, param: nn.Parameter, full) -> None:
        """This rank's input columns of the full weight (the bias is whole on every rank)."""
        check_shape(full, param.full_shape)
        param.data.copy_(full[:] if param is self.bias else full[:, self.start:self.start + self.n])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.tp = tp or get_tp_group()
        self.num_embeddings = num_embeddings
        self.per_rank = -(-num_embeddings // self.tp.world_size)
        self.start = self.tp.rank * self.per_rank
        self.end = min(num_embeddings, self.start + self.per_rank)
        self.weight = nn.Parameter(torch.empty(self.per_rank, embedding_dim))
        _attach(self, self.weight, (num_embeddings, embedding_dim))

    def weight_loader(self, param: nn.Parameter, full) -> None:
        """This rank's vocabulary range of the full table; the padding rows past the vocabulary are zero."""
        check_shape(full, param.full_shape)
        param.data.zero_()
        if self.end > self.start:
            param.data[: self.end - self.start].copy_(full[self.start:self.end])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(ids, self.weight)
        mine = (ids >= self.start) & (ids < self.end)
        out = F.embedding(torch.where(mine, ids - self.start, 0), self.weight)
        return self.tp.all_reduce(out * mine.unsqueeze(-1).to(out.dtype))


    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary on every rank: [tokens, num_embeddings] (a tied LM head is the
        embedding itself)."""
        local = F.linear(hidden, self.weight)
        return self.tp.all_gather(local, dim=-1)[..., : self.num_embeddings]


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection over the vocabulary, split like VocabParallelEmbedding."""
