"""The app: OpenAI endpoints through the ModelRouter, health, models, tokenize, metrics; priorities from
X-Priority. Chat, completion and embedding bodies are parsed once here (gateway/json_body.py: orjson, depth-limited,
no invalid Unicode); the embedded backend validates them with the pydantic models, and a remote one gets the
client's bytes unchanged. Every JSON body, the hot path's and FastAPI's, goes through the same parser and the same
size limit."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from typing import Any, Awaitable, Mapping

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from kvgate.gateway import __version__ as VERSION
from kvgate.gateway.access_log import AccessRecord, note_request
from kvgate.gateway.auth import APIKey, KeyRing, RateLimited, bearer
from kvgate.gateway.backends import EmbeddedBackend
from kvgate.gateway.errors import APIError, error_response, install_error_handlers
from kvgate.gateway.json_body import JSONBodyRoute, json_type, parse_json_body
from kvgate.gateway.metrics import render_metrics
from kvgate.gateway.prompt_tokenizer import text_bound
from kvgate.gateway.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest,
                                     TokenizeRequest, as_int)
from kvgate.gateway.router import ModelRouter, RoutedRequest
from kvgate.gateway.serving import OpenAIServing

logger = logging.getLogger(__name__)
GENERATE_PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/embeddings": "embeddings"}
PRIORITY_HEADER = "x-priority"
BATCH_DELAY_HEADER = "x-max-batch-delay-ms"


def request_priority(headers: Mapping[str, str], body_priority: Any) -> int:
    """The request's priority: the X-Priority header (a decimal integer), else the body's `priority` (a JSON
    integer), else 50; a 400 naming the value for anything else or outside [0, 100]."""
    raw = headers.get(PRIORITY_HEADER)
    if raw is None and body_priority is None:
        return 50
    if raw is None:
        body_priority = as_int(body_priority)
        if type(body_priority) is not int:
            raise APIError(400, f"priority must be an integer in [0, 100], got {json_type(body_priority)}",
                           "priority")
        prio = body_priority
    else:
        text = raw.strip()
        if not re.fullmatch(r"[+-]?[0-9]{1,20}", text):
            raise APIError(400, f"{PRIORITY_HEADER} must be an integer in [0, 100], got {raw[:40]!r}", "priority")
        prio = int(text)
    if not 0 <= prio <= 100:
        raise APIError(400, f"priority must be in [0, 100] (higher is more urgent), got {prio}", "priority")
    return prio


def request_batch_delay(headers: Mapping[str, str]) -> float | None:
    raw = headers.get(BATCH_DELAY_HEADER)
    if raw is None:
        return None
    try:
        ms = float(raw)
    except ValueError:
        raise APIError(400, f"{BATCH_DELAY_HEADER} must be a number of milliseconds, got {raw!r}") from None
    if not 0 <= ms <= 60_000:
        raise APIError(400, f"{BATCH_DELAY_HEADER} must be in [0, 60000] ms, got {raw}")
    return ms / 1000.0


class GatewayApp(FastAPI):
    """FastAPI, with the API-key and body-size checks, and the two generate endpoints, in front of it as plain
    ASGI: the hot path (POST /v1/chat/completions, /v1/completions) skips FastAPI's routing and middleware
    layers, which cost about as much as the rest of a relayed request. Everything else is ordinary FastAPI."""

    def configure(self, router: ModelRouter, keys: KeyRing, max_body_bytes: int, log_requests: bool) -> None:
        """`keys`: the API keys (none: no key needed) and their limits; `max_body_bytes` bounds every request
        body, declared (Content-Length) or sent (chunked); `log_requests`: an access-log line per request."""
        self.model_router, self.keys, self.max_body_bytes = router, keys, max_body_bytes
        self.log_requests = log_requests

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await super().__call__(scope, receive, send)
        record = AccessRecord.begin(scope) if self.log_requests else None
        if record is not None:
            send = record.capture(send)
        try:
            await self.handle(scope, receive, send, record)
        finally:
            if record is not None:
                record.write()

    async def handle(self, scope: dict, receive: Any, send: Any, record: AccessRecord | None) -> None:
        """Key, size and rate checks, then the generate endpoints here and everything else through FastAPI."""
        path: str = scope["path"]
        headers = dict(scope["headers"])
        error, key = None, None
        if self.keys and (path.startswith("/v1/") or path in ("/tokenize", "/detokenize")):
            key = self.keys.find(bearer(headers.get(b"authorization")))
            if key is None:
                error = APIError(401, "invalid or missing API key (send Authorization: Bearer KEY)", None,
                                 "invalid_api_key")
            elif record is not None:
                record.key = key.key.name
        size = headers.get(b"content-length", b"")
        if error is None and size.isdigit() and int(size) > self.max_body_bytes:
            error = APIError(413, f"request body of {size.decode()} bytes is over the limit of "
                                  f"{self.max_body_bytes} bytes")
        kind = GENERATE_PATHS.get(path) if scope["method"] == "POST" else None
        if error is None and kind is None:
            return await super().__call__(scope, self.limited(receive), send)
        if error is None and key is not None:
            try:
                self.keys.admit(key)
            except RateLimited as e:
                error = APIError(429, f"{e}; retry after {e.retry_after} s", None, "rate_limit_exceeded",
                                 headers={"Retry-After": str(e.retry_after)})
        if error is not None:
            return await error_response(error)(scope, receive, send)
        routed: list[RoutedRequest] = []
        try:
            try:
                response = await self.generate(kind, headers, receive, routed)
            except APIError as e:
                response = error_response(e)
            except ClientGone:
                return
            except Exception:  # the stack trace goes to the log, never to the client
                logger.exception("internal error")
                response = error_response(APIError(500, "internal server error"))
            await response(scope, receive, send)
        finally:
            note_request(record, routed[0] if routed else None)
            if key is not None:
                timing = routed[0].timing if routed else None
                self.keys.release(key, timing.prompt_tokens + timing.output_tokens if timing is not None else 0)

    def limited(self, receive: Any) -> Any:
        """`receive` that raises a 413 APIError once the body passes max_body_bytes (gateway/json_body.py's route
        answers it; a route that reads no body never sees it)."""
        size = 0

        async def receive_limited() -> dict:
            nonlocal size
            message = await receive()
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                raise APIError(413, f"request body is over the limit of {self.max_body_bytes} bytes")
            return message

        return receive_limited

    async def generate(self, kind: str, raw_headers: dict[bytes, bytes], receive: Any,
                       routed: list[RoutedRequest]) -> Response:
        parts, more, size = [], True, 0
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            more = message.get("more_body", False)
            if size > self.max_body_bytes:
                raise APIError(413, f"request body is over the limit of {self.max_body_bytes} bytes")
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in raw_headers.items()}
        return await self.serve(kind, b"".join(parts), headers, receive, routed)

    async def serve(self, kind: str, raw: bytes, headers: dict[str, str], receive: Any,
                    routed: list[RoutedRequest] | None = None) -> Response:
        """One generate request of `kind` from its body bytes: parsed, its priority read, then routed (the
        RoutedRequest is appended to `routed`, for the access log and the key's token count)."""
        body = parse_json_body(raw)
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise APIError(400, f"model must be a string (a model's id), got {json_type(model)}", "model")
        req = RoutedRequest(kind, body, raw, headers, request_priority(headers, body.get("priority")),
                            request_batch_delay(headers))
        if routed is not None:
            routed.append(req)
        if req.stream:
            return await self.model_router.dispatch(req)
        return await cancel_on_disconnect(receive, self.model_router.dispatch(req))


class ClientGone(Exception):
    pass


async def cancel_on_disconnect(receive: Any, work: Awaitable[Response]) -> Response:
    """Run `work`, cancelling it if the client goes away first (a non-streamed request has no stream to notice
    that): the embedded engine then aborts the request, and a remote upstream's connection is closed."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(gone())
    try:
        done, _ = await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    with contextlib.suppress(Exception, asyncio.CancelledError):
        await task  # let the cancelled work clean up (abort, close the upstream connection)
    return Response(status_code=499)  # nobody reads it


def create_app(servings: dict[str, OpenAIServing] | ModelRouter, api_key: str | None = None,
               max_body_bytes: int = 8 << 20, max_queue_len: int | None = None,
               api_keys: list[APIKey] | None = None, log_requests: bool = True) -> FastAPI:
    """`servings`: a ModelRouter, or {name: OpenAIServing} (one embedded deployment each). `api_key` and
    `api_keys` (with their limits): Bearer keys required on /v1/*, /tokenize and /detokenize (none: no key);
    `max_body_bytes`: larger bodies get 413; `max_queue_len`: requests per deployment beyond the running batch
    before new ones get 429; `log_requests`: the access log (gateway/access_log.py)."""
    if isinstance(servings, ModelRouter):
        router = servings
    else:
        router = ModelRouter()
        for name, s in servings.items():
            router.add_model(name, s)
    if max_queue_len is not None:
        router.max_queue_len = max_queue_len

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        router.start()
        warm = asyncio.get_running_loop().create_task(measure_text_bounds(router))
        yield
        warm.cancel()
        await router.close()

    app = GatewayApp(title="kvgate", version=VERSION, lifespan=lifespan)
    app.router.route_class = JSONBodyRoute  # every FastAPI route parses its JSON body as the hot path does
    keys = list(api_keys or []) + ([APIKey("default", api_key)] if api_key is not None else [])
    app.configure(router, KeyRing(keys), max_body_bytes, log_requests)
    app.state.router = router
    install_error_handlers(app, tuple(GENERATE_PATHS))

    def embedded_for(model: str | None) -> OpenAIServing:
        """The first embedded deployment of `model` (for /tokenize and /detokenize)."""
        if model is None and len(router.models) == 1:
            model = next(iter(router.models))
        if model not in router.models:
            raise APIError(404, f"The model `{model}` does not exist. Available: {', '.join(router.models)}", "model",
                           "model_not_found")
        for d in router.models[model]:
            if isinstance(d.backend, EmbeddedBackend):
                if d.backend.dead:
                    raise APIError(503, f"the engine of `{model}` is not running", "model",
                                   headers={"Retry-After": "30"})
                if not d.backend.ready:
                    raise APIError(503, f"`{model}` is still loading", "model", headers={"Retry-After": "5"})
                return d.backend.serving
        raise APIError(400, f"`{model}` is served by remote upstreams only; ask them to tokenize", "model")

    def model_card(name: str) -> dict[str, Any]:
        """OpenAI's model object, with vLLM's max_model_len and kvgate's deployments / route fields."""
        if name in router.routes:
            route = router.routes[name]
            return {"id": name, "object": "model", "created": min(router.created.values(), default=0),
                    "owned_by": "kvgate", "route": True, "strategy": route.strategy or router.strategy}
        deps = router.models[name]
        max_len = next((d.backend.serving.max_model_len for d in deps
                        if isinstance(d.backend, EmbeddedBackend) and d.backend.ready), None)
        return {"id": name, "object": "model", "created": router.created[name], "owned_by": "kvgate",
                "max_model_len": max_len, "deployments": len(deps)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(name) for name in [*router.models, *router.routes]]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id not in router.models and model_id not in router.routes:
            raise APIError(404, f"The model `{model_id}` does not exist. Available: "
                                f"{', '.join([*router.models, *router.routes])}", "model", "model_not_found")
        return model_card(model_id)

    @app.get("/health")
    async def health():
        status = "ok"
        for deps in router.models.values():
            if any(d.backend.ready and not d.backend.dead and d.health.available() for d in deps):
                continue
            if any(not d.backend.ready and not d.backend.dead for d in deps):
                status = "loading" if status == "ok" else status
            else:
                status = "dead" if all(d.backend.dead for d in deps) else "unavailable"
        if status == "ok" and router.starting is not None and router.starting():
            status = "loading"
        if status == "ok":
            return {"status": "ok"}
        return JSONResponse({"status": status}, status_code=503,
                            headers={"Retry-After": "5"} if status == "loading" else None)

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    # The generate endpoints are served by GatewayApp.__call__ before FastAPI routes anything; these routes put
    # their request models (the ones the embedded backend validates with) into /openapi.json, and serve a request
    # the same way should one ever reach them.
    def generate_route(kind: str, model: type) -> None:
        async def endpoint(request: Request, body: model) -> Response:  # type: ignore[valid-type]
            headers = {k.lower(): v for k, v in request.headers.items()}
            return await app.serve(kind, await request.body(), headers, request.receive)

        endpoint.__annotations__ = {"request": Request, "body": model, "return": Response}  # real types, not strings
        path = next(p for p, k in GENERATE_PATHS.items() if k == kind)
        app.add_api_route(path, endpoint, methods=["POST"], name=kind, response_model=None,
                          summary={"chat": "Create a chat completion", "completions": "Create a completion",
                                   "embeddings": "Create embeddings"}[kind],
                          description="OpenAI's API (see README.md for kvgate's extra fields and limits).")

    generate_route("chat", ChatCompletionRequest)
    generate_route("completions", CompletionRequest)
    generate_route("embeddings", EmbeddingRequest)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        s = embedded_for(req.model)
        if s.tokenizer is None:
            raise APIError(400, f"`{s.name}` is served without a tokenizer (skip_tokenizer_init)", "model")
        if req.messages is not None:
            ids = await s.chat_prompt(ChatCompletionRequest(model=s.name, messages=req.messages,
                                                            add_generation_prompt=req.add_generation_prompt))
        elif req.prompt is not None:
            ids = await s.prompt_tokenizer.encode(req.prompt, "prompt", add_special_tokens=req.add_special_tokens)
        else:
            raise APIError(400, "give either prompt or messages", "prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": s.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        s = embedded_for(req.model)
        if s.tokenizer is None:
            raise APIError(400, f"`{s.name}` is served without a tokenizer (skip_tokenizer_init)", "model")
        vocab = s.engine.config.model_config.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", "tokens")
        return {"prompt": s.tokenizer.decode(req.tokens)}

    @app.get("/metrics")
    async def metrics():
        text = render_metrics(router.embedded(), time.time()) + router_metrics(router) + app.keys.metrics()
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return app


async def measure_text_bounds(router: ModelRouter) -> None:
    """Measure each embedded model's byte bound (gateway/prompt_tokenizer.py: one pass over its vocabulary, ~0.1 s
    for 50k tokens) on a worker thread as soon as it is loaded, so that no request pays for it on the event loop."""
    for d in router.deployments():
        if isinstance(d.backend, EmbeddedBackend):
            engine = d.backend.engine
            while not engine.is_ready and not engine.is_dead:  # polled: no thread blocks on a load
                await asyncio.sleep(0.2)
            if engine.is_ready and engine.tokenizer is not None:
                with contextlib.suppress(Exception):  # measured again on first use, and refused there if broken
                    await asyncio.to_thread(text_bound, engine.tokenizer)


def router_metrics(router: ModelRouter) -> str:
    """kvgate's router figures per deployment (label model_name, deployment)."""
    lines = ["# HELP kvgate:router_requests_total Requests the router sent to a deployment.",
             "# TYPE kvgate:router_requests_total counter"]
    deps = router.deployments()
    lab = [f'model_name="{d.model}",deployment="{d.name}"' for d in deps]
    lines += [f"kvgate:router_requests_total{{{lb}}} {d.stats.requests}" for lb, d in zip(lab, deps)]
    lines += ["# HELP kvgate:router_failures_total Requests a deployment failed.",
              "# TYPE kvgate:router_failures_total counter"]
    lines += [f"kvgate:router_failures_total{{{lb}}} {d.stats.failures}" for lb, d in zip(lab, deps)]
    lines += ["# HELP kvgate:router_requests_in_flight Requests sent to a deployment and not finished.",
              "# TYPE kvgate:router_requests_in_flight gauge"]
    lines += [f"kvgate:router_requests_in_flight{{{lb}}} {len(d.stats.in_flight)}" for lb, d in zip(lab, deps)]
    lines += ["# HELP kvgate:router_deployment_healthy 1 while a deployment takes traffic, 0 in cooldown.",
              "# TYPE kvgate:router_deployment_healthy gauge"]
    lines += [f"kvgate:router_deployment_healthy{{{lb}}} {int(d.health.available())}" for lb, d in zip(lab, deps)]
    lines += ["# HELP kvgate:router_retries_total Requests sent again after a deployment failed.",
              "# TYPE kvgate:router_retries_total counter", f"kvgate:router_retries_total {router.retries}"]
    return "\n".join(lines) + "\n"
