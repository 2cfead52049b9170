"""kvgate gateways on loopback for the Dify plugin tests, serving tiny random models (run with the main venv).

    python tests/dify/kvgate_server.py --model-dir DIR --record FILE --ready FILE

starts five gateways in this one process (one torch import), each a real uvicorn server:
  main  scheduler_delay 30 s: a request is held that long unless its X-Max-Batch-Delay-Ms asks for less; its
        end-of-text row zeroed (never_ends), so an answer always runs to max_tokens;
        model "auto" is routed to the tiny model
  auth  the same without the delay, with --api-key AUTH_KEY
  busy  one seat (max_num_seqs 1), no queue (max_queue_len 0), every engine step slowed by 50 ms: while one
        request runs, every other gets 429
  embed a tiny random embedding model (Qwen3Model with sentence-transformers pooling files, so kvgate serves it
        with the pooling runner) as EMBED_MODEL, built in --model-dir's sibling "<dir>-embed". The same request
        must give the same vectors to the last bit, and on a CPU engine those bits depend on which prompts share
        a step and on whether a prefix came from the KV cache: so scheduler_delay 30 s as main (a request's
        X-Max-Batch-Delay-Ms window puts all its inputs into one step) and no prefix caching
  tools a tiny random model with a Qwen-style tools chat template (tests/tool_helpers.py's, plus Qwen3's
        enable_thinking switch), built in "<dir>-tools", served as TOOLS_MODEL the way a Qwen model is served for
        tool calling (--enable-auto-tool-choice --tool-call-parser hermes), and the same engine as THINK_MODEL with
        --reasoning-parser deepseek_r1 as well (which reads a random model's free output as all reasoning)
It writes {"main": url, "auth": url, "busy": url, "embed": url, "tools": url} to the --ready file once all are up,
and appends one JSON line per request that an engine accepted to the --record file (an embedding request: one line
per input), read from the engine's own Request and Scheduler: request_id, server, prompt (decoded), priority,
max_batch_delay (s), batch_window (s, the scheduler's hold), the request's sampling parameters and its guided
decoding (None, or {"kind": ..., "spec": the schema, regex, ...}).
It runs until it is terminated.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

TESTS_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS_DIR))  # tiny_models, tool_helpers

MODEL = "tiny"
EMBED_MODEL = "tiny-embed"
TOOLS_MODEL = "tiny-tools"
THINK_MODEL = "tiny-think"
# Qwen3's switch, at the end of its template: thinking off opens the answer with an empty think block
THINKING_SWITCH = ("{%- if add_generation_prompt and enable_thinking is defined and enable_thinking is false %}"
                   "{{- '<think>\n\n</think>\n\n' }}{%- endif %}\n")
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
                "sampling": {k: getattr(req.sampling_params, k, None) for k in SAMPLING_FIELDS},
                "guided": guided(req.sampling_params)}
        with lock, record.open("a") as f:
            f.write(json.dumps(line) + "\n")

    core.add_request = add_request


def guided(sampling_params: Any) -> dict[str, Any] | None:
    """The request's guided decoding as the engine got it: its kind and its spec (a JSON schema, ...)."""
    so = getattr(sampling_params, "structured_outputs", None)
    return None if so is None else {"kind": so.kind, "spec": getattr(so, so.kind)}


class WithArgs:
    """The same loaded engine under other per-model serving settings: the gateway reads a model's parsers
    (enable_auto_tool_choice, tool_call_parser, reasoning_parser) from its engine's args."""

    def __init__(self, engine: Any, **overrides: Any) -> None:
        self._engine = engine
        self.args = dataclasses.replace(engine.args, **overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def build_tools_model(model_dir: Path) -> None:
    """tests/tool_helpers.py's tool model, its template with Qwen3's thinking switch appended."""
    from tool_helpers import build_tool_model

    build_tool_model(model_dir)
    template = model_dir / "chat_template.jinja"
    template.write_text(template.read_text() + THINKING_SWITCH)


def never_ends(model_dir: Path) -> None:
    """Zero the tiny model's <|im_end|> row (its embedding is its LM head row too): the end-of-text logit is then
    0 while the largest of ~500 random logits is positive, so a greedy answer runs to max_tokens whatever the
    prompt. The tests send prompts with random markers and count the tokens they asked for."""
    from safetensors.torch import load_file, save_file
    from tiny_models import EOS_ID

    path = model_dir / "model.safetensors"
    weights = load_file(path)
    weights["model.embed_tokens.weight"][EOS_ID] = 0.0
    save_file(weights, path, metadata={"format": "pt"})


def slow_steps(async_engine: Any, seconds: float) -> None:
    core = async_engine.engine
    original = core.step

    def step(*args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return original(*args, **kwargs)

    core.step = step


def start_gateway(engines: dict[str, Any], auto_route: bool, app_kwargs: dict[str, Any]) -> str:
    """A uvicorn server on a free loopback port serving each engine of `engines` under its name; returns its URL
    once it listens."""
    import uvicorn

    from kvgate.gateway.app import create_app
    from kvgate.gateway.serving import OpenAIServing

    app = create_app({name: OpenAIServing(name, engine) for name, engine in engines.items()}, **app_kwargs)
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
    tools_dir = model_dir.with_name(model_dir.name + "-tools")
    if not (model_dir / "config.json").exists():
        build_tiny_model(model_dir, "qwen3")
        never_ends(model_dir)
    if not (embed_dir / "config.json").exists():
        build_tiny_embedding_model(embed_dir, "qwen3", seed=3)
    if not (tools_dir / "config.json").exists():
        build_tools_model(tools_dir)
    common = dict(model=str(model_dir), num_gpu_blocks_override=128)
    specs = {
        "main": (dict(max_num_seqs=16, scheduler_delay=SCHEDULER_DELAY_S), {}),
        "auth": (dict(max_num_seqs=16), {"api_key": AUTH_KEY}),
        "busy": (dict(max_num_seqs=1), {"max_queue_len": 0}),
        "embed": (dict(max_num_seqs=16, scheduler_delay=SCHEDULER_DELAY_S, enable_prefix_caching=False,
                       model=str(embed_dir)), {}),
        "tools": (dict(max_num_seqs=16, model=str(tools_dir), num_gpu_blocks_override=256,
                       enable_auto_tool_choice=True, tool_call_parser="hermes"), {}),
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
        if name == "embed":
            served = {EMBED_MODEL: engine}
        elif name == "tools":
            served = {TOOLS_MODEL: engine, THINK_MODEL: WithArgs(engine, reasoning_parser="deepseek_r1")}
        else:
            served = {MODEL: engine}
        urls[name] = start_gateway(served, name == "main", app_kwargs)
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
