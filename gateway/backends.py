"""Where a deployment's requests go: an in-process engine (EmbeddedBackend) or a remote OpenAI-compatible server
(RemoteBackend: vLLM, another kvgate, ...; through gateway/upstream_client.py).

Both turn a RoutedRequest into a starlette Response, and raise BackendFailure when the deployment failed before
the first byte could reach the client, so that the router may retry on another one. The remote relay passes the
upstream's bytes through untouched (its id and system_fingerprint stay as they are) and streams chunk by chunk.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable
from urllib.parse import urlsplit

import anyio
from pydantic import ValidationError
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvgate.engine.async_engine import AsyncLLMEngine, EngineDeadError
from kvgate.engine.outputs import RequestOutput
from kvgate.gateway.errors import APIError, error_body, validation_error
from kvgate.gateway.protocol import ChatCompletionRequest, CompletionRequest
from kvgate.gateway.serving import OpenAIServing
from kvgate.gateway.serving_embedding import OpenAIServingEmbedding, check_endpoint
from kvgate.gateway.strategies import LoadState, RequestTiming
from kvgate.gateway.upstream_client import UpstreamError, UpstreamPool

if TYPE_CHECKING:
    from kvgate.gateway.router import RoutedRequest

logger = logging.getLogger(__name__)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
FORWARDED_HEADERS = ("x-priority", "x-max-batch-delay-ms", "x-request-id")
UPSTREAM_PATHS = {"chat": "/chat/completions", "completions": "/completions", "embeddings": "/embeddings"}  # by kind


class ProxyStream(StreamingResponse):
    """A streamed response that always cleans up: when it ends, fails or the client goes, its iterator is closed
    and the `on_close` callbacks run (close the upstream stream, account the request), even if it never started.
    `completed` says that every byte was sent; `error` holds what broke the stream, if something did, and
    `penalize` whether that counts against the deployment's health. With `error_event`, an error raised by the
    content ends the stream cleanly with the SSE event that `error_event(error)` returns (None: cut it instead)."""

    def __init__(self, content: AsyncIterator[bytes | str], media_type: str | None = "text/event-stream",
                 on_close: list[Callable[["ProxyStream"], Awaitable[None] | None]] | None = None,
                 error_event: Callable[[Exception], str | None] | None = None) -> None:
        super().__init__(content if error_event is None else self._ending_with_errors(content, error_event),
                         media_type=media_type, headers=SSE_HEADERS)
        self.on_close = on_close or []
        self.completed, self.error, self.penalize = False, None, True

    async def _ending_with_errors(self, content: AsyncIterator[bytes | str],
                                  error_event: Callable[[Exception], str | None]) -> AsyncIterator[bytes | str]:
        try:
            async for chunk in content:
                yield chunk
        except Exception as e:
            event = error_event(e)
            if event is None:
                raise
            self.error, self.penalize = e, not isinstance(e, EngineDeadError)
            yield event
        finally:
            aclose = getattr(content, "aclose", None)
            if aclose is not None:  # the client went away: close the content now, not when it is collected
                await aclose()

    async def stream_response(self, send: Any) -> None:
        try:
            await super().stream_response(send)
        except Exception as e:
            self.error = e
            raise
        self.completed = self.error is None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):  # runs even while the client's request is being cancelled
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
                for fn in self.on_close:
                    result = fn(self)
                    if result is not None:
                        await result


class BackendFailure(Exception):
    """The deployment failed before anything was sent to the client: safe to retry elsewhere. `penalize`: count
    it against the deployment's health (an upstream 429 does not)."""

    def __init__(self, message: str, penalize: bool = True) -> None:
        super().__init__(message)
        self.penalize = penalize


def engine_error_event(e: Exception) -> str:
    """The end of an embedded engine's SSE stream that failed after its first byte: an OpenAI-shaped error event
    (which the OpenAI SDKs raise as an APIError), then [DONE]. The engine died or the server is shutting down:
    503; anything else: 500, its details left to the log."""
    if isinstance(e, APIError):
        body = error_body(e.status, e.message, e.param, e.code)
    elif isinstance(e, EngineDeadError):
        body = error_body(503, str(e), None, "engine_unavailable")
    else:
        logger.error("stream failed", exc_info=e)
        body = error_body(500, "internal server error: the stream failed")
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n"


