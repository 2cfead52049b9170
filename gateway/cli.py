"""The `kvgate` command: serve (OpenAI-compatible HTTP), generate (offline), convert (GGUF -> HF directory)."""
from __future__ import annotations

import argparse
import os
import sys
import time


def _engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local HF dir or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--load-format", default="auto", help="auto | safetensors | gguf | dummy")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--seed", type=int, default=0)


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


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from kvgate.engine.async_engine import AsyncEngineArgs, AsyncLLMEngine
    from kvgate.engine.models.gguf import DEFAULT_MODEL_NAME
    from kvgate.gateway.app import create_app
    from kvgate.gateway.serving import OpenAIServing

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine_args = AsyncEngineArgs(
        model=args.model, dtype=args.dtype, load_format=args.load_format, max_model_len=args.max_model_len,
        block_size=args.block_size, max_num_seqs=args.max_num_seqs, attention_backend=args.attention_backend,
        seed=args.seed, scheduler_delay=args.scheduler_delay, enable_prefix_caching=not args.no_prefix_caching)
    name = args.served_model_name or (DEFAULT_MODEL_NAME if args.model is None else
                                      args.model.rstrip("/").split("/")[-1].removesuffix(".gguf"))
    engine = AsyncLLMEngine.from_engine_args(engine_args)  # loads on its own thread; /health says "loading"
    app = create_app({name: OpenAIServing(name, engine)}, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                     max_queue_len=args.max_queue_len)
    print(f"[kvgate] serving {name} on http://{args.host}:{args.port}/v1 (loading the model...)", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    engine.shutdown()
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
    sv = sub.add_parser("serve", help="serve a model over the OpenAI API (chat, completions, streaming)")
    _engine_flags(sv)
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--served-model-name", default=None)
    sv.add_argument("--scheduler-delay", type=float, default=0.0, help="seconds a prefill may wait to be batched")
    sv.add_argument("--no-prefix-caching", action="store_true")
    sv.add_argument("--api-key", default=os.environ.get("KVGATE_API_KEY"), help="require this Bearer key")
    sv.add_argument("--max-body-bytes", type=int, default=8 << 20)
    sv.add_argument("--max-queue-len", type=int, default=1024, help="waiting requests per model before 429")
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
