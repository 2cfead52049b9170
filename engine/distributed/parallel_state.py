"""The tensor-parallel group of this process (vLLM's names): its rank and size, and the two collectives the
parallel layers use. Without init_tensor_parallel the group is this process alone (size 1), and every collective
is the identity, so the layers of engine/models/linear.py run unchanged on one device."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class TensorParallelGroup:
    rank: int = 0
    world_size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup (None: the default group, or no group at size 1)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the group, in place."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` concatenated along `dim`, in rank order."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


_TP = TensorParallelGroup()


def init_tensor_parallel(world_size: int, rank: int, backend: str, init_method: str = "env://") -> None:
    """Join the tensor-parallel group of `world_size` ranks as `rank` (one group of every rank: no pipeline
    stages yet)."""
    global _TP
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, world_size=world_size, rank=rank)
    _TP = TensorParallelGroup(rank, world_size, None)


def get_tp_group() -> TensorParallelGroup:
    return _TP


def destroy_tensor_parallel() -> None:
    global _TP
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP = TensorParallelGroup()