class EmbeddedBackend:
    """An AsyncLLMEngine in this process, through OpenAIServing. Its load is read from the engine directly."""
    kind = "embedded"

    def __init__(self, serving: OpenAIServing, owned: bool = False) -> None:
        self.serving, self.owned = serving, owned
        self.embedding = OpenAIServingEmbedding(serving)

    @property
    def engine(self) -> AsyncLLMEngine:
        return self.serving.engine

    @property
    def ready(self) -> bool:
        return self.engine.is_ready

    @property
    def dead(self) -> bool:
        return self.engine.is_dead

    @property
    def restarting(self) -> bool:
        return self.engine.is_restarting

    def load_state(self, now: float) -> LoadState:
        n = self.engine.num_requests  # exact: counted when a request is admitted, on this thread
        if not self.engine.is_ready:
            return LoadState(running=n, scraped_at=now)
        seats = self.engine.config.max_num_seqs
        stats = getattr(self.engine, "stats", None)  # the engine thread's last snapshot, where there is one
        kv = stats.kv_cache_usage_perc if stats is not None else 0.0
        return LoadState(running=min(n, seats), waiting=max(0, n - seats), capacity=seats, kv_usage=kv,
                         scraped_at=now)

    def queue_full(self, max_queue_len: int) -> bool:
        return self.engine.num_requests - self.engine.config.max_num_seqs >= max_queue_len

    async def check(self) -> None:
        if self.engine.is_dead:
            raise BackendFailure("the engine is not running")

    async def handle(self, req: "RoutedRequest", timing: RequestTiming) -> Response:
        check_endpoint(req.kind, self.engine.config.runner, req.model)
        body = req.body if req.body.get("model") == req.model else {**req.body, "model": req.model}
        if req.kind == "embeddings":
            try:
                result = await self.embedding.create(body, req.priority, req.max_batch_delay)
            except RuntimeError as e:  # the engine is dead (EngineDeadError), or a step failed for this request
                raise BackendFailure(str(e), penalize=not isinstance(e, EngineDeadError)) from e
            timing.first_token = time.monotonic()  # the whole answer comes at once
            timing.prompt_tokens = result["usage"]["prompt_tokens"]
            return JSONResponse(result)
        cls = ChatCompletionRequest if req.kind == "chat" else CompletionRequest
        try:
            parsed = cls.model_validate(body)
        except ValidationError as e:
            raise validation_error(e) from None
        if (refused := parsed.unsupported()) is not None:
            raise APIError(400, refused[1], refused[0])

        counted: set[str] = set()  # engine requests whose prompt is counted (a completion may have several)

        def on_output(out: RequestOutput) -> None:
            if out.request_id not in counted:  # the exact prompt length replaces the router's estimate
                timing.prompt_tokens = (timing.prompt_tokens if counted else 0) + len(out.prompt_token_ids or ())
                counted.add(out.request_id)
            if timing.first_token is None and out.num_completion_tokens:
                timing.first_token = time.monotonic()
            timing.output_tokens += out.num_completion_tokens

        run = self.serving.chat if req.kind == "chat" else self.serving.completions
        try:
            result = await run(parsed, req.priority, req.max_batch_delay, on_output)  # type: ignore[arg-type]
        except RuntimeError as e:  # the engine is dead (EngineDeadError), or a step failed for this request
            raise BackendFailure(str(e), penalize=not isinstance(e, EngineDeadError)) from e
        if isinstance(result, dict):
            return JSONResponse(result)
        return ProxyStream(result, error_event=engine_error_event)

    async def close(self) -> None:
        if self.owned:
            await asyncio.to_thread(self.engine.shutdown)


