"""config.yaml for `kvgate serve --config`: the models (embedded engines or remote upstreams), the router and its
routes, and the server options. The file is checked up front: an invalid one is refused with the key path and the
reason. Flags given on the command line override the file.

Engine args (EngineArgs' names) may sit at the top level, where they are defaults for every embedded engine, on a
model entry with `model:`, or on an embedded deployment; the innermost one wins, and a flag wins over all of them.
Relative model paths are relative to the config file's folder."""
from __future__ import annotations

import difflib
import importlib.util
import os
import re
from dataclasses import dataclass, field
from typing import Any, NoReturn
from urllib.parse import urlparse

from kvgate.engine.arg_utils import (DEFAULT_MODEL_NAME, ArgError, ArgSpec, EngineArgs, arg, arg_specs, check_value,
                                     describe)
from kvgate.gateway.auth import KEY_SPECS, APIKey
from kvgate.gateway.chat_output import parser_settings
from kvgate.gateway.strategies import STRATEGIES
from kvgate.gateway.yaml_file import ConfigError, read_yaml


@dataclass
class DeploymentSpec:
    """One replica of a model: a remote OpenAI-compatible server (url) or an embedded engine (engine_args)."""
    url: str | None = arg(None, "a remote OpenAI-compatible server, e.g. http://10.0.0.5:8000/v1")
    api_key: str | None = arg(None, "sent to the remote upstream as a Bearer key")
    timeout: float | None = arg(None, "seconds per request to the remote upstream", gt=0)
    weight: float = arg(1.0, "share of traffic under the weighted strategy", gt=0)
    upstream_model: str | None = arg(None, "the model id the remote server knows (default: the model's name)")
    engine_args: dict[str, Any] = field(default_factory=dict)  # EngineArgs fields, `model` included

    @property
    def is_remote(self) -> bool:
        return self.url is not None


@dataclass
class ModelSpec:
    name: str  # the id clients send as "model"
    deployments: list[DeploymentSpec]
    strategy: str | None = None  # this model's strategy among its deployments (default: router.strategy)


@dataclass
class RouterSpec:
    strategy: str = arg("latency", "how a model's deployment is chosen (the default for every model)",
                        choices=tuple(STRATEGIES))
    fallbacks: dict[str, list[str]] = field(default_factory=dict)  # model -> models to try when it is down
    num_retries: int = arg(2, "other deployments tried when one fails before the first byte", ge=0)
    cooldown_time: float = arg(5.0, "seconds a failed deployment is kept out before its first probe; while probes "
                                    "fail, the next comes after twice as long, at most health_check_interval",
                               ge=0)
    health_check_interval: float = arg(10.0, "seconds between health checks of every deployment (and the longest "
                                             "wait between probes of a failed one)", gt=0)
    timeout: float | None = arg(None, "default per-request timeout (seconds) for remote deployments", gt=0)


@dataclass
class RouteSpec:
    name: str  # a model id clients may send ("auto") that goes through this route
    function: str | None = arg(None, '"package.module:function" returning a model name (none: the strategy picks)')
    strategy: str | None = arg(None, "the strategy of this route (default: router.strategy)",
                               choices=tuple(STRATEGIES))


