"""The FastAPI app: OpenAI endpoints, health, models, tokenize, metrics; priorities from X-Priority."""
from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from kvgate.gateway.errors import APIError, error_response, install_error_handlers
from kvgate.gateway.metrics import render_metrics
from kvgate.gateway.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from kvgate.gateway.serving import OpenAIServing

VERSION = "0.1.0"
PRIORITY_HEADER = "x-priority"
BATCH_DELAY_HEADER = "x-max-batch-delay-ms"


def request_priority(request: Request, body_priority: int | None) -> int:
    raw = request.headers.get(PRIORITY_HEADER)
    value: object = body_priority if raw is None else raw
    if value is None:
        return 50
    try:
        prio = int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise APIError(400, f"priority must be an integer in [0, 100], got {value!r}", "priority") from None
    if not 0 <= prio <= 100:
        raise APIError(400, f"priority must be in [0, 100] (higher is more urgent), got {prio}", "priority")
    return prio


def request_batch_delay(request: Request) -> float | None:
    raw = request.headers.get(BATCH_DELAY_HEADER)
    if raw is None:
        return None
    try:
        ms = float(raw)
    except ValueError:
        raise APIError(400, f"{BATCH_DELAY_HEADER} must be a number of milliseconds, got {raw!r}") from None
    if not 0 <= ms <= 60_000:
        raise APIError(400, f"{BATCH_DELAY_HEADER} must be in [0, 60000] ms, got {raw}")
    return ms / 1000.0


def create_app(servings: dict[str, OpenAIServing], api_key: str | None = None, max_body_bytes: int = 8 << 20,
               max_queue_len: int = 1024) -> FastAPI:
    """`api_key`: Bearer key required on /v1/*, /tokenize and /detokenize; `max_body_bytes`: larger bodies get 413;
    `max_queue_len`: requests per model beyond the running batch before new ones get 429."""
    app = FastAPI(title="kvgate", version=VERSION)
    app.state.servings = servings
    install_error_handlers(app)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        path = request.url.path
        if api_key is not None and (path.startswith("/v1/") or path in ("/tokenize", "/detokenize")):
            auth = request.headers.get("authorization", "")
            if auth != f"Bearer {api_key}":
                return error_response(APIError(401, "invalid or missing API key (send Authorization: Bearer KEY)",
                                               None, "invalid_api_key"))
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > max_body_bytes:
            return error_response(APIError(413, f"request body of {size} bytes is over the limit of "
                                                f"{max_body_bytes} bytes"))
        return await call_next(request)

    def serving_for(model: str | None) -> OpenAIServing:
        if model is None and len(servings) == 1:
            model = next(iter(servings))
        if model not in servings:
            raise APIError(404, f"The model `{model}` does not exist. Available: {', '.join(servings)}", "model",
                           "model_not_found")
        s = servings[model]
        if s.engine.is_dead:
            raise APIError(503, f"the engine of `{model}` is not running", "model", headers={"Retry-After": "30"})
        if not s.engine.is_ready:
            raise APIError(503, f"`{model}` is still loading", "model", headers={"Retry-After": "5"})
        queued = s.engine.num_requests - s.engine.engine.config.max_num_seqs
        if queued >= max_queue_len:
            raise APIError(429, f"`{model}` has {queued} requests waiting (limit {max_queue_len}); retry later",
                           None, "queue_full", headers={"Retry-After": "1"})
        return s

    def respond(result: dict | object) -> JSONResponse | StreamingResponse:
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request):
        if (field := req.unsupported()) is not None:
            raise APIError(400, f"{field!r} is not supported by kvgate yet", field)
        s = serving_for(req.model)
        return respond(await s.chat(req, request_priority(request, req.priority), request_batch_delay(request)))

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        if (field := req.unsupported()) is not None:
            raise APIError(400, f"{field!r} is not supported by kvgate yet", field)
        s = serving_for(req.model)
        return respond(await s.completions(req, request_priority(request, req.priority),
                                           request_batch_delay(request)))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": s.created, "owned_by": "kvgate",
             "max_model_len": s.max_model_len if s.engine.is_ready else None} for name, s in servings.items()]}

    @app.get("/health")
    async def health():
        if any(s.engine.is_dead for s in servings.values()):
            return JSONResponse({"status": "dead"}, status_code=503)
        if not all(s.engine.is_ready for s in servings.values()):
            return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "5"})
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        s = serving_for(req.model)
        if req.messages is not None:
            ids = s.chat_prompt(ChatCompletionRequest(model=s.name, messages=req.messages,
                                                      add_generation_prompt=req.add_generation_prompt))
        elif req.prompt is not None:
            ids = s.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            raise APIError(400, "give either prompt or messages", "prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": s.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        s = serving_for(req.model)
        vocab = s.engine.engine.config.model_config.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", "tokens")
        return {"prompt": s.tokenizer.decode(req.tokens)}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(render_metrics(servings, time.time()), media_type="text/plain; version=0.0.4")

    return app