class RemoteBackend:
    """An OpenAI-compatible server at `url` (".../v1"), through a pool of keep-alive connections. Its load comes
    from its Prometheus /metrics (vLLM's names), scraped at most every `staleness_s` and only used while younger
    than `max_staleness_s`; without /metrics the router counts only its own requests."""
    kind = "remote"
    ready, dead = True, False

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0, model: str | None = None,
                 staleness_s: float = 0.5, max_staleness_s: float = 5.0, max_connections: int = 1024) -> None:
        url = url.rstrip("/")
        self.base = url if url.endswith("/v1") else url + "/v1"
        parts = urlsplit(self.base)
        self.api_path = parts.path  # "/v1", or "/some/prefix/v1"
        self.metrics_path = self.api_path[:-3] + "/metrics"
        self.pool = UpstreamPool(f"{parts.scheme}://{parts.netloc}", max_connections, min(timeout, 10.0))
        self.model, self.timeout = model, timeout
        self.served: list[str] = []  # the upstream's model ids, learned by the health check
        self.staleness_s, self.max_staleness_s = staleness_s, max_staleness_s
        self.headers = b"content-type: application/json\r\n"
        if api_key:
            self.headers += f"authorization: Bearer {api_key}\r\n".encode()
        self.state = LoadState()
        self._scrape_started = float("-inf")
        self._scrape_task: asyncio.Task | None = None
        self._no_metrics_until = float("-inf")

    # ---- load -----------------------------------------------------------------------------------------------------
    def load_state(self, now: float) -> LoadState:
        if (now - self._scrape_started > self.staleness_s and now >= self._no_metrics_until
                and (self._scrape_task is None or self._scrape_task.done())):
            self._scrape_started = now
            self._scrape_task = asyncio.get_running_loop().create_task(self._scrape(now))
        return self.state if now - self.state.scraped_at <= self.max_staleness_s else LoadState()

    def queue_full(self, max_queue_len: int) -> bool:
        return self.state.waiting >= max_queue_len

    async def _get(self, path: str, timeout: float) -> tuple[int, bytes]:
        r = await self.pool.request("GET", path, headers=self.headers, timeout=timeout)
        try:
            return r.status, await r.read()
        finally:
            r.close()

    async def _scrape(self, started: float) -> None:
        try:
            status, body = await self._get(self.metrics_path, min(self.timeout, 2.0))
        except UpstreamError:
            return  # the health check decides whether it is down
        if status != 200:
            self._no_metrics_until = started + 60.0  # no /metrics here: look again in a minute
            return
        self.state = parse_vllm_metrics(body.decode("utf-8", "replace"), started)

    # ---- requests -------------------------------------------------------------------------------------------------
    def upstream_model(self, name: str) -> str:
        if self.model:
            return self.model
        if len(self.served) == 1 and name not in self.served:
            return self.served[0]
        return name

    def _request_headers(self, req: "RoutedRequest") -> bytes:
        extra = [f"{h}: {v}\r\n" for h in FORWARDED_HEADERS if (v := req.headers.get(h)) is not None]
        return self.headers + "".join(extra).encode("latin-1") if extra else self.headers

    async def handle(self, req: "RoutedRequest", timing: RequestTiming) -> Response:
        body = req.body_for(self.upstream_model(req.model))
        path = self.api_path + UPSTREAM_PATHS[req.kind]
        try:
            r = await self.pool.request("POST", path, body, self._request_headers(req), self.timeout)
        except UpstreamError as e:
            raise BackendFailure(f"{self.base}: {e}") from e
        try:
            if not req.stream or r.status != 200:
                content = await r.read()
                check_status(r.status, content, self.base)
                timing.output_tokens = completion_tokens(content)
                timing.prompt_tokens = completion_tokens(content, b"prompt_tokens") or timing.prompt_tokens
                return Response(content, r.status, media_type=r.content_type)
            chunks = r.iter_chunks()
            try:  # the first chunk is read before answering, so that a dead stream can still be retried
                first = await chunks.__anext__()
            except StopAsyncIteration:
                raise BackendFailure(f"{self.base}: the stream ended before its first chunk") from None
        except UpstreamError as e:
            r.close()
            raise BackendFailure(f"{self.base}: {e}") from e
        except BaseException:
            r.close()
            raise
        timing.first_token = time.monotonic()
        return ProxyStream(relay(first, chunks, timing), r.content_type, on_close=[lambda _: r.close()])

    async def check(self) -> None:
        try:
            status, body = await self._get(self.api_path + "/models", min(self.timeout, 5.0))
        except UpstreamError as e:
            raise BackendFailure(f"{self.base}/models: {e}") from e
        if status != 200:
            raise BackendFailure(f"{self.base}/models answered {status}")
        try:
            self.served = [m["id"] for m in json.loads(body).get("data", [])]
        except (ValueError, AttributeError, KeyError, TypeError):
            pass  # an unusual /models body: keep sending the gateway's model name

    async def close(self) -> None:
        await self.pool.close()


async def relay(first: bytes, chunks: AsyncIterator[bytes], timing: RequestTiming) -> AsyncIterator[bytes]:
    """The upstream's bytes as they come, counting its SSE events (about one per token)."""
    events = first.count(b"data:")
    try:
        yield first
        async for chunk in chunks:
            events += chunk.count(b"data:")
            yield chunk
    finally:
        timing.output_tokens = max(0, events - 2)  # data events less the role chunk and [DONE]


def check_status(status: int, content: bytes, where: str) -> None:
    """5xx and 429 from an upstream may be retried elsewhere; other statuses go to the client as they are."""
    if status >= 500 or status == 429:
        raise BackendFailure(f"{where} answered {status}: {content[:200]!r}", penalize=status != 429)


def completion_tokens(body: bytes, field: bytes = b"completion_tokens") -> int:
    """usage.completion_tokens (or another usage `field`) of a JSON body, found without parsing the whole body
    (0 when absent)."""
    i = body.rfind(b'"' + field + b'"')
    if i < 0:
        return 0
    j = body.find(b":", i) + 1
    while j < len(body) and body[j] in b" \t\r\n":
        j += 1
    k = j
    while k < len(body) and 48 <= body[k] <= 57:
        k += 1
    return int(body[j:k]) if k > j else 0


def parse_vllm_metrics(text: str, scraped_at: float) -> LoadState:
    """Running / waiting requests and KV-cache usage from vLLM's Prometheus metrics (summed over models)."""
    running = waiting = 0.0
    kv = 0.0
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        if name == "vllm:num_requests_running":
            running += value
        elif name == "vllm:num_requests_waiting":
            waiting += value
        elif name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
            kv = max(kv, value)
    return LoadState(running=int(running), waiting=int(waiting), kv_usage=kv, scraped_at=scraped_at)
