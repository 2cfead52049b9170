"""Soak: the gateway under mixed traffic and faults, then a check that nothing was left behind.

A ModelRouter with two embedded replicas of one model (each engine core in a process of its own, restart policy)
behind the real app on a loopback uvicorn server. Clients send chat and completion requests, streamed or not,
with random X-Priority (0-100), n (1-3), max_tokens and sampling; some streams are dropped mid-way (the client
disconnects). At evenly spaced times one replica's engine core process is SIGKILLed (as the OOM killer would)
while it has requests in flight; the supervision restarts it. At the end every replica must report 0 requests
running or waiting and 0 KV blocks in use (read from /metrics once each core has run every abort), the router 0
requests in flight, each killed core must have been restarted, and no request may have failed except those the
kills cut (a stream in flight on the killed core ends with an error event; a non-streamed one is retried on the
other replica). Prints a table; exit status 1 if a check failed.

    python benchmarks/soak.py --duration 120 --clients 8 --kills 2 [--record]   # by hand (RESULTS.md)
    tests/test_soak.py runs a short one (a dozen seconds, one kill) in CI.

Without --model a tiny random model is built (tests/tiny_models.py).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import append_results, print_table  # noqa: E402

from kvgate.engine.async_engine import AsyncEngineArgs, AsyncLLMEngine  # noqa: E402
from kvgate.gateway.app import create_app  # noqa: E402
from kvgate.gateway.router import ModelRouter  # noqa: E402
from kvgate.gateway.serving import OpenAIServing  # noqa: E402

MODEL = "tiny"
KILLED = "the engine core process exited"  # what a request cut by a killed core is told
PROMPTS = ["The sky is", "Tell me a story about a robot.", "What is the capital of France?", "Count: 1 2 3",
           "Write a haiku about the sea.", "Why is the grass green?"]


@dataclass
class SoakArgs:
    model: str | None = None  # a local HF directory; None: build a tiny random model
    duration: float = 120.0  # seconds of traffic
    clients: int = 8  # concurrent clients, each sending one request after another
    kills: int = 2  # engine core processes SIGKILLed, evenly spaced, replicas in turn (or one with requests)
    replicas: int = 2
    disconnect: float = 0.2  # share of streams the client drops mid-way
    max_num_seqs: int = 8
    blocks: int = 256  # KV blocks per replica
    seed: int = 0


@dataclass
class Tally:
    requests: int = 0
    served: int = 0
    streamed: int = 0  # of the served: streams that ran to [DONE]
    disconnected: int = 0
    failed_by_kill: int = 0
    tokens: int = 0  # completion tokens of the served
    unexpected: list[str] = field(default_factory=list)

    def failed(self, message: str) -> None:
        if KILLED in message:
            self.failed_by_kill += 1
        else:
            self.unexpected.append(message[:300])


@dataclass
class SoakResult:
    args: SoakArgs
    tally: Tally
    seconds: float
    kills: int
    restarts: int
    retries: int  # requests the router sent again after a replica failed before the first byte
    end_state: dict[str, dict[str, float]]  # replica -> running, waiting, KV usage and free blocks from /metrics
    in_flight: int  # requests the router or an engine still counts at the end

    def problems(self) -> list[str]:
        out = [f"unexpected error: {u}" for u in self.tally.unexpected[:10]]
        for name, m in self.end_state.items():
            if m["running"] or m["waiting"] or m["kv_usage"] or m["free_blocks"] != self.args.blocks:
                out.append(f"{name} at the end: {m}")
        if len(self.end_state) != self.args.replicas:
            out.append(f"/metrics lists {len(self.end_state)} replicas, not {self.args.replicas}")
        if self.in_flight:
            out.append(f"{self.in_flight} requests still counted in flight")
        if self.restarts != self.kills:
            out.append(f"{self.kills} engine cores killed, {self.restarts} restarted")
        if self.tally.served == 0:
            out.append("no request was served")
        return out

    def row(self) -> dict[str, Any]:
        t = self.tally
        return {"seconds": f"{self.seconds:.0f}", "clients": self.args.clients, "requests": t.requests,
                "served": t.served, "of them streamed": t.streamed, "disconnected by the client": t.disconnected,
                "failed by a kill": t.failed_by_kill, "other errors": len(t.unexpected), "kills": self.kills,
                "restarts": self.restarts, "retried": self.retries, "completion tokens": t.tokens,
                "req/s": f"{t.requests / self.seconds:.1f}",
                "running at end": sum(int(m["running"] + m["waiting"]) for m in self.end_state.values()),
                "KV blocks in use at end": sum(self.args.blocks - int(m["free_blocks"])
                                               for m in self.end_state.values())}


# ---- traffic --------------------------------------------------------------------------------------------------
async def one_request(http: httpx.AsyncClient, rng: random.Random, tally: Tally, disconnect: float) -> None:
    chat, stream, n = rng.random() < 0.5, rng.random() < 0.6, rng.choice((1, 1, 2, 3))
    body: dict[str, Any] = {"model": MODEL, "max_tokens": rng.randint(4, 48), "n": n, "stream": stream,
                            "temperature": rng.choice((0.0, 0.8)), "ignore_eos": rng.random() < 0.5}
    prompt = rng.choice(PROMPTS)
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    headers = {"X-Priority": str(rng.randint(0, 100))}
    tally.requests += 1
    if not stream:
        r = await http.post(path, json=body, headers=headers)
        data = r.json()
        if r.status_code != 200:
            return tally.failed(f"{r.status_code}: {data.get('error', {}).get('message', data)}")
        if len(data["choices"]) != n or any(c["finish_reason"] is None for c in data["choices"]):
            return tally.unexpected.append(f"incomplete answer: {data}")
        tally.served += 1
        tally.tokens += data["usage"]["completion_tokens"]
        return
    body["stream_options"] = {"include_usage": True}
    leave_after = rng.randint(1, 6) if rng.random() < disconnect else None  # content events before leaving
    async with http.stream("POST", path, json=body, headers=headers) as r:
        if r.status_code != 200:
            data = json.loads(await r.aread())
            return tally.failed(f"{r.status_code}: {data.get('error', {}).get('message', data)}")
        events, finished, done, error, usage = 0, set(), False, None, 0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]["message"]
                continue
            events += 1
            finished |= {c["index"] for c in event["choices"] if c.get("finish_reason")}
            usage = (event.get("usage") or {}).get("completion_tokens", usage)
            if leave_after is not None and events >= leave_after and len(finished) < n:
                tally.disconnected += 1  # leaving the block closes the connection mid-stream
                return
    if error is not None:
        tally.failed(error)
    elif done and len(finished) == n:
        tally.served += 1
        tally.streamed += 1
        tally.tokens += usage
    else:
        tally.unexpected.append(f"a stream ended without [DONE] or a finish_reason ({events} events)")


async def client(base: str, seed: int, deadline: float, tally: Tally, disconnect: float) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        while time.monotonic() < deadline:
            try:
                await one_request(http, rng, tally, disconnect)
            except (httpx.HTTPError, ValueError, KeyError) as e:
                tally.unexpected.append(f"{type(e).__name__}: {e}")


async def killer(engines: list[AsyncLLMEngine], times: list[float], killed: list[str]) -> None:
    """SIGKILL an engine core at each of `times` (monotonic): the replica in turn if it has requests in flight, else
    one that has (the router may send all traffic to one replica); returns once each death was noticed."""
    for i, at in enumerate(times):
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        for e in engines:  # restarted from an earlier kill
            await asyncio.wait_for(e.wait_until_ready(), 120)
        turn = [engines[(i + k) % len(engines)] for k in range(len(engines))]
        give_up = time.monotonic() + 5
        while not any(e.num_requests for e in turn) and time.monotonic() < give_up:
            await asyncio.sleep(0.01)
        victim = next((e for e in turn if e.num_requests), turn[0])
        restarts = victim.num_restarts
        os.kill(victim.core_pid, signal.SIGKILL)
        killed.append(f"replica {engines.index(victim)} ({victim.num_requests} requests in flight)")
        # until the engine has seen the death: a kill near the end must not pass for a ready replica
        while victim.is_ready and victim.num_restarts == restarts:
            await asyncio.sleep(0.01)


# ---- the run --------------------------------------------------------------------------------------------------
def metrics_of(text: str) -> dict[str, dict[str, float]]:
    names = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
             "vllm:kv_cache_usage_perc": "kv_usage", "kvgate:kv_cache_free_blocks": "free_blocks"}
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name in names and 'model_name="' in line:
            replica = line.split('model_name="', 1)[1].split('"', 1)[0]
            out.setdefault(replica, {})[names[name]] = float(line.rsplit(" ", 1)[1])
    return out


class Server:
    """The app on a loopback uvicorn server, on a thread of its own (its own event loop)."""

    def __init__(self, app: Any) -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.base = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


async def traffic(a: SoakArgs, base: str, engines: list[AsyncLLMEngine], tally: Tally, killed: list[str]) -> float:
    start = time.monotonic()
    deadline = start + a.duration
    kill_times = [start + a.duration * (i + 1) / (a.kills + 1) for i in range(a.kills)]
    tasks = [client(base, a.seed * 1000 + i, deadline, tally, a.disconnect) for i in range(a.clients)]
    await asyncio.wait_for(asyncio.gather(killer(engines, kill_times, killed), *tasks), a.duration + 180)
    seconds = time.monotonic() - start
    for e in engines:  # a killed core may still be restarting; then every core runs the aborts sent to it
        await asyncio.wait_for(e.wait_until_ready(), 120)
        await e.settled_stats(timeout=30)
    return seconds


def run(a: SoakArgs) -> SoakResult:
    model = a.model or build_model()
    engines = [AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
        model=model, served_model_name=MODEL, engine_core_process=True, max_num_seqs=a.max_num_seqs,
        num_gpu_blocks_override=a.blocks, seed=a.seed + i, max_engine_core_restarts=max(3, a.kills)))
        for i in range(a.replicas)]
    router = ModelRouter(cooldown_s=1.0, health_check_interval=2.0)
    router.add_model(MODEL, [OpenAIServing(MODEL, e) for e in engines])
    server = Server(create_app(router))
    tally, killed = Tally(), []
    try:
        for e in engines:
            asyncio.run(e.wait_until_ready(timeout=300))
        seconds = asyncio.run(traffic(a, server.base, engines, tally, killed))
        end_state = metrics_of(httpx.get(f"{server.base}/metrics", timeout=30).text)
        in_flight = router.in_flight() + sum(e.num_requests for e in engines)
        restarts = sum(e.num_restarts for e in engines)
        retries = router.retries
    finally:
        server.stop()
        for e in engines:
            e.shutdown()
    return SoakResult(a, tally, seconds, len(killed), restarts, retries, end_state, in_flight)


def build_model() -> str:
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
    from tiny_models import build_tiny_model

    return build_tiny_model(os.path.join(tempfile.mkdtemp(prefix="kvgate-soak-"), "llama"), "llama")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = SoakArgs()
    p.add_argument("--model", default=None, help="a local HF directory (default: a tiny random model)")
    p.add_argument("--duration", type=float, default=d.duration, help="seconds of traffic")
    p.add_argument("--clients", type=int, default=d.clients)
    p.add_argument("--kills", type=int, default=d.kills, help="engine core processes SIGKILLed during the run")
    p.add_argument("--disconnect", type=float, default=d.disconnect, help="share of streams dropped mid-way")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--record", action="store_true", help="append the table to benchmarks/RESULTS.md")
    ns = p.parse_args(argv)
    a = SoakArgs(model=ns.model, duration=ns.duration, clients=ns.clients, kills=ns.kills, disconnect=ns.disconnect,
                 seed=ns.seed)
    result = run(a)
    print_table([result.row()])
    problems = result.problems()
    for line in problems:
        print(f"FAILED: {line}", file=sys.stderr)
    if ns.record:
        note = ("Checks: " + ("all passed" if not problems else "; ".join(problems)) + f". Model: "
                f"{a.model or 'tiny random Llama (tests/tiny_models.py)'}, {a.replicas} replicas, engine cores in "
                f"their own processes, {a.blocks} KV blocks and max_num_seqs {a.max_num_seqs} each.")
        append_results("Soak", "python benchmarks/soak.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                       [result.row()], section="## Soak (`benchmarks/soak.py`)", note=note)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