@dataclass
class GatewayConfig:
    models: list[ModelSpec]
    router: RouterSpec = field(default_factory=RouterSpec)
    routes: list[RouteSpec] = field(default_factory=list)
    host: str = arg("127.0.0.1", "address to listen on")
    port: int = arg(8000, "port to listen on", ge=1, le=65535)
    api_key: str | None = arg(None, "require this Bearer key on /v1/* (default: $KVGATE_API_KEY, else none), as the "
                                    "key named 'default', without limits")
    api_keys_file: str | None = arg(None, "a YAML file listing API keys with their limits (name, key or key_env, "
                                          "rpm, tpm, max_concurrent), as config.yaml's api_keys:", metavar="FILE")
    disable_log_requests: bool = arg(False, "no access-log line per request (method, path, model, status, tokens, "
                                            "latency; never the prompt)")
    max_body_bytes: int = arg(8 << 20, "larger request bodies get 413", ge=1)
    max_queue_len: int = arg(1024, "waiting requests per model before 429", ge=0)
    timeout_keep_alive: float = arg(75.0, "seconds an idle keep-alive connection stays open (uvicorn's flag; its "
                                          "default, 5, equals httpx's own expiry, and a client reusing a connection "
                                          "just as the server closed it got a connection reset)", gt=0)
    shutdown_timeout: float = arg(25.0, "on SIGTERM or SIGINT, seconds the requests in flight get to finish before "
                                        "they are aborted; then the engines stop and kvgate exits with status 0 (a "
                                        "second signal exits at once)", ge=0)
    api_server_count: int = arg(1, "HTTP server processes sharing the port and each embedded model's engine core "
                                   "(vLLM's flag): more of them stream more tokens at high concurrency; each engine "
                                   "core then runs in a process of its own and is not restarted if it dies",
                                ge=1, le=64)
    tool_parser_plugin: str | None = arg(None, "a Python file imported before the models are checked, which "
                                               "registers tool-call or reasoning parsers of its own (vLLM's flag)",
                                         metavar="FILE")
    api_keys: list[APIKey] = field(default_factory=list)  # from api_keys:, api_keys_file and api_key
    source: str = ""  # the file it came from ("" without one)


Specs = dict[str, tuple[ArgSpec, type, bool, Any]]
ENGINE_SPECS: Specs = arg_specs(EngineArgs)
SERVE_SPECS: Specs = arg_specs(GatewayConfig)
ROUTER_SPECS: Specs = arg_specs(RouterSpec)
DEPLOYMENT_SPECS: Specs = arg_specs(DeploymentSpec)
ROUTE_SPECS: Specs = arg_specs(RouteSpec)
STRATEGY_SPEC: Specs = {"strategy": ROUTE_SPECS["strategy"]}
ALIASES = {"max_batch_size": "max_num_seqs"}  # alias -> the name it stands for
# relative paths in a file are relative to the file
PATH_KEYS = ("model", "tokenizer", "generation_config", "api_keys_file", "tool_parser_plugin")

TOP_KEYS = {*ENGINE_SPECS, *SERVE_SPECS, "models", "router", "routes", "api_keys"}
MODEL_KEYS = {*ENGINE_SPECS, "name", "deployments", "strategy"} - {"served_model_name"}
DEPLOYMENT_KEYS = {*ENGINE_SPECS, *DEPLOYMENT_SPECS} - {"served_model_name"}
ROUTER_KEYS = {*ROUTER_SPECS, "fallbacks"}
ROUTE_KEYS = {"name", "function", "strategy"}
API_KEY_KEYS = {"name", *KEY_SPECS}
HINTS = {"served_model_name": "name each entry of models: with name: instead"}
_FUNCTION = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def _join(path: str, key: str | int) -> str:
    return f"{path}[{key}]" if isinstance(key, int) else (f"{path}.{key}" if path else key)


