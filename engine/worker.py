"""A worker: one rank's ModelRunner (its tensor-parallel slice of its pipeline stage), stepping as rank 0 (the engine
core) tells it.

The engine core schedules once and sends each step's StepInput (engine/step_input.py) to every rank over the CPU group;
every rank runs its part of the same step (the parallel layers' all-reduces, the logits' all-gather and the stages'
sends meet there), and rank 0 samples. A broadcast of None ends the loop.

`python -m kvgate.engine.worker` is how the "mp" executor starts ranks 1..N-1 on this host: the EngineArgs arrive
pickled on stdin, the rank and the rendezvous in torch.distributed's environment variables (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Such a worker dies with the process that started it.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import sys

import torch

from kvgate.engine.config import EngineArgs, EngineConfig
from kvgate.engine.distributed.parallel_state import destroy_model_parallel, get_world_group, init_model_parallel

logger = logging.getLogger(__name__)


def rank_config(config: EngineConfig, local_rank: int) -> EngineConfig:
    """The config of the rank with `local_rank` on its host: on CUDA, the device after the configured one by
    local_rank (cuda or cuda:0 -> cuda:1 for local rank 1), always with its index (torch.cuda.set_device needs it)."""
    if config.device.type != "cuda":
        return config
    base = config.device.index or 0
    return dataclasses.replace(config, device=torch.device("cuda", base + local_rank))


def init_rank(config: EngineConfig, rank: int, local_rank: int, init_method: str) -> EngineConfig:
    """Join the tensor_parallel_size x pipeline_parallel_size ranks as `rank` on this rank's device, with this
    host's cores shared among its ranks; returns the rank's config."""
    a = config.args
    world_size = a.tensor_parallel_size * a.pipeline_parallel_size
    config = rank_config(config, local_rank)
    if config.device.type == "cuda":
        torch.cuda.set_device(config.device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // min(world_size, os.cpu_count() or 1)))
    backend = "nccl" if config.device.type == "cuda" else "gloo"
    init_model_parallel(a.tensor_parallel_size, a.pipeline_parallel_size, rank, backend, init_method,
                        execute_model_timeout_s())
    return config


def execute_model_timeout_s() -> float:
    """How long a step may wait on another rank before it fails (a rank that hangs: its peers give up, and the
    engine core exits to be restarted): KVGATE_EXECUTE_MODEL_TIMEOUT_SECONDS, 300 by default, as vLLM's
    VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS. The same on every rank; it also bounds the rendezvous at start."""
    value = os.environ.get("KVGATE_EXECUTE_MODEL_TIMEOUT_SECONDS", "300")
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"KVGATE_EXECUTE_MODEL_TIMEOUT_SECONDS must be a number of seconds > 0, not {value!r}")
    return seconds


def serve_steps(runner) -> None:
    """Run every step rank 0 broadcasts until it broadcasts None."""
    world = get_world_group()
    while True:
        msg = world.broadcast_object(None, src=0)
        if msg is None:
            return
        kind, step = msg
        if kind == "execute":
            runner.execute(step)
        elif kind == "offload":
            runner.offload.apply(step)
        else:
            runner.execute_hidden(step)


def run_worker(args: EngineArgs, rank: int, local_rank: int, init_method: str = "env://") -> None:
    from kvgate.engine.model_runner import ModelRunner

    config = init_rank(EngineConfig.from_args(args), rank, local_rank, init_method)
    world_size = args.tensor_parallel_size * args.pipeline_parallel_size
    try:
        runner = ModelRunner(config)
        logger.info("rank %d/%d ready on %s (%d KV blocks)", rank, world_size, config.device, runner.num_blocks)
        serve_steps(runner)
        if runner.offload is not None and runner.offload.disk is not None:
            runner.offload.disk.flush()
    except BaseException:
        # say why now, and leave without a goodbye: the other ranks may wait in a collective that this rank never
        # joins, and on NCCL destroying the group would wait for it too
        logger.exception("rank %d failed", rank)
        sys.stderr.flush()
        os._exit(1)
    destroy_model_parallel()


def _die_with_parent() -> None:
    """Ask Linux to kill this process when the one that started it dies (prctl PR_SET_PDEATHSIG)."""
    parent = os.getppid()
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux / glibc: the broken connection ends the loop instead
        return
    if os.getppid() != parent:  # it died before prctl took effect
        os._exit(1)


def main() -> None:
    _die_with_parent()
    level = int(os.environ.get("KVGATE_LOG_LEVEL", logging.WARNING))
    logging.basicConfig(level=level, format=f"%(asctime)s rank {os.environ.get('RANK')} %(levelname)s %(message)s")
    args = pickle.load(sys.stdin.buffer)
    run_worker(args, int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))


if __name__ == "__main__":
    main()
