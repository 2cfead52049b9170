"""The `kvgate` command: serve (OpenAI-compatible HTTP), generate (offline), worker (a tensor-parallel rank on another
host), convert (GGUF -> HF directory), dify-package (the Dify plugin), monitor (a live view of servers' /metrics)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable

from kvgate.engine.arg_utils import ArgSpec, EngineArgs, arg_specs

ENGINE_FLAGS = arg_specs(EngineArgs)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def add_flags(p: argparse.ArgumentParser | Any, specs: dict[str, tuple[ArgSpec, type, bool, Any]],
              skip: tuple[str, ...] = ()) -> None:
    """One flag per declared argument, with vLLM's spelling (--max-num-seqs, --[no-]enable-prefix-caching), its
    choices and its default in --help. A flag the user does not give stays out of the namespace, so that it
    overrides nothing (a config file's value, or the argument's own default)."""
    for name, (spec, typ, _, default) in specs.items():
        if name in skip:
            continue
        text = spec.help if default is None or "default:" in spec.help else f"{spec.help} (default: {default})"
        kw: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": text.replace("%", "%%")}
        if typ is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = _json_object if typ is dict else typ
            if spec.choices is not None and not callable(spec.choices):
                kw["choices"] = spec.choices
            if spec.metavar:
                kw["metavar"] = spec.metavar
        p.add_argument("--" + name.replace("_", "-"), **kw)


def engine_args(args: argparse.Namespace) -> EngineArgs:
    return EngineArgs(**{k: v for k, v in vars(args).items() if k in ENGINE_FLAGS})


def cmd_generate(args: argparse.Namespace) -> int:
    from kvgate.engine import LLM, SamplingParams

    t0 = time.perf_counter()
    a = engine_args(args)
    a.check()
    llm = LLM(**vars(a))
    print(f"[kvgate] loaded {llm.engine.config.served_model_name} on {llm.engine.config.device} "
          f"in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    sp = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                        seed=args.sample_seed)
    prompts = args.prompt or ["What is the capital of France?"]
    tok = llm.get_tokenizer()
    use_chat = not args.raw and getattr(tok, "chat_template", None)
    t0 = time.perf_counter()
    if use_chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], sp)
    else:
        outs = llm.generate(prompts, sp)
    secs = time.perf_counter() - t0
    for prompt, out in zip(prompts, outs):
        print(f"> {prompt}\n{out.outputs[0].text}\n")
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"[kvgate] {n} tokens in {secs:.2f}s ({n / secs:.1f} tok/s)", file=sys.stderr)
    return 0


def serve_overrides(args: argparse.Namespace) -> dict[str, object]:
    """The serve options the user gave on the command line (by config key), which override the config file."""
    given = {k: v for k, v in vars(args).items() if k not in ("command", "func", "config", "model_tag")}
    tag = getattr(args, "model_tag", None)
    if tag is not None:  # vLLM's `serve MODEL`
        if given.get("model", tag) != tag:
            raise ValueError(f"the model is given twice, as {tag!r} and as --model {given['model']!r}: give one")
        given["model"] = tag
    if "api_key" not in given and os.environ.get("KVGATE_API_KEY"):
        given["api_key"] = os.environ["KVGATE_API_KEY"]
    return given


def cmd_serve(args: argparse.Namespace) -> int:
    from kvgate.gateway.config import check_engines, load_config

    overrides = serve_overrides(args)
    cfg = load_config(args.config, overrides)  # ConfigError: exit status 2 with the key and reason
    check_engines(cfg)  # every value the engines would refuse, against each model's config: before anything loads

    import logging

    from kvgate.engine.async_engine import AsyncEngineArgs, AsyncLLMEngine
    from kvgate.engine.engine_core import freeze_gc_heap
    from kvgate.engine.models.gguf import DEFAULT_MODEL_NAME
    from kvgate.engine.pipe_reader import SWITCH_INTERVAL_S
    from kvgate.gateway.api_servers import JOIN_MARGIN_S, ApiServers, bind_socket, make_server
    from kvgate.gateway.server import DRAIN_MARGIN_S, GatewayServer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def report(name: str) -> "Callable[[AsyncLLMEngine], None]":
        def on_loaded(engine: AsyncLLMEngine) -> None:
            if engine.load_error is not None:
                print(f"[kvgate] {name}: failed to load after {engine.load_time:.1f}s: {engine.load_error}",
                      file=sys.stderr, flush=True)
            else:
                # the server's heap stays for its lifetime: keep full GC collections (event-loop pauses) short
                freeze_gc_heap()
                if engine.in_process:  # the core's outputs reader thread gets the GIL within 1 ms of the event loop
                    sys.setswitchinterval(SWITCH_INTERVAL_S)
                c = engine.config
                where = f"its own process (pid {engine.core_pid})" if engine.in_process else "a thread"
                print(f"[kvgate] {name}: ready in {engine.load_time:.1f}s on {c.device}, engine core on {where} "
                      f"({engine.stats.num_blocks} KV blocks of {c.args.block_size} tokens)",
                      file=sys.stderr, flush=True)
        return on_loaded

    deaths: list[str] = []  # engines dead for good (their core died, not restarted): the server exits with 1
    servers: list[GatewayServer] = []
    engines: list[tuple[str, AsyncLLMEngine]] = []  # the embedded ones, in the router's order

    def on_dead(name: str) -> "Callable[[AsyncLLMEngine], None]":
        def dead(engine: AsyncLLMEngine) -> None:  # on the engine's thread
            deaths.append(f"{name}: {engine.death}")
            if servers:
                servers[0].request_exit(1, deaths[-1])
        return dead

    def start_engine(name: str, engine_args: AsyncEngineArgs) -> AsyncLLMEngine:
        print(f"[kvgate] {name}: loading {engine_args.model or DEFAULT_MODEL_NAME} ...", file=sys.stderr, flush=True)
        engine = AsyncLLMEngine.from_engine_args(engine_args, on_loaded=report(name),  # loads on its own thread
                                                 on_dead=on_dead(name), clients=cfg.api_server_count)
        if cfg.api_server_count > 1:  # its core stops once the other API processes have drained too
            engine.core_stop_timeout = cfg.shutdown_timeout + DRAIN_MARGIN_S + JOIN_MARGIN_S
        engines.append((name, engine))
        return engine

    sockets, others = None, None
    if cfg.api_server_count > 1:  # bound first: a port in use stops kvgate before anything loads
        try:
            sockets = [bind_socket(cfg.host, cfg.port, first=True)]
        except OSError as e:
            print(f"[kvgate] {e.strerror}", file=sys.stderr, flush=True)
            return 1
    server = make_server(cfg, start_engine)
    router = server.router
    servers.append(server)
    if deaths:  # one died before the server existed
        server.request_exit(1, deaths[0])
    if sockets is not None:
        others = ApiServers(cfg.api_server_count, args.config, overrides, server)
        others.start_when_ready(engines)
    names = [*router.models, *router.routes]
    print(f"[kvgate] serving {', '.join(names)} on http://{cfg.host}:{cfg.port}/v1 "
          f"(/health answers 503 loading until every model is ready)", file=sys.stderr, flush=True)
    server.run(sockets)  # until SIGTERM / SIGINT (or an engine's death) and the drain; its shutdown stops the engines
    if others is not None:
        others.join()
    print(f"[kvgate] stopped (exit status {server.exit_code})", file=sys.stderr, flush=True)
    return server.exit_code


def cmd_worker(args: argparse.Namespace) -> int:
    """One rank (tensor-parallel slice, pipeline stage) of an engine whose rank 0 runs `kvgate serve --distributed-executor-backend
    external_launcher` on the head node; the rendezvous is torch.distributed's environment (env://)."""
    from kvgate.engine.worker import run_worker

    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ValueError(f"kvgate worker joins through torch.distributed's environment, and {', '.join(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} not set (a launcher such as torchrun sets them)")
    if getattr(args, "model_tag", None) is not None:
        args.model = args.model_tag
    a = engine_args(args)
    a.distributed_executor_backend = "external_launcher"
    a.check()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != a.tensor_parallel_size * a.pipeline_parallel_size:
        raise ValueError(f"WORLD_SIZE is {world}, and --tensor-parallel-size x --pipeline-parallel-size is "
                         f"{a.tensor_parallel_size * a.pipeline_parallel_size}: they must be equal")
    if rank == 0:
        raise ValueError("rank 0 runs the engine: start `kvgate serve` there, `kvgate worker` on ranks 1 and up")
    print(f"[kvgate] worker rank {rank}/{world} joining {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
          file=sys.stderr, flush=True)
    run_worker(a, rank, int(os.environ.get("LOCAL_RANK", 0)))
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from kvgate.engine.models.gguf import convert_gguf_to_hf

    out = convert_gguf_to_hf(args.input, args.output, progress=True)
    print(f"[kvgate] wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from kvgate.gateway import __version__
    from kvgate.gateway.config import SERVE_SPECS

    parser = argparse.ArgumentParser(prog="kvgate", description="kvgate: an OpenAI-compatible LLM gateway with its "
                                     "own paged-KV inference engines")
    parser.add_argument("--version", action="version", version=f"kvgate {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sv = sub.add_parser("serve", help="serve models over the OpenAI API (chat, completions, embeddings)",
                        description="Flags override the config file (only the flags given); engine flags apply to "
                                    "every embedded model.", argument_default=argparse.SUPPRESS)
    sv.add_argument("model_tag", nargs="?", metavar="MODEL", help="the model to serve, as --model")
    sv.add_argument("--config", default=None, help="config.yaml: models, engine args, server options")
    add_flags(sv.add_argument_group("server options"), SERVE_SPECS)
    add_flags(sv.add_argument_group("engine arguments (vLLM's names)"), ENGINE_FLAGS)
    sv.set_defaults(func=cmd_serve)
    g = sub.add_parser("generate", help="generate text offline from a local model")
    g.add_argument("--prompt", action="append", help="a prompt (repeatable); chat template applied unless --raw")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--sample-seed", type=int, default=None)
    add_flags(g.add_argument_group("engine arguments (vLLM's names)"), ENGINE_FLAGS,
              skip=("engine_core_process", "on_engine_core_death", "max_engine_core_restarts", "served_model_name",
                    "scheduler_delay", "max_tokens_default"))
    g.set_defaults(func=cmd_generate)
    w = sub.add_parser("worker", help="run one rank of a tensor/pipeline-parallel engine served from another host",
                       description="Started by a launcher (torchrun, Slurm, a Kubernetes LeaderWorkerSet) with RANK, "
                                   "LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, and the same engine "
                                   "flags as `kvgate serve --distributed-executor-backend external_launcher` on "
                                   "rank 0.", argument_default=argparse.SUPPRESS)
    w.add_argument("model_tag", nargs="?", metavar="MODEL", help="the model, as --model")
    add_flags(w.add_argument_group("engine arguments (vLLM's names)"), ENGINE_FLAGS,
              skip=("engine_core_process", "on_engine_core_death", "max_engine_core_restarts", "served_model_name",
                    "scheduler_delay", "max_tokens_default", "enable_auto_tool_choice", "tool_call_parser",
                    "reasoning_parser", "distributed_executor_backend"))
    w.set_defaults(func=cmd_worker)
    c = sub.add_parser("convert", help="convert a GGUF file into a Hugging Face directory (safetensors + tokenizer)")
    c.add_argument("--input", required=True, help="model.gguf")
    c.add_argument("--output", required=True, help="output directory")
    c.set_defaults(func=cmd_convert)
    from kvgate.gateway import dify_package, monitor  # cheap to import (their dependencies load when they run)

    dify_package.register(sub)
    monitor.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, NotImplementedError) as e:
        print(f"kvgate: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
