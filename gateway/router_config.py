"""build_router(config): the ModelRouter that a parsed config.yaml describes (gateway/config.py's dataclasses).

    models:                      -> router.add_model(name, ...) once per deployment
      - name: small
        model: path/to/hf-dir    -> an embedded engine (engine args beside it)
      - name: big
        deployments:             -> replicas: {url, api_key, timeout, weight, upstream_model} or {model, engine args}
    router: {strategy, fallbacks, num_retries, cooldown_time, health_check_interval, timeout}
    routes: [{name, function: "package.module:function", strategy}]
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

from kvgate.engine.async_engine import AsyncEngineArgs, AsyncLLMEngine
from kvgate.gateway.router import ModelRouter, RouteFunction
from kvgate.gateway.serving import OpenAIServing

EngineFactory = Callable[[str, AsyncEngineArgs], AsyncLLMEngine]
DEFAULT_TIMEOUT_S = 600.0


def import_function(spec: str) -> RouteFunction:
    """"package.module:function" -> the function (ValueError that says what is missing)."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"route function {spec!r}: cannot import {module_name!r}: {e}") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"route function {spec!r}: {module_name!r} has no function {attr!r}")
    return fn


def build_router(config: Any, engine_factory: EngineFactory | None = None) -> ModelRouter:
    """A ModelRouter from a GatewayConfig (or anything with the same attributes). Embedded deployments start
    loading at once, each on its own engine thread, through `engine_factory(model_name, args)` (default:
    AsyncLLMEngine.from_engine_args); the router owns those engines and shuts them down in `close()`."""
    r = config.router
    router = ModelRouter(strategy=getattr(r, "strategy", "latency") or "latency",
                         fallbacks=getattr(r, "fallbacks", None) or {},
                         num_retries=getattr(r, "num_retries", 2),
                         max_queue_len=getattr(config, "max_queue_len", 1024),
                         health_check_interval=getattr(r, "health_check_interval", 10.0),
                         cooldown_s=getattr(r, "cooldown_time", 5.0))
    routes = [(route, import_function(route.function) if getattr(route, "function", None) else None)
              for route in getattr(config, "routes", None) or []]  # an unimportable one fails before loading
    default_timeout = getattr(r, "timeout", None) or DEFAULT_TIMEOUT_S
    make = engine_factory or (lambda _name, args: AsyncLLMEngine.from_engine_args(args))
    for m in config.models:
        strategy = getattr(m, "strategy", None)
        for d in m.deployments:
            if getattr(d, "url", None):
                router.add_model(m.name, d.url, api_key=getattr(d, "api_key", None),
                                 timeout=getattr(d, "timeout", None) or default_timeout,
                                 weight=getattr(d, "weight", 1.0), upstream_model=getattr(d, "upstream_model", None),
                                 strategy=strategy)
            else:
                args = AsyncEngineArgs(**{**d.engine_args, "served_model_name": m.name})
                added = router.add_model(m.name, OpenAIServing(m.name, make(m.name, args)),
                                         weight=getattr(d, "weight", 1.0), strategy=strategy)
                for dep in added:
                    dep.backend.owned = True
    for f, others in router.fallbacks.items():
        unknown = [x for x in [f, *others] if x not in router.models]
        if unknown:
            raise ValueError(f"router.fallbacks names unknown models {unknown}; the models are {list(router.models)}")
    for route, fn in routes:
        router.add_route(route.name, fn, getattr(route, "strategy", None))
    return router