class _Checker:
    def __init__(self, source: str, base_dir: str) -> None:
        self.source, self.base_dir = source, base_dir
        self.top: dict = {}  # the file's top level
        self.flags: set[str] = set()  # top-level keys that flags set

    def fail(self, path: str, reason: str) -> NoReturn:
        raise ConfigError(": ".join(p for p in (self.source, path, reason) if p))

    def mapping(self, v: Any, path: str, what: str) -> dict:
        if not isinstance(v, dict):
            self.fail(path, f"must be a mapping ({what}), got {describe(v)}")
        return v

    def items(self, v: Any, path: str, what: str, empty_ok: bool = False) -> list:
        if not isinstance(v, list) or not (v or empty_ok):
            self.fail(path, f"must be a {'' if empty_ok else 'non-empty '}list ({what}), got {describe(v)}")
        return v

    def keys(self, d: dict, allowed: set[str], path: str) -> None:
        for k in d:
            if not isinstance(k, str) or k not in allowed:
                close = difflib.get_close_matches(str(k), sorted(allowed), n=1)
                hint = HINTS.get(k) or (f"did you mean {close[0]!r}?" if close else None)
                self.fail(path, f"unknown key {k!r}" + (f" ({hint})" if hint else ""))

    def value(self, v: Any, specs: Specs, path: str, key: str) -> Any:
        spec, typ, optional, _ = specs[key]
        try:
            v = check_value(key, v, spec, typ, optional)
        except ArgError as e:
            self.fail(path, e.reason)
        if isinstance(v, str) and key in PATH_KEYS:
            return self.model_path(v, path, key)
        return v

    def model_path(self, v: str, path: str, key: str) -> str:
        if (key == "model" and v == DEFAULT_MODEL_NAME) or (key == "generation_config" and v in ("auto", "vllm")):
            return v
        p = os.path.join(self.base_dir, os.path.expanduser(v))
        if key in ("api_keys_file", "tool_parser_plugin"):
            if not os.path.isfile(p):
                self.fail(path, f"no such file: {v!r}" + ("" if p == v else f" (looked for {p})"))
            return p
        if key == "generation_config":
            if not os.path.isfile(os.path.join(p, "generation_config.json")):
                self.fail(path, f"must be auto, vllm or a directory holding a generation_config.json, got {v!r}")
            return p
        found = os.path.exists(p) if key == "tokenizer" else (
            os.path.isfile(p) or os.path.isfile(os.path.join(p, "config.json")))
        if not found:
            where = "" if p == v else f" (looked for {p})"
            self.fail(path, f"no {key} at {v!r}{where}: expected a local Hugging Face directory with config.json or a "
                            f".gguf file (or {DEFAULT_MODEL_NAME!r}); no model hub is reached")
        return p

    def engine_args(self, d: dict, path: str, exclude: tuple[str, ...] = ()) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in d.items():
            if k in ENGINE_SPECS and k not in exclude:
                name = ALIASES.get(k, k)
                if name in out:
                    self.fail(_join(path, k), f"{k} is an alias of {name}: give one of them")
                out[name] = self.value(v, ENGINE_SPECS, _join(path, k), k)
        return out

    def typed(self, d: dict, specs: Specs, path: str) -> dict[str, Any]:
        return {k: self.value(d[k], specs, _join(path, k), k) for k in specs if k in d}

    # ---- sections -------------------------------------------------------------------------------------------------
    def models(self, raw: Any, top_engine: dict[str, Any]) -> list[ModelSpec]:
        models: list[ModelSpec] = []
        seen: dict[str, int] = {}
        for i, m in enumerate(self.items(raw, "models", "each with a name and a model or deployments")):
            p = f"models[{i}]"
            self.keys(self.mapping(m, p, "name, and model or deployments"), MODEL_KEYS, p)
            name = self.name(m, p, "model", seen, i)
            strategy = self.typed(m, STRATEGY_SPEC, p).get("strategy")
            own = self.engine_args(m, p)
            if ("model" in m) == ("deployments" in m):
                self.fail(p, "give either model: or deployments:, not both" if "model" in m else
                          "needs model: (a local HF directory or .gguf file, for an embedded engine) or deployments: "
                          "(a list of replicas)")
            if "model" in m:
                args = self.checked({**top_engine, **own}, [(p, m), ("", self.top)])
                deployments = [DeploymentSpec(engine_args=args)]
            else:
                if own:
                    k = next(k for k in m if k in ENGINE_SPECS)
                    self.fail(_join(p, k), "a model with deployments: takes engine args inside each deployment")
                deployments = self.deployments(m["deployments"], _join(p, "deployments"), top_engine, m)
            models.append(ModelSpec(name, deployments, strategy))
        return models

    def name(self, d: dict, path: str, what: str, seen: dict[str, int], index: int) -> str:
        name = d.get("name")
        if not isinstance(name, str) or not name.strip():
            self.fail(_join(path, "name"), f"each {what} needs a name (a non-empty string), got {describe(name)}")
        if name in seen:
            self.fail(_join(path, "name"), f"duplicate name {name!r} (also at index {seen[name]})")
        seen[name] = index
        return name

    def deployments(self, raw: Any, path: str, top_engine: dict[str, Any], model: dict) -> list[DeploymentSpec]:
        out = []
        for j, d in enumerate(self.items(raw, path, "replicas, each with url: or model:")):
            p = f"{path}[{j}]"
            self.keys(self.mapping(d, p, "url: or model:, with options"), DEPLOYMENT_KEYS, p)
            if ("url" in d) == ("model" in d):
                self.fail(p, "give either url: or model:, not both" if "url" in d else
                          "needs url: (a remote OpenAI-compatible server) or model: (an embedded engine)")
            opts = self.typed(d, DEPLOYMENT_SPECS, p)
            if "url" in d:
                u = urlparse(opts["url"])
                if u.scheme not in ("http", "https") or not u.netloc:
                    self.fail(_join(p, "url"), f"must be an http:// or https:// URL, got {opts['url']!r}")
                k = next((k for k in d if k in ENGINE_SPECS), None)
                if k is not None:
                    self.fail(_join(p, k), "engine args apply to embedded (model:) deployments, not to a url: one")
                out.append(DeploymentSpec(**opts))
            else:
                k = next((k for k in ("api_key", "upstream_model") if k in d), None)
                if k is not None:
                    self.fail(_join(p, k), "only a url: deployment takes this key")
                args = self.checked({**top_engine, **self.engine_args(d, p)}, [(p, d), ("", self.top)])
                out.append(DeploymentSpec(**opts, engine_args=args))
        return out

    def checked(self, args: dict[str, Any], layers: list[tuple[str, dict]]) -> dict[str, Any]:
        """One embedded engine's args, checked together (EngineArgs.check: the rules between arguments too). A
        failure is reported where the argument it names was set, innermost level first."""
        try:
            engine_args = EngineArgs(**args)
            engine_args.check()
            parser_settings(engine_args)  # the gateway's parsers of this model: registered names
        except ArgError as e:
            keys = (e.name, *(a for a, n in ALIASES.items() if n == e.name))
            path = next((_join(p, k) for p, d in layers for k in keys if k in d), e.name)
            if path in self.flags:  # set by a flag, not by the file
                path = "--" + path.replace("_", "-")
            self.fail(path, e.reason)
        return args

    def router(self, raw: Any, names: list[str]) -> RouterSpec:
        self.keys(self.mapping(raw, "router", "strategy, fallbacks, ..."), ROUTER_KEYS, "router")
        spec = RouterSpec(**self.typed(raw, ROUTER_SPECS, "router"))
        fallbacks = self.mapping(raw.get("fallbacks", {}), "router.fallbacks", "model: [other models]")
        for model, others in fallbacks.items():
            p = _join("router.fallbacks", str(model))
            self.known(model, names, p)
            others = [others] if isinstance(others, str) else others
            if not isinstance(others, list) or not others:
                self.fail(p, f"must be a list of model names, got {describe(others)}")
            for k, other in enumerate(others):
                self.known(other, names, _join(p, k))
                if other == model:
                    self.fail(_join(p, k), f"a model cannot be its own fallback ({model!r})")
            spec.fallbacks[model] = list(others)
        return spec

    def known(self, name: Any, names: list[str], path: str) -> None:
        if name not in names:
            self.fail(path, f"unknown model {name!r}; the models are {', '.join(names)}")

    def routes(self, raw: Any, names: list[str]) -> list[RouteSpec]:
        out, seen = [], {}
        for i, r in enumerate(self.items(raw, "routes", "each with a name", empty_ok=True)):
            p = f"routes[{i}]"
            self.keys(self.mapping(r, p, "name, function, strategy"), ROUTE_KEYS, p)
            name = self.name(r, p, "route", seen, i)
            if name in names:
                self.fail(_join(p, "name"), f"{name!r} is already a model's name; a route needs its own")
            opts = self.typed(r, ROUTE_SPECS, p)
            if opts.get("function") is not None and not _FUNCTION.match(opts["function"]):
                self.fail(_join(p, "function"), f"must look like 'package.module:function', got {opts['function']!r}")
            out.append(RouteSpec(name, **opts))
        return out


