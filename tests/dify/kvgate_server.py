"""kvgate gateways on loopback for the Dify plugin tests, serving tiny random models (run with the main venv).

    python tests/dify/kvgate_server.py --model-dir DIR --record FILE --ready FILE

starts four gateways in this one process (one torch import), each a real uvicorn server:
  main  scheduler_delay 30 s: a request is held that long unless its X-Max-Batch-Delay-Ms asks for less;
        model "auto" is routed to the tiny model
  auth  the same without the delay, with --api-key AUTH_KEY
  busy  one seat (max_num_seqs 1), no queue (max_queue_len 0), every engine step slowed by 50 ms: while one
        request runs, every other gets 429
  embed a tiny random embedding model (Qwen3Model with sentence-transformers pooling files, so kvgate serves it
        with the pooling runner) as EMBED_MODEL, built in --model-dir's sibling "<dir>-embed". The same request
        must give the same vectors to the last bit, and on a CPU engine those bits depend on which prompts share
        a step and on whether a prefix came from the KV cache: so scheduler_delay 30 s as main (a request's
        X-Max-Batch-Delay-Ms window puts all its inputs into one step) and no prefix caching
It writes {"main": url, "auth": url, "busy": url, "embed": url} to the --ready file once all are up, and appends
one JSON line per request that an engine accepted to the --record file (an embedding request: one line per input),
read from the engine's own Request and Scheduler: request_id, server, prompt (decoded), priority, max_batch_delay
(s), batch_window (s, the scheduler's hold) and the request's sampling parameters.
It runs until it is terminated.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

TESTS_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS_DIR))  # tiny_models

MODEL = "tiny"
EMBED_MODEL = "tiny-embed"
AUTH_KEY = "sekret-dify"
SCHEDULER_DELAY_S = 30.0
BUSY_STEP_DELAY_S = 0.05
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty", "seed", "max_tokens",
                   "stop")


def record_requests(name: str, async_engine: Any, record: Path, lock: threading.Lock) -> None:
    """Wrap this engine's LLMEngine.add_request (an instance attribute, engine code untouched) so that every
    accepted request is written down as the engine and its scheduler see it."""
    core = async_engine.engine
    original = core.add_request

    def add_request(request_id: str, *args: Any, **kwargs: Any) -> None:
        original(request_id, *args, **kwargs)
        req = core.requests[request_id]
        seq = req.seqs[0]
        line = {"server": name, "request_id": request_id, "prompt": core.tokenizer.decode(req.prompt_token_ids),
                "priority": req.priority, "max_batch_delay": req.max_batch_delay,
                "batch_window": core.scheduler.batch_deadline(seq) - seq.arrival_time,
                "sampling": {k: getattr(req.sampling_params, k, None) for k in SAMPLING_FIELDS}}
        with lock, record.open("a") as f:
            f.write(json.dumps(line) + "\n")

    core.add_request = add_request


def slow_steps(async_engine: Any, seconds: float) -> None:
    core = async_engine.engine
    original = core.step

    def step(*args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return original(*args, **kwargs)

    core.step = step


def start_gateway(engine: Any, name: str, auto_route: bool, app_kwargs: dict[str, Any]) -> str:
    """A uvicorn server on a free loopback port serving `engine` as `name`; returns its URL once it listens."""
    import uvicorn

    from kvgate.gateway.app import create_app
    from kvgate.gateway.serving import OpenAIServing

    app = create_app({name: OpenAIServing(name, engine)}, **app_kwargs)
    if auto_route:
        app.state.router.add_route("auto", lambda request: MODEL)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"uvicorn did not start on port {port}")
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-dir", required=True, help="where the tiny model is (built there if missing)")
    p.add_argument("--record", required=True, type=Path)
    p.add_argument("--ready", required=True, type=Path)
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(1)  # tiny models run faster on one thread, and the machine is shared
    from tiny_models import build_tiny_embedding_model, build_tiny_model

    from kvgate.engine.async_engine import AsyncEngineArgs, AsyncLLMEngine

    model_dir = Path(args.model_dir)
    embed_dir = model_dir.with_name(model_dir.name + "-embed")
    if not (model_dir / "config.json").exists():
        build_tiny_model(model_dir, "qwen3")
    if not (embed_dir / "config.json").exists():
        build_tiny_embedding_model(embed_dir, "qwen3", seed=3)
    common = dict(model=str(model_dir), num_gpu_blocks_override=128)
    specs = {
        "main": (dict(max_num_seqs=16, scheduler_delay=SCHEDULER_DELAY_S), {}),
        "auth": (dict(max_num_seqs=16), {"api_key": AUTH_KEY}),
        "busy": (dict(max_num_seqs=1), {"max_queue_len": 0}),
        "embed": (dict(max_num_seqs=16, scheduler_delay=SCHEDULER_DELAY_S, enable_prefix_caching=False,
                       model=str(embed_dir)), {}),
    }
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    lock, urls, threads = threading.Lock(), {}, []
    args.record.touch()

    def serve(name: str, engine_kwargs: dict, app_kwargs: dict, up: threading.Event) -> None:
        engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(**{**common, **engine_kwargs}))
        asyncio.run(engine.wait_until_ready(timeout=120))
        record_requests(name, engine, args.record, lock)
        if name == "busy":
            slow_steps(engine, BUSY_STEP_DELAY_S)
        served = EMBED_MODEL if name == "embed" else MODEL
        urls[name] = start_gateway(engine, served, name == "main", app_kwargs)
        up.set()

    for name, (engine_kwargs, app_kwargs) in specs.items():
        up = threading.Event()
        t = threading.Thread(target=serve, args=(name, engine_kwargs, app_kwargs, up), daemon=True)
        t.start()
        threads.append((name, t, up))
    for name, t, up in threads:
        while not up.wait(0.2):
            if not t.is_alive():
                print(f"kvgate_server: the {name} gateway failed to start", file=sys.stderr)
                return 1
    tmp = args.ready.with_suffix(".tmp")
    tmp.write_text(json.dumps(urls))
    tmp.rename(args.ready)  # atomic: the reader never sees half a file
    print(f"kvgate_server: serving {urls}", file=sys.stderr, flush=True)
    stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
