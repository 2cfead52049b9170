"""NCCL all-reduce on this host's GPUs at the message sizes a tensor-parallel step sends: a decode step all-reduces
[batch, hidden_size] twice per layer (after o_proj and after down_proj), a prompt chunk [tokens, hidden_size].
One process per GPU, as the engine's ranks run. Reports the time per all-reduce in eager launches and replayed
from a CUDA graph (as the engine's decode graphs run them), and the bus bandwidth (algorithm bandwidth x
2(n-1)/n, nccl-tests' definition) from the graph time.

  python benchmarks/allreduce.py                                  # every GPU, hidden sizes 4096 and 8192
  python benchmarks/allreduce.py --world-size 2 --rows 1 64 256 8192 --record "NCCL all-reduce"
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import append_results, print_table  # noqa: E402


def timed_us(fn, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def measure(x: torch.Tensor, iters: int) -> tuple[float, float]:
    """(eager, graph) microseconds per all-reduce of x; the group agrees on the figures (their max)."""
    for _ in range(5):
        dist.all_reduce(x)

    def eager() -> None:
        for _ in range(iters):
            dist.all_reduce(x)

    eager_us = timed_us(eager, iters)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # a warm-up on the capture stream
        dist.all_reduce(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            dist.all_reduce(x)
    graph.replay()
    graph_us = timed_us(graph.replay, iters)
    t = torch.tensor([eager_us, graph_us], device=x.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0]), float(t[1])


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=world, rank=rank,
                            device_id=torch.device("cuda", rank))
    dtype = getattr(torch, args.dtype)
    rows = []
    for hidden in args.hidden:
        for n in args.rows:
            x = torch.ones((n, hidden), dtype=dtype, device="cuda")
            eager_us, graph_us = measure(x, args.iters)
            size = x.numel() * x.element_size()
            bus = size / (graph_us * 1e-6) * 2 * (world - 1) / world / 1e9
            rows.append({"hidden": hidden, "rows": n, "bytes": size, "eager_us": round(eager_us, 1),
                         "graph_us": round(graph_us, 1), "busbw_GB_s": round(bus, 1)})
    ok = torch.full((4,), 1.0, device="cuda")
    dist.all_reduce(ok)
    assert float(ok[0]) == world, "the all-reduce summed wrongly"
    if rank == 0:
        print(f"# NCCL all-reduce, {world} x {torch.cuda.get_device_name(0)}, {args.dtype}, "
              f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
        print_table(rows)
        if args.record:
            append_results(args.record, " ".join(sys.argv), rows)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=None, help="default: every GPU")
    ap.add_argument("--hidden", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 128, 256, 2048, 8192],
                    help="a decode step's batch, or a prompt chunk's tokens")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--record", default=None, help="a label: append the rows to benchmarks/RESULTS.md")
    args = ap.parse_args()
    world = args.world_size or torch.cuda.device_count()
    if world < 2:
        sys.exit(f"an all-reduce needs 2 GPUs or more; this host has {torch.cuda.device_count()}")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(world, port, args), nprocs=world)


if __name__ == "__main__":
    main()