def _api_keys(c: "_Checker", raw: Any, path: str, seen: dict[str, int], secrets: dict[str, str]) -> list[APIKey]:
    """The entries of an api_keys: list (name, key or key_env, limits). Messages never hold a key."""
    out = []
    for i, entry in enumerate(c.items(raw, path, "each with a name and a key or key_env", empty_ok=True)):
        p = f"{path}[{i}]"
        c.keys(c.mapping(entry, p, "name, key or key_env, rpm, tpm, max_concurrent"), API_KEY_KEYS, p)
        name = c.name(entry, p, "API key", {}, i)
        if name in seen:
            c.fail(_join(p, "name"), f"duplicate API key name {name!r}")
        seen[name] = i
        opts = c.typed(entry, KEY_SPECS, p)
        if ("key" in entry) == ("key_env" in entry):
            c.fail(p, "give either key: or key_env:, not both" if "key" in entry else
                   "needs key: (the key) or key_env: (an environment variable holding it)")
        secret = opts.pop("key", None) or os.environ.get(opts["key_env"], "")
        if not secret:
            c.fail(_join(p, "key_env" if "key_env" in entry else "key"),
                   f"the environment variable {opts['key_env']} is not set" if "key_env" in entry else "is empty")
        if secret in secrets:
            c.fail(p, f"API keys {secrets[secret]!r} and {name!r} are the same key")
        secrets[secret] = name
        opts.pop("key_env", None)
        out.append(APIKey(name, secret, **opts))
    return out


