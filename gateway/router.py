"""ModelRouter: model names (or "auto" / a route name) to deployments, with retries, fallbacks and health checks.

    router = ModelRouter()
    router.add_model("qwen-7b", "path/to/qwen")            # a local HF dir / GGUF -> an embedded engine
    router.add_model("llama3-70b", "http://host:8000/v1")  # a remote OpenAI-compatible server

    @router.route(strategy="latency")                      # "model": "auto" goes through this
    async def handle_request(request):
        return "qwen-7b" if request.len < 100 else "llama3-70b"

A request naming a model goes straight to it; the model's strategy picks one of its deployments. A deployment
that fails before the client got a byte is put into cooldown and the request is retried on another one, then on
the model's fallbacks; when none is left the client gets a 503 with Retry-After (429 when they are only full).
An embedded engine's own state (loading, restarting its core, dead) decides whether it takes requests: a request
that failed because its engine died does not put it into cooldown. Health checks probe every deployment each
`health_check_interval`, and one in cooldown as soon as its cooldown ends (gateway/health.py).
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping, Sequence

from starlette.responses import Response

from kvgate.engine.async_engine import AsyncEngineArgs, AsyncLLMEngine, EngineDeadError
from kvgate.engine.config import EngineArgs
from kvgate.gateway.backends import BackendFailure, EmbeddedBackend, ProxyStream, RemoteBackend
from kvgate.gateway.errors import APIError
from kvgate.gateway.health import COOLDOWN, Health
from kvgate.gateway.routed_request import RoutedRequest
from kvgate.gateway.serving import OpenAIServing
from kvgate.gateway.strategies import Deployment, RequestTiming, Strategy, estimate, make_strategy

__all__ = ["ModelRouter", "Route", "RouteFunction", "RoutedRequest"]
logger = logging.getLogger(__name__)
RouteFunction = Callable[[RoutedRequest], "Awaitable[str] | str"]


@dataclass
class Route:
    name: str
    function: RouteFunction | None = None  # None: the strategy picks among every model's deployments
    strategy: str | None = None


class ModelRouter:
    def __init__(self, strategy: str = "latency", fallbacks: Mapping[str, Sequence[str]] | None = None,
                 num_retries: int = 2, max_queue_len: int = 1024, health_check_interval: float = 10.0,
                 cooldown_s: float = 5.0, max_fails: int = 1) -> None:
        make_strategy(strategy)  # refuse an unknown name now
        self.strategy, self.num_retries, self.max_queue_len = strategy, num_retries, max_queue_len
        self.fallbacks = {k: list(v) for k, v in (fallbacks or {}).items()}
        self.health_check_interval, self.cooldown_s, self.max_fails = health_check_interval, cooldown_s, max_fails
        self.models: dict[str, list[Deployment]] = {}
        self.model_strategy: dict[str, str] = {}
        self.created: dict[str, int] = {}
        self.routes: dict[str, Route] = {}
        self.retries = 0  # requests sent again after a deployment failed
        self._strategies: dict[tuple[str, str], Strategy] = {}
        self._health_task: asyncio.Task | None = None
        self._count_tokens: Callable[[str], int] | None = None
        self.closing = False  # the server is shutting down: no request is sent or retried any more
        self.starting: Callable[[], bool] | None = None  # True while other API processes start: /health says loading

    # ---- set-up ---------------------------------------------------------------------------------------------------
    def add_model(self, name: str, target: Any, *, weight: float = 1.0, api_key: str | None = None,
                  timeout: float = 600.0, upstream_model: str | None = None, strategy: str | None = None,
                  **engine_args: Any) -> list[Deployment]:
        """Add deployments of `name`: `target` is a local HF dir / GGUF path, EngineArgs, an AsyncLLMEngine or an
        OpenAIServing (embedded), an http(s) URL (remote), a dict ({"url": ..., "api_key": ...} or
        {"model": path, engine args...}), or a list of those (replicas). Calling it again adds replicas."""
        if name in self.routes:
            raise ValueError(f"{name!r} is already a route name")
        if strategy is not None:
            make_strategy(strategy)
            self.model_strategy[name] = strategy
        targets = list(target) if isinstance(target, (list, tuple)) else [target]
        deps = self.models.setdefault(name, [])
        self.created.setdefault(name, int(time.time()))
        added = []
        for t in targets:
            w, backend = self._backend(name, t, weight, api_key, timeout, upstream_model, engine_args)
            health = Health(self.max_fails, self.cooldown_s, probe_interval_s=self.health_check_interval)
            d = Deployment(name, f"{name}#{len(deps)}", backend, w, health)
            deps.append(d)
            added.append(d)
        return added

    @staticmethod
    def _backend(name: str, t: Any, weight: float, api_key: str | None, timeout: float, upstream_model: str | None,
                 engine_args: dict[str, Any]) -> tuple[float, Any]:
        if isinstance(t, dict):
            t = dict(t)
            weight = float(t.pop("weight", weight))
            if "url" in t:
                return weight, RemoteBackend(t.pop("url"), api_key=t.pop("api_key", api_key),
                                             timeout=float(t.pop("timeout", timeout)),
                                             model=t.pop("upstream_model", upstream_model), **t)
            path = t.pop("model", None)
            return weight, EmbeddedBackend(OpenAIServing(name, AsyncLLMEngine.from_engine_args(
                AsyncEngineArgs(model=path, **{**engine_args, **t}))), owned=True)
        if isinstance(t, str) and t.startswith(("http://", "https://")):
            return weight, RemoteBackend(t, api_key=api_key, timeout=timeout, model=upstream_model)
        if isinstance(t, OpenAIServing):
            return weight, EmbeddedBackend(t)
        if isinstance(t, AsyncLLMEngine):
            return weight, EmbeddedBackend(OpenAIServing(name, t))
        if isinstance(t, EngineArgs):
            return weight, EmbeddedBackend(OpenAIServing(name, AsyncLLMEngine.from_engine_args(t)), owned=True)
        if isinstance(t, (str, os.PathLike)) or t is None:
            args = AsyncEngineArgs(model=None if t is None else os.fspath(t), **engine_args)
            return weight, EmbeddedBackend(OpenAIServing(name, AsyncLLMEngine.from_engine_args(args)), owned=True)
        raise TypeError(f"cannot serve {name!r} from {type(t).__name__}: give a path, a URL, EngineArgs, "
                        "an AsyncLLMEngine or an OpenAIServing")

    def route(self, function: RouteFunction | None = None, *, strategy: str | None = None, name: str = "auto"):
        """Decorator: `@router.route` or `@router.route(strategy="latency", name="auto")` on a function that
        takes a RoutedRequest and returns a model name (it may be async)."""
        def register(fn: RouteFunction) -> RouteFunction:
            self.add_route(name, fn, strategy)
            return fn
        return register(function) if function is not None else register

    def add_route(self, name: str, function: RouteFunction | None = None, strategy: str | None = None) -> None:
        if name in self.models:
            raise ValueError(f"{name!r} is already a model name")
        if strategy is not None:
            make_strategy(strategy)
        self.routes[name] = Route(name, function, strategy)

    def deployments(self) -> list[Deployment]:
        return [d for deps in self.models.values() for d in deps]

    def embedded(self) -> dict[str, OpenAIServing]:
        """Embedded servings by model name (replicas after the first as "name#i"), for /metrics."""
        out: dict[str, OpenAIServing] = {}
        for d in self.deployments():
            if isinstance(d.backend, EmbeddedBackend):
                out[d.model if d.model not in out else d.name] = d.backend.serving
        return out

    def count_tokens(self) -> Callable[[str], int] | None:
        """The first ready embedded model's tokenizer, as a token counter (None: no embedded model)."""
        if self._count_tokens is None:
            for d in self.deployments():
                if isinstance(d.backend, EmbeddedBackend) and d.backend.ready:
                    encode = d.backend.serving.tokenizer.encode
                    self._count_tokens = lambda text: len(encode(text))
                    break
        return self._count_tokens

    # ---- dispatch -------------------------------------------------------------------------------------------------
    async def dispatch(self, req: RoutedRequest) -> Response:
        self.start()
        if req.count_tokens is None:
            req.count_tokens = self.count_tokens()
        model, strategy = await self._resolve(req)
        chain = [model, *self.fallbacks.get(model, [])]
        tried: set[str] = set()
        for m in chain:
            if m not in self.models:
                continue
            req.model = m
            for _ in range(self.num_retries + 1):
                if self.closing:
                    raise APIError(503, "the server is shutting down; retry on another replica", None,
                                   "server_shutting_down", headers={"Retry-After": "1"})
                deps = [d for d in self.models[m] if d.name not in tried and self._available(d)]
                if not deps:
                    break
                d = deps[0] if len(deps) == 1 else self._strategy(m, strategy).pick(deps, req)
                tried.add(d.name)
                try:
                    return await self._send(d, deps, req)
                except BackendFailure as e:
                    self.retries += 1
                    logger.warning("%s failed (%s); trying another deployment", d.name, e)
        raise self._unavailable(chain)

    async def _resolve(self, req: RoutedRequest) -> tuple[str, str]:
        name = req.model
        if not name:
            if len(self.models) != 1 or self.routes:
                raise APIError(400, f"the request names no model; available: {', '.join([*self.models, *self.routes])}",
                               "model")
            name = next(iter(self.models))
        route = self.routes.get(name)
        if route is None:
            if name not in self.models:
                raise APIError(404, f"The model `{name}` does not exist. Available: "
                                    f"{', '.join([*self.models, *self.routes])}", "model", "model_not_found")
            return name, self.model_strategy.get(name, self.strategy)
        strategy = route.strategy or self.strategy
        if route.function is None:  # the strategy picks among every model's deployments
            deps = [d for d in self.deployments() if self._available(d)] or self.deployments()
            return self._strategy("", strategy).pick(deps, req).model, strategy
        choice = route.function(req)
        if inspect.isawaitable(choice):
            choice = await choice
        if choice not in self.models:
            raise APIError(500, f"route `{name}` chose `{choice}`, which is not a model here "
                                f"(models: {', '.join(self.models)})", "model")
        return choice, route.strategy or self.model_strategy.get(choice, self.strategy)

    def _strategy(self, model: str, name: str) -> Strategy:
        key = (model, name)
        if key not in self._strategies:
            self._strategies[key] = make_strategy(name)
        return self._strategies[key]

    def _available(self, d: Deployment) -> bool:
        b = d.backend
        return b.ready and not b.dead and d.health.available() and not b.queue_full(self.max_queue_len)

    async def _send(self, d: Deployment, siblings: list[Deployment], req: RoutedRequest) -> Response:
        now = time.monotonic()
        wait = estimate(d, siblings, req, now)[0] if len(self.models[d.model]) > 1 else 0.0  # learn net of queueing
        timing = req.timing = RequestTiming(now, req.len, d.load(now), wait)
        key = d.stats.begin(timing)
        try:
            resp = await d.backend.handle(req, timing)
        except BackendFailure as e:
            d.stats.end(key, time.monotonic(), ok=False)
            if e.penalize:
                d.health.on_failure(time.monotonic(), str(e))
            raise
        except BaseException:  # the client's mistake, or the client went away: not the deployment's fault
            d.stats.in_flight.pop(key, None)
            raise
        if isinstance(resp, ProxyStream):
            resp.on_close.append(lambda r: self._finished(d, key, r.completed, r.error, r.penalize))
        else:
            self._finished(d, key, True, None)
        return resp

    @staticmethod
    def _finished(d: Deployment, key: int, completed: bool, error: BaseException | None,
                  penalize: bool = True) -> None:
        now = time.monotonic()
        if error is not None and not isinstance(error, OSError):  # the deployment broke the stream
            d.stats.end(key, now, ok=False)
            if penalize:
                d.health.on_failure(now, f"stream broken: {error!r}")
        elif completed:
            d.stats.end(key, now, ok=True)
            d.health.on_success()
        else:  # the client went away
            d.stats.in_flight.pop(key, None)

    def _unavailable(self, chain: list[str]) -> APIError:
        now = time.monotonic()
        reasons, waits, full = [], [], None
        for m in chain:
            for d in self.models.get(m, []):
                b = d.backend
                if b.dead:
                    reasons.append(f"{d.name}: the engine is not running")
                    waits.append(30)
                elif not b.ready:
                    restarting = getattr(b, "restarting", False)
                    reasons.append(f"{d.name}: {'restarting its engine core' if restarting else 'still loading'}")
                    waits.append(5)
                elif not d.health.available():
                    reasons.append(f"{d.name}: cooling down after: {d.health.last_error[:200]}")
                    waits.append(d.health.retry_after(now))
                elif b.queue_full(self.max_queue_len):
                    full = full or d
                else:
                    reasons.append(f"{d.name}: failed: {d.health.last_error[:200]}")
                    waits.append(1)
        if full is not None:
            queued = full.load(now) - (full.load_state(now).capacity or 0)
            return APIError(429, f"`{full.model}` has {queued} requests waiting (limit {self.max_queue_len}); "
                                 "retry later", None, "queue_full", headers={"Retry-After": "1"})
        return APIError(503, f"no deployment of `{chain[0]}` can take the request now: {'; '.join(reasons)}",
                        "model", "model_unavailable", headers={"Retry-After": str(min(waits, default=1))})

    # ---- health checks --------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the periodic health checks (on the running event loop; once)."""
        if self._health_task is None or self._health_task.done():
            self._health_task = asyncio.get_running_loop().create_task(self._health_loop())

    async def _health_loop(self) -> None:
        """Every health_check_interval, probe the deployments that take traffic; and probe one in cooldown as
        soon as its cooldown ends (health.until), which is never more than an interval after its last probe."""
        last_full: float = float("-inf")
        while True:
            now = time.monotonic()
            full = now - last_full >= self.health_check_interval
            due = [d for d in self.deployments()
                   if d.backend.ready and (d.health.due_for_probe(now) or (full and d.health.available()))]
            if full:
                last_full = now
            if due:
                await asyncio.gather(*(self.check(d) for d in due))
            cooling = [d.health.until - time.monotonic() for d in self.deployments() if d.health.state == COOLDOWN]
            await asyncio.sleep(max(0.05, min([last_full + self.health_check_interval - time.monotonic(),
                                               *cooling])))

    async def check(self, d: Deployment) -> bool:
        """Probe one deployment now; a cooled-down one that passes gets traffic again."""
        try:
            await d.backend.check()
        except BackendFailure as e:
            d.health.on_failure(time.monotonic(), f"health check: {e}")
            return False
        except Exception as e:  # noqa: BLE001 - a probe must never end the loop
            d.health.on_failure(time.monotonic(), f"health check: {e!r}")
            return False
        if d.health.state == "healthy" or d.health.due_for_probe(time.monotonic()):
            d.health.on_probe_ok()
        return True

    # ---- shutdown -------------------------------------------------------------------------------------------------
    def in_flight(self) -> int:
        """Requests sent to a deployment and not finished (streams included)."""
        return sum(len(d.stats.in_flight) for d in self.deployments())

    def abort_all(self, reason: str) -> int:
        """Stop taking requests, and end every request in flight on an embedded engine: its client gets an error
        that says `reason` (a stream ends with an error event), and its KV blocks are freed on the engine's next
        turn. Returns how many were aborted. (Remote relays are left to the HTTP server's own cancellation.)"""
        self.closing = True
        error = EngineDeadError(reason)
        return sum(s.engine.abort_all(error) for s in self.embedded().values())

    async def close(self) -> None:
        """Abort whatever is still in flight, report each embedded engine's final state (requests running, KV
        blocks in use: both 0 unless something leaked) and stop the engines this router owns."""
        if self._health_task is not None:
            self._health_task.cancel()
            self._health_task = None
        self.abort_all("the server is shutting down")
        for name, serving in self.embedded().items():
            stats = await serving.engine.settled_stats(timeout=5.0)
            if stats is not None:
                logger.info("%s: stopping with %d requests running, %d waiting and %d of %d KV blocks in use", name,
                            stats.num_requests_running, stats.num_requests_waiting,
                            stats.num_blocks - stats.num_free_blocks, stats.num_blocks)
        await asyncio.gather(*(d.backend.close() for d in self.deployments()), return_exceptions=True)
