"""Executor: runs each step on every rank. Rank 0's ModelRunner lives in this process (the engine core, which samples
from the logits); with N = tensor_parallel_size x pipeline_parallel_size > 1 the other ranks are workers
(engine/worker.py), each sent every step's StepInput over torch.distributed (point to point from rank 0, which does
not wait for them: WorldGroup.broadcast_object); the last pipeline stage sends the logits back to rank 0.

distributed_executor_backend:
- "mp" (the default for N > 1): this process starts ranks 1..N-1 on this host (`python -m kvgate.engine.worker`,
  one per GPU on CUDA, one per share of the cores on CPU) and rendezvouses with them on a free loopback port;
- "external_launcher" (or "external"): every rank was started by a launcher (torchrun, Slurm, a Kubernetes
  LeaderWorkerSet) with torch.distributed's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT);
  rank 0 runs the engine (`kvgate serve`), the others run `kvgate worker` with the same engine flags.

A worker that dies, or a step that fails on any rank, leaves the ranks out of step: the executor is then dead, and
each later step raises RuntimeError saying why. In the engine core process, and on CUDA (where a collective waiting
on a dead peer would hang), the process exits with status 1 instead: AsyncLLMEngine then restarts the engine core,
workers and all (on_engine_core_death).
"""
from __future__ import annotations

import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import torch

from kvgate.engine.config import EngineConfig
from kvgate.engine.distributed.parallel_state import destroy_model_parallel, get_world_group
from kvgate.engine.step_input import StepInput

logger = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launcher_rank(world_size: int) -> tuple[int, int]:
    """(rank, local rank) of this process as its launcher set them; it must be rank 0 of world_size ranks."""
    env = os.environ
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise ValueError(f"distributed_executor_backend external_launcher joins through torch.distributed's "
                         f"environment, and {', '.join(missing)} not set")
    if int(env["WORLD_SIZE"]) != world_size:
        raise ValueError(f"WORLD_SIZE is {env['WORLD_SIZE']}, and tensor_parallel_size x pipeline_parallel_size is "
                         f"{world_size}")
    if int(env["RANK"]) != 0:
        raise ValueError(f"the engine runs on rank 0, and this is rank {env['RANK']}: run `kvgate worker` there")
    return 0, int(env.get("LOCAL_RANK", 0))


class Executor:
    def __init__(self, config: EngineConfig) -> None:
        from kvgate.engine.model_runner import ModelRunner
        from kvgate.engine.worker import init_rank

        self.config = config
        a = config.args
        self.world_size = a.tensor_parallel_size * a.pipeline_parallel_size
        self.workers: list[subprocess.Popen] = []
        self.dead: str | None = None  # why the ranks can no longer step
        self.exit_on_worker_death = False  # set in the engine core process: exit, to be restarted whole
        self._closing = False
        try:
            if self.world_size > 1:
                if a.executor_backend == "mp":
                    port = _free_port()
                    self._start_workers(port)
                    threading.Thread(target=self._watch, name="kvgate-tp-watch", daemon=True).start()
                    config = init_rank(config, 0, 0, f"tcp://127.0.0.1:{port}")
                else:
                    config = init_rank(config, *_launcher_rank(self.world_size), "env://")
            self.runner = ModelRunner(config)
        except BaseException as e:
            if self.world_size > 1:  # say why before the cleanup, which a rank stuck in a collective can slow
                logger.error("rank 0 failed to start: %s: %s", type(e).__name__, e)
                self.dead = f"the parallel engine failed to start ({type(e).__name__}: {e})"
            self.shutdown()
            raise

    # ---- steps ---------------------------------------------------------------------------------------------------
    @property
    def pipeline_depth(self) -> int:
        """Steps that may be in flight at once: one per pipeline stage (vLLM's virtual engines)."""
        return self.config.args.pipeline_parallel_size

    def execute(self, step: StepInput) -> torch.Tensor:
        return self.finish(self.start(step))

    def start(self, step: StepInput, sampled: torch.Tensor | None = None) -> Any:
        """Start a step on every rank; its logits come from finish(), in the order steps started. `sampled`: the
        previous step's sampled tokens on the device, for the step's pending tokens (async scheduling: one rank)."""
        return self._guard(lambda: self._tell(("execute", step)) or self.runner.start(step, sampled))

    def finish(self, started: Any) -> torch.Tensor:
        return self._guard(lambda: self.runner.finish(started))

    def execute_hidden(self, step: StepInput) -> torch.Tensor:
        return self._guard(lambda: self._tell(("execute_hidden", step)) or self.runner.execute_hidden(step))

    def apply_offload(self, ops: list[tuple]) -> None:
        """Run offload ops on every rank outside a step (the disk tier's reads for a request that waits on them
        while nothing else runs)."""
        self._guard(lambda: self._tell(("offload", ops)) or self.runner.offload.apply(ops))

    def _tell(self, msg: Any) -> None:
        if self.world_size > 1:
            get_world_group().broadcast_object(msg, src=0)

    def _guard(self, fn: Any) -> Any:
        if self.world_size == 1:
            return fn()
        if self.dead is not None:
            raise RuntimeError(self.dead)
        try:
            return fn()
        except Exception as e:  # the ranks are out of step now (a rank died, or this one failed mid-step)
            self._die(f"a parallel step failed ({type(e).__name__}: {e}): the ranks are out of step")
            raise RuntimeError(self.dead) from e

    def _die(self, why: str) -> None:
        if self.dead is None:
            self.dead = why
            logger.error("%s", why)
        if self.exit_on_worker_death or self.config.device.type == "cuda":  # (NCCL would wait on a dead rank)
            os._exit(1)

    # ---- workers ---------------------------------------------------------------------------------------------------
    def _start_workers(self, port: int) -> None:
        payload = pickle.dumps(self.config.args)
        level = logging.getLogger("kvgate").getEffectiveLevel()
        for rank in range(1, self.world_size):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(self.world_size),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), KVGATE_LOG_LEVEL=str(level))
            p = subprocess.Popen([sys.executable, "-m", "kvgate.engine.worker"], stdin=subprocess.PIPE, env=env)
            p.stdin.write(payload)  # type: ignore[union-attr]
            p.stdin.close()  # type: ignore[union-attr]
            self.workers.append(p)

    def _watch(self) -> None:
        """Notice a worker that exits while the engine runs."""
        while not self._closing:
            for rank, p in enumerate(self.workers, start=1):
                code = p.poll()
                if code is not None and not self._closing:
                    self._die(f"rank {rank} exited (status {code}): this engine cannot step")
                    return
            time.sleep(0.5)

    def shutdown(self) -> None:
        """End the workers (a broadcast of None, then a kill for any that does not exit) and leave the group."""
        if self._closing:
            return
        self._closing = True
        store = getattr(getattr(self, "runner", None), "offload", None)
        if store is not None and store.disk is not None and self.dead is None:
            store.disk.flush()  # the blocks spilled so far reach their files (a later server reads them)
        if self.world_size > 1 and self.dead is None and hasattr(self, "runner"):  # (not while starting: no step loop)
            try:
                get_world_group().broadcast_object(None, src=0)
            except RuntimeError:
                pass
        for p in self.workers:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.world_size > 1 and not (self.dead is not None and self.config.device.type == "cuda"):
            destroy_model_parallel()  # (not after a failure on NCCL: destroying waits for the collective in flight)