def _import_plugin(c: "_Checker", path: str) -> None:
    """Run the parser plugin file once (its @ToolParserManager.register_module / @ReasoningParserManager...
    decorators register its parsers); a missing or failing file is a ConfigError that says why."""
    path = os.path.abspath(path)
    if path in _PLUGINS:
        return
    spec = importlib.util.spec_from_file_location(f"kvgate_parser_plugin_{len(_PLUGINS)}", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    except Exception as e:  # noqa: BLE001 - the user's file: report what it raised
        c.fail("tool_parser_plugin", f"importing {path} failed: {type(e).__name__}: {e}")
    _PLUGINS.add(path)


_PLUGINS: set[str] = set()  # plugin files already imported (a config is parsed more than once: flags, reloads)


def parse_config(raw: Any, source: str = "", base_dir: str = "", flags: set[str] | None = None) -> GatewayConfig:
    """A GatewayConfig from the parsed YAML (a dict); ConfigError names the key path (or the flag) and the reason."""
    c = _Checker(source, base_dir)
    c.flags = flags or set()
    raw = {} if raw is None else c.mapping(raw, "", "of top-level keys")
    c.keys(raw, TOP_KEYS, "")
    c.top = raw
    serve = c.typed(raw, SERVE_SPECS, "")
    if serve.get("tool_parser_plugin"):  # before the models: their tool_call_parser may name what it registers
        _import_plugin(c, serve["tool_parser_plugin"])
    top_engine = c.engine_args(raw, "", exclude=("model", "served_model_name"))
    if "models" in raw:
        k = next((k for k in ("model", "served_model_name") if k in raw), None)
        if k is not None:
            c.fail(k, "give either a top-level model or a models: list, not both (name each entry of models:)")
        models = c.models(raw["models"], top_engine)
    else:
        single = c.engine_args(raw, "")
        model = single.get("model")
        name = single.get("served_model_name") or (
            DEFAULT_MODEL_NAME if model in (None, DEFAULT_MODEL_NAME)
            else os.path.basename(os.path.normpath(model)).removesuffix(".gguf"))
        engine_args = c.checked({**top_engine, **({"model": model} if model is not None else {})}, [("", raw)])
        models = [ModelSpec(name, [DeploymentSpec(engine_args=engine_args)])]
    names = [m.name for m in models]
    router = c.router(raw.get("router", {}), names)
    routes = c.routes(raw["routes"], names) if "routes" in raw else []
    seen: dict[str, int] = {}
    secrets: dict[str, str] = {}
    keys = _api_keys(c, raw.get("api_keys", []), "api_keys", seen, secrets)
    if serve.get("api_keys_file"):
        listed = read_yaml(serve["api_keys_file"])
        listed = listed.get("api_keys") if isinstance(listed, dict) else listed
        keys += _api_keys(_Checker(serve["api_keys_file"], ""), listed, "api_keys", seen, secrets)
    if serve.get("api_key"):
        keys += _api_keys(c, [{"name": "default", "key": serve["api_key"]}], "api_key", seen, secrets)
    return GatewayConfig(models, router, routes, **serve, api_keys=keys, source=source)


def load_config(path: str | None, overrides: dict[str, Any] | None = None) -> GatewayConfig:
    """The config from `path` (None: no file, the default model) with `overrides` (flags the user gave, by
    option name: block_size, port, ...) applied on top: a flag wins over every level of the file."""
    raw = read_yaml(path) if path is not None else {}
    if overrides:
        if not isinstance(raw, dict):  # let parse_config report the shape
            return parse_config(raw, path or "")
        raw = apply_overrides(raw, overrides, path or "the config")
    return parse_config(raw, path or "", os.path.dirname(path) if path else "", set(overrides or ()))


def apply_overrides(raw: dict, overrides: dict[str, Any], source: str) -> dict:
    flags = _Checker("", "")
    raw = dict(raw)
    for key, value in overrides.items():
        flag = "--" + key.replace("_", "-")
        if key not in ENGINE_SPECS and key not in SERVE_SPECS:
            raise ConfigError(f"{flag}: not a config option")
        value = flags.value(value, ENGINE_SPECS if key in ENGINE_SPECS else SERVE_SPECS, flag, key)
        if key in PATH_KEYS and value not in (DEFAULT_MODEL_NAME, "auto", "vllm"):
            value = os.path.abspath(value)  # relative to the current directory, not to the file
        if key in ("model", "served_model_name") and "models" in raw:
            raise ConfigError(f"{flag}: {source} has a models: list; set {key} per model in the file instead")
        drop = {key, *(a for a, n in ALIASES.items() if n == key), ALIASES.get(key, key)}
        for k in drop:
            raw.pop(k, None)
        raw[key] = value
        if key in ENGINE_SPECS and isinstance(raw.get("models"), list):
            raw["models"] = [_without(m, drop) for m in raw["models"]]
    return raw


def _without(model: Any, keys: set[str]) -> Any:
    """A model entry (and its deployments) without `keys`, so that the top-level value set by a flag applies."""
    if not isinstance(model, dict):
        return model
    m = {k: v for k, v in model.items() if k not in keys}
    if isinstance(m.get("deployments"), list):
        m["deployments"] = [{k: v for k, v in d.items() if k not in keys} if isinstance(d, dict) else d
                            for d in m["deployments"]]
    return m


def check_engines(cfg: GatewayConfig) -> None:
    """Every embedded engine's args against its model (its config is read, its weights are not): what an engine
    would refuse while loading is refused now, before anything loads, naming the model."""
    from kvgate.engine.config import check_engine_args

    for m in cfg.models:
        local = [d for d in m.deployments if not d.is_remote]
        for j, d in enumerate(local):
            try:
                if cfg.api_server_count > 1 and d.engine_args.get("engine_core_process") is False:
                    raise ValueError(f"engine_core_process false cannot serve api_server_count "
                                     f"{cfg.api_server_count} processes: its engine core must run in a process of "
                                     f"its own")
                check_engine_args(EngineArgs(**{**d.engine_args, "served_model_name": m.name}))
            except (ValueError, OSError, ImportError) as e:
                where = f"model {m.name!r}" + (f" (embedded deployment {j})" if len(local) > 1 else "")
                raise ConfigError(": ".join(p for p in (cfg.source, where, str(e)) if p)) from None
