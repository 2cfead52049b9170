"""The `kvgate` command: serve (OpenAI-compatible HTTP), generate (offline), convert (GGUF -> HF directory),
dify-package (the Dify plugin)."""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable


def _engine_flags(p: argparse.ArgumentParser, given_only: bool = False) -> None:
    """given_only: flags the user did not give stay out of the namespace (serve: they must not override the file)."""
    def default(value: object) -> object:
        return argparse.SUPPRESS if given_only else value

    p.add_argument("--model", default=default(None), help="local HF dir or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default=default("auto"), help="auto | float32 | bfloat16 | float16 (default: auto)")
    p.add_argument("--load-format", default=default("auto"), help="auto | safetensors | gguf | dummy (default: auto)")
    p.add_argument("--max-model-len", type=int, default=default(None), help="default: the model's")
    p.add_argument("--block-size", type=int, default=default(16), help="16 | 32 | 64 (default: 16)")
    p.add_argument("--max-num-seqs", type=int, default=default(256), help="sequences per step (default: 256)")
    p.add_argument("--attention-backend", default=default(None), help="default: triton on CUDA, torch on CPU")
    p.add_argument("--seed", type=int, default=default(0))


def cmd_generate(args: argparse.Namespace) -> int:
    from kvgate.engine import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, load_format=args.load_format, max_model_len=args.max_model_len,
              block_size=args.block_size, max_num_seqs=args.max_num_seqs, attention_backend=args.attention_backend,
              seed=args.seed)
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
    given = {k: v for k, v in vars(args).items() if k not in ("command", "func", "config")}
    if "api_key" not in given and os.environ.get("KVGATE_API_KEY"):
        given["api_key"] = os.environ["KVGATE_API_KEY"]
    return given


def cmd_serve(args: argparse.Namespace) -> int:
    from kvgate.gateway.config import load_config

    cfg = load_config(args.config, serve_overrides(args))  # ConfigError: exit status 2 with the key and reason

    import logging

    import uvicorn

    from kvgate.engine.async_engine import AsyncEngineArgs, AsyncLLMEngine
    from kvgate.engine.engine_core import freeze_gc_heap
    from kvgate.engine.models.gguf import DEFAULT_MODEL_NAME
    from kvgate.gateway.app import create_app
    from kvgate.gateway.router_config import build_router

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def report(name: str) -> "Callable[[AsyncLLMEngine], None]":
        def on_loaded(engine: AsyncLLMEngine) -> None:
            if engine.load_error is not None:
                print(f"[kvgate] {name}: failed to load after {engine.load_time:.1f}s: {engine.load_error}",
                      file=sys.stderr, flush=True)
            else:
                # the server's heap stays for its lifetime: keep full GC collections (event-loop pauses) short
                freeze_gc_heap()
                c, where = engine.config, "its own process" if engine.in_process else "a thread"
                print(f"[kvgate] {name}: ready in {engine.load_time:.1f}s on {c.device}, engine core on {where} "
                      f"({engine.stats.num_blocks} KV blocks of {c.args.block_size} tokens)",
                      file=sys.stderr, flush=True)
        return on_loaded

    def start_engine(name: str, engine_args: AsyncEngineArgs) -> AsyncLLMEngine:
        print(f"[kvgate] {name}: loading {engine_args.model or DEFAULT_MODEL_NAME} ...", file=sys.stderr, flush=True)
        return AsyncLLMEngine.from_engine_args(engine_args, on_loaded=report(name))  # loads on its own thread

    router = build_router(cfg, engine_factory=start_engine)  # remote deployments, routes, fallbacks included
    app = create_app(router, api_key=cfg.api_key, max_body_bytes=cfg.max_body_bytes, max_queue_len=cfg.max_queue_len)
    names = [*router.models, *router.routes]
    print(f"[kvgate] serving {', '.join(names)} on http://{cfg.host}:{cfg.port}/v1 "
          f"(/health answers 503 loading until every model is ready)", file=sys.stderr, flush=True)
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning")  # its shutdown stops the engines
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from kvgate.engine.models.gguf import convert_gguf_to_hf

    out = convert_gguf_to_hf(args.input, args.output, progress=True)
    print(f"[kvgate] wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate", description="kvgate: an OpenAI-compatible LLM gateway with its "
                                     "own paged-KV inference engines")
    sub = parser.add_subparsers(dest="command", required=True)
    sv = sub.add_parser("serve", help="serve models over the OpenAI API (chat, completions, streaming)",
                        description="Flags override the config file (only the flags given); engine flags apply to "
                                    "every embedded model.", argument_default=argparse.SUPPRESS)
    sv.add_argument("--config", default=None, help="config.yaml: models, engine args, server options")
    _engine_flags(sv, given_only=True)
    sv.add_argument("--host", help="default: 127.0.0.1")
    sv.add_argument("--port", type=int, help="default: 8000")
    sv.add_argument("--served-model-name", help="the model id clients send (default: from the model path)")
    sv.add_argument("--scheduler-delay", type=float, help="seconds a prefill may wait to be batched (default: 0)")
    sv.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    sv.add_argument("--engine-core-process", action=argparse.BooleanOptionalAction,
                    help="run each engine loop in its own process (default: on CUDA, not on CPU)")
    sv.add_argument("--api-key", help="require this Bearer key (default: $KVGATE_API_KEY, else none)")
    sv.add_argument("--max-body-bytes", type=int, help="larger request bodies get 413 (default: 8 MiB)")
    sv.add_argument("--max-queue-len", type=int, help="waiting requests per model before 429 (default: 1024)")
    sv.set_defaults(func=cmd_serve)
    g = sub.add_parser("generate", help="generate text offline from a local model")
    _engine_flags(g)
    g.add_argument("--prompt", action="append", help="a prompt (repeatable); chat template applied unless --raw")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--sample-seed", type=int, default=None)
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("convert", help="convert a GGUF file into a Hugging Face directory (safetensors + tokenizer)")
    c.add_argument("--input", required=True, help="model.gguf")
    c.add_argument("--output", required=True, help="output directory")
    c.set_defaults(func=cmd_convert)
    from kvgate.gateway import dify_package  # stdlib-only module: cheap to import

    dify_package.register(sub)
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
