"""The parallel groups of this process (vLLM's layout and names). With tensor_parallel_size T and
pipeline_parallel_size P there are T x P ranks, tensor-parallel fastest: rank = stage * T + tp_rank.

- the tensor-parallel group: the T ranks of this pipeline stage, and the collectives the parallel layers use;
- the pipeline-parallel group: this rank's stage, and point-to-point sends of a step's hidden states to the same
  tp_rank of the next stage; the logits go from the last stage to rank 0 (which samples) over a group of those two
  ranks alone: on NCCL each group's transfers run in order on a stream of their own, and on one stream rank 0's send
  of the next step's hidden states and its receive of this step's logits would wait on each other;
- the world group: every rank, with a CPU (gloo) group for what they agree on outside the model (the number of KV
  blocks) and another for each step's StepInput, which a worker may wait for as long as the server is idle.
Every collective and stage-to-stage transfer of a step times out after `timeout_s` (a rank that hangs makes the
step fail: engine/executor.py); only the wait for the next StepInput has no limit.
Without init_model_parallel every group is this process alone (size 1) and every collective is the identity, so the
layers of engine/models/parallel.py and the model run unchanged on one device."""
from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass, field
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


@dataclass
class PipelineParallelGroup:
    rank: int = 0  # this rank's stage
    world_size: int = 1  # stages
    prev_rank: int | None = None  # the global rank this stage receives from (same tp_rank, previous stage)
    next_rank: int | None = None  # and sends to
    output_group: Any = None  # the last stage's first rank and rank 0: the logits (None: the default group)
    _sends: list = field(default_factory=list)  # (work, tensor) of sends not known to be done

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1

    def send(self, tensors: list[torch.Tensor], dst: int | None = None) -> None:
        """Send tensors to the next stage, or to global rank `dst`, without waiting for the receiver (a stage goes on
        with the next batch meanwhile); the previous sends are completed first. A send to `dst` goes over the output
        group."""
        self.wait_sends()
        group = None if dst is None else self.output_group
        for t in tensors:
            t = t.contiguous()
            self._sends.append((dist.isend(t, dst=self.next_rank if dst is None else dst, group=group), t))

    def wait_sends(self) -> None:
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()

    def recv(self, shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device,
             src: int | None = None) -> list[torch.Tensor]:
        """Receive tensors of these shapes from the previous stage, or from global rank `src` (the output group)."""
        out = [torch.empty(shape, dtype=dtype, device=device) for shape in shapes]
        group = None if src is None else self.output_group
        for t in out:
            dist.recv(t, src=self.prev_rank if src is None else src, group=group)
        return out


@dataclass
class WorldGroup:
    rank: int = 0
    world_size: int = 1
    cpu_group: Any = None  # gloo over every rank (None: the default group, when it is gloo itself)
    message_group: Any = None  # gloo over every rank, without a practical timeout: the StepInputs
    _sends: list = field(default_factory=list)  # (work, tensor) of objects sent and maybe not received yet

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's `value`."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (pickled, over the CPU group)."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """`obj` of rank `src` on every rank. The source sends it (pickled, over the CPU group) to each other rank
        without waiting for them, so that rank 0 can start the next step while a pipeline stage still works on this
        one; the others wait for it. Objects arrive in the order they were sent."""
        if self.world_size == 1:
            return obj
        if self.rank == src:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.long)
            self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]
            for r in range(self.world_size):
                if r != src:
                    for t in (size, data):
                        self._sends.append((dist.isend(t, r, group=self.message_group, tag=OBJECT_TAG), t))
            return obj
        size = torch.empty(1, dtype=torch.long)
        dist.recv(size, src, group=self.message_group, tag=OBJECT_TAG)  # (idle: any time)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(data, src, group=self.message_group, tag=OBJECT_TAG)
        return pickle.loads(data.numpy().tobytes())

    def wait_sends(self) -> None:
        """Until every object sent has been received."""
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()


OBJECT_TAG = 7  # point-to-point tag of the objects (steps), apart from the stages' tensors (tag 0)
NO_TIMEOUT_S = 10 * 365 * 86400  # the StepInput group's timeout: ten years

_TP = TensorParallelGroup()
_PP = PipelineParallelGroup()
_WORLD = WorldGroup()


def init_model_parallel(tensor_parallel_size: int, pipeline_parallel_size: int, rank: int, backend: str,
                        init_method: str = "env://", timeout_s: float = 300.0) -> None:
    """Join the tensor_parallel_size x pipeline_parallel_size ranks as global `rank` and set up its groups; a
    step's collectives and transfers (and the rendezvous) time out after timeout_s."""
    global _TP, _PP, _WORLD
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    world = tp * pp
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, world_size=world, rank=rank,
                                timeout=datetime.timedelta(seconds=timeout_s))
    stage, tp_rank = divmod(rank, tp)
    tp_group = None  # one stage: the default group
    if pp > 1:
        for s in range(pp):  # every rank creates every group, in the same order
            g = dist.new_group(list(range(s * tp, (s + 1) * tp)))
            if s == stage:
                tp_group = g
    output_group = dist.new_group([0, (pp - 1) * tp]) if pp > 1 else None
    cpu_group = dist.new_group(backend="gloo") if backend != "gloo" and world > 1 else None
    message_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=NO_TIMEOUT_S))
    _TP = TensorParallelGroup(tp_rank, tp, tp_group)
    _PP = PipelineParallelGroup(stage, pp, rank - tp if stage > 0 else None, rank + tp if stage < pp - 1 else None,
                                output_group)
    _WORLD = WorldGroup(rank, world, cpu_group, message_group)


def get_tp_group() -> TensorParallelGroup:
    return _TP


def get_pp_group() -> PipelineParallelGroup:
    return _PP


def get_world_group() -> WorldGroup:
    return _WORLD


def destroy_model_parallel() -> None:
    global _TP, _PP, _WORLD
    if dist.is_initialized():
        try:  # what this rank sent must arrive before the group goes
            _WORLD.wait_sends()
            _PP.wait_sends()
        except RuntimeError:  # a peer is gone: nothing to wait for
            pass
        dist.destroy_process_group()
    _TP, _PP, _WORLD = TensorParallelGroup(), PipelineParallelGroup(), WorldGroup()
