"""config.yaml for `kvgate serve --config`: the models (embedded engines or remote upstreams), the router and its
routes, and the server options. The file is checked up front: an invalid one is refused with the key path and the
reason. Flags given on the command line override the file.

Engine args (EngineArgs' names) may sit at the top level, where they are defaults for every embedded engine, on a
model entry with `model:`, or on an embedded deployment; the innermost one wins, and a flag wins over all of them.
Relative model paths are relative to the config file's folder."""
from __future__ import annotations

import difflib
import os
import re
import typing
from dataclasses import dataclass, field, fields
from typing import Any, NoReturn
from urllib.parse import urlparse

import yaml

from kvgate.engine.config import _DTYPES, LOAD_FORMATS, EngineArgs
from kvgate.engine.models.gguf import DEFAULT_MODEL_NAME

STRATEGIES = ("latency", "least_loaded", "round_robin", "weighted", "prefix_affinity")


class ConfigError(ValueError):
    """An invalid config file or flag; the message names the file, the key path and the reason."""


@dataclass
class DeploymentSpec:
    """One replica of a model: a remote OpenAI-compatible server (url) or an embedded engine (engine_args)."""
    url: str | None = None  # e.g. http://10.0.0.5:8000/v1
    api_key: str | None = None  # sent to the remote upstream as a Bearer key
    timeout: float | None = None  # seconds per request
    weight: float = 1.0  # for the weighted strategy
    upstream_model: str | None = None  # the model id the remote server knows (default: the model's name)
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
    strategy: str = "latency"  # the default for every model
    fallbacks: dict[str, list[str]] = field(default_factory=dict)  # model -> models to try when it is down
    num_retries: int = 2  # other deployments tried when one fails before the first byte
    cooldown_time: float = 30.0  # seconds a failed deployment is kept out before a probe
    health_check_interval: float = 10.0  # seconds between health checks of remote deployments
    timeout: float | None = None  # default per-request timeout (seconds) for remote deployments


@dataclass
class RouteSpec:
    name: str  # a model id clients may send ("auto") that goes through this route
    function: str | None = None  # "package.module:function" returning a model name; None: the strategy picks
    strategy: str | None = None


@dataclass
class GatewayConfig:
    models: list[ModelSpec]
    router: RouterSpec = field(default_factory=RouterSpec)
    routes: list[RouteSpec] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # Bearer key clients must send
    max_body_bytes: int = 8 << 20
    max_queue_len: int = 1024  # waiting requests per model before 429
    source: str = ""  # the file it came from ("" without one)


def _arg_types(cls: type) -> dict[str, tuple[type, bool]]:
    """field name -> (base type, whether None is allowed), from the dataclass's type hints."""
    hints, out = typing.get_type_hints(cls), {}
    for f in fields(cls):
        args = typing.get_args(hints[f.name])
        out[f.name] = (next(a for a in args if a is not type(None)) if args else hints[f.name], type(None) in args)
    return out


ENGINE_TYPES = _arg_types(EngineArgs)
SERVE_TYPES = {k: v for k, v in _arg_types(GatewayConfig).items() if k not in ("models", "router", "routes", "source")}
ROUTER_TYPES = {k: v for k, v in _arg_types(RouterSpec).items() if k != "fallbacks"}
DEPLOYMENT_TYPES = {k: v for k, v in _arg_types(DeploymentSpec).items() if k != "engine_args"}
ALIASES = {"max_batch_size": "max_num_seqs"}  # alias -> the name it stands for

TOP_KEYS = {*ENGINE_TYPES, *SERVE_TYPES, "models", "router", "routes"}
MODEL_KEYS = {*ENGINE_TYPES, "name", "deployments", "strategy"} - {"served_model_name"}
DEPLOYMENT_KEYS = {*ENGINE_TYPES, *DEPLOYMENT_TYPES} - {"served_model_name"}
ROUTER_KEYS = {*ROUTER_TYPES, "fallbacks"}
ROUTE_KEYS = {"name", "function", "strategy"}
HINTS = {"served_model_name": "name each entry of models: with name: instead"}

CHOICES: dict[str, tuple] = {"block_size": (16, 32, 64), "load_format": LOAD_FORMATS, "dtype": ("auto", *_DTYPES),
                             "kv_cache_dtype": ("auto", *_DTYPES), "strategy": STRATEGIES}
# name -> (lowest, highest, whether the lowest value itself is refused)
BOUNDS: dict[str, tuple[float, float | None, bool]] = {
    "max_num_seqs": (1, None, False), "max_batch_size": (1, None, False), "max_num_batched_tokens": (1, None, False),
    "max_model_len": (2, None, False), "kv_cache_memory_bytes": (1, None, False),
    "num_gpu_blocks_override": (1, None, False), "tensor_parallel_size": (1, None, False),
    "pipeline_parallel_size": (1, None, False), "scheduler_delay": (0, None, False),
    "priority_aging_rate": (0, None, False), "max_logprobs": (0, None, False), "seed": (0, None, False),
    "gpu_memory_utilization": (0, 1, True), "port": (1, 65535, False), "max_body_bytes": (1, None, False),
    "max_queue_len": (0, None, False), "num_retries": (0, None, False), "cooldown_time": (0, None, False),
    "health_check_interval": (0, None, True), "timeout": (0, None, True), "weight": (0, None, True),
}
_FUNCTION = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _kind(v: Any) -> str:
    if isinstance(v, (dict, list)):
        return ("an empty " if not v else "a ") + ("mapping" if isinstance(v, dict) else "list")
    return "null" if v is None else repr(v)


def _join(path: str, key: str | int) -> str:
    return f"{path}[{key}]" if isinstance(key, int) else (f"{path}.{key}" if path else key)


class _Checker:
    def __init__(self, source: str, base_dir: str) -> None:
        self.source, self.base_dir = source, base_dir

    def fail(self, path: str, reason: str) -> NoReturn:
        raise ConfigError(": ".join(p for p in (self.source, path, reason) if p))

    def mapping(self, v: Any, path: str, what: str) -> dict:
        if not isinstance(v, dict):
            self.fail(path, f"must be a mapping ({what}), got {_kind(v)}")
        return v

    def items(self, v: Any, path: str, what: str, empty_ok: bool = False) -> list:
        if not isinstance(v, list) or not (v or empty_ok):
            self.fail(path, f"must be a {'' if empty_ok else 'non-empty '}list ({what}), got {_kind(v)}")
        return v

    def keys(self, d: dict, allowed: set[str], path: str) -> None:
        for k in d:
            if not isinstance(k, str) or k not in allowed:
                close = difflib.get_close_matches(str(k), sorted(allowed), n=1)
                hint = HINTS.get(k) or (f"did you mean {close[0]!r}?" if close else None)
                self.fail(path, f"unknown key {k!r}" + (f" ({hint})" if hint else ""))

    def value(self, v: Any, typ: type, optional: bool, path: str, key: str) -> Any:
        if v is None and optional:
            return None
        if typ is bool:
            ok = isinstance(v, bool)
        else:  # YAML's true/false are bools, never numbers here
            ok = isinstance(v, (int, float) if typ is float else typ) and not isinstance(v, bool)
        if not ok:
            self.fail(path, f"must be {_TYPE_NAMES[typ]}{' or null' if optional else ''}, got {_kind(v)}")
        v = float(v) if typ is float else v
        if key in CHOICES and v not in CHOICES[key]:
            self.fail(path, f"must be one of {', '.join(map(str, CHOICES[key]))}, got {v!r}")
        if key in BOUNDS:
            lo, hi, open_lo = BOUNDS[key]
            if v < lo or (open_lo and v == lo) or (hi is not None and v > hi):
                rule = (f"in {'(' if open_lo else '['}{lo}, {hi}]" if hi is not None else
                        f"{'>' if open_lo else '>='} {lo}")
                self.fail(path, f"must be {rule}, got {v!r}")
        if isinstance(v, str) and key in ("model", "tokenizer"):
            return self.model_path(v, path, key)
        return v

    def model_path(self, v: str, path: str, key: str) -> str:
        if key == "model" and v == DEFAULT_MODEL_NAME:
            return v
        p = os.path.join(self.base_dir, os.path.expanduser(v))
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
            if k in ENGINE_TYPES and k not in exclude:
                name = ALIASES.get(k, k)
                if name in out:
                    self.fail(_join(path, k), f"{k} is an alias of {name}: give one of them")
                out[name] = self.value(v, *ENGINE_TYPES[k], _join(path, k), k)
        return out

    def typed(self, d: dict, types: dict[str, tuple[type, bool]], path: str) -> dict[str, Any]:
        return {k: self.value(d[k], *types[k], _join(path, k), k) for k in types if k in d}

    # ---- sections -------------------------------------------------------------------------------------------------
    def models(self, raw: Any, top_engine: dict[str, Any]) -> list[ModelSpec]:
        models: list[ModelSpec] = []
        seen: dict[str, int] = {}
        for i, m in enumerate(self.items(raw, "models", "each with a name and a model or deployments")):
            p = f"models[{i}]"
            self.keys(self.mapping(m, p, "name, and model or deployments"), MODEL_KEYS, p)
            name = self.name(m, p, "model", seen, i)
            strategy = self.typed(m, {"strategy": (str, True)}, p).get("strategy")
            own = self.engine_args(m, p)
            if ("model" in m) == ("deployments" in m):
                self.fail(p, "give either model: or deployments:, not both" if "model" in m else
                          "needs model: (a local HF directory or .gguf file, for an embedded engine) or deployments: "
                          "(a list of replicas)")
            if "model" in m:
                deployments = [DeploymentSpec(engine_args={**top_engine, **own})]
            else:
                if own:
                    k = next(k for k in m if k in ENGINE_TYPES)
                    self.fail(_join(p, k), "a model with deployments: takes engine args inside each deployment")
                deployments = self.deployments(m["deployments"], _join(p, "deployments"), top_engine)
            models.append(ModelSpec(name, deployments, strategy))
        return models

    def name(self, d: dict, path: str, what: str, seen: dict[str, int], index: int) -> str:
        name = d.get("name")
        if not isinstance(name, str) or not name.strip():
            self.fail(_join(path, "name"), f"each {what} needs a name (a non-empty string), got {_kind(name)}")
        if name in seen:
            self.fail(_join(path, "name"), f"duplicate name {name!r} (also at index {seen[name]})")
        seen[name] = index
        return name

    def deployments(self, raw: Any, path: str, top_engine: dict[str, Any]) -> list[DeploymentSpec]:
        out = []
        for j, d in enumerate(self.items(raw, path, "replicas, each with url: or model:")):
            p = f"{path}[{j}]"
            self.keys(self.mapping(d, p, "url: or model:, with options"), DEPLOYMENT_KEYS, p)
            if ("url" in d) == ("model" in d):
                self.fail(p, "give either url: or model:, not both" if "url" in d else
                          "needs url: (a remote OpenAI-compatible server) or model: (an embedded engine)")
            opts = self.typed(d, DEPLOYMENT_TYPES, p)
            if "url" in d:
                u = urlparse(opts["url"])
                if u.scheme not in ("http", "https") or not u.netloc:
                    self.fail(_join(p, "url"), f"must be an http:// or https:// URL, got {opts['url']!r}")
                k = next((k for k in d if k in ENGINE_TYPES), None)
                if k is not None:
                    self.fail(_join(p, k), "engine args apply to embedded (model:) deployments, not to a url: one")
                out.append(DeploymentSpec(**opts))
            else:
                k = next((k for k in ("api_key", "upstream_model") if k in d), None)
                if k is not None:
                    self.fail(_join(p, k), "only a url: deployment takes this key")
                out.append(DeploymentSpec(**opts, engine_args={**top_engine, **self.engine_args(d, p)}))
        return out

    def router(self, raw: Any, names: list[str]) -> RouterSpec:
        self.keys(self.mapping(raw, "router", "strategy, fallbacks, ..."), ROUTER_KEYS, "router")
        spec = RouterSpec(**self.typed(raw, ROUTER_TYPES, "router"))
        fallbacks = self.mapping(raw.get("fallbacks", {}), "router.fallbacks", "model: [other models]")
        for model, others in fallbacks.items():
            p = _join("router.fallbacks", str(model))
            self.known(model, names, p)
            others = [others] if isinstance(others, str) else others
            if not isinstance(others, list) or not others:
                self.fail(p, f"must be a list of model names, got {_kind(others)}")
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
            opts = self.typed(r, {"function": (str, True), "strategy": (str, True)}, p)
            if opts.get("function") is not None and not _FUNCTION.match(opts["function"]):
                self.fail(_join(p, "function"), f"must look like 'package.module:function', got {opts['function']!r}")
            out.append(RouteSpec(name, **opts))
        return out


def parse_config(raw: Any, source: str = "", base_dir: str = "") -> GatewayConfig:
    """A GatewayConfig from the parsed YAML (a dict); ConfigError names the key path and the reason."""
    c = _Checker(source, base_dir)
    raw = {} if raw is None else c.mapping(raw, "", "of top-level keys")
    c.keys(raw, TOP_KEYS, "")
    serve = c.typed(raw, SERVE_TYPES, "")
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
        engine_args = {**top_engine, **({"model": model} if model is not None else {})}
        models = [ModelSpec(name, [DeploymentSpec(engine_args=engine_args)])]
    names = [m.name for m in models]
    router = c.router(raw.get("router", {}), names)
    routes = c.routes(raw["routes"], names) if "routes" in raw else []
    return GatewayConfig(models, router, routes, **serve, source=source)


class _Loader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (plain YAML keeps the last silently)."""


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> dict:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if not isinstance(key, typing.Hashable):
            continue  # construct_mapping reports it
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def read_yaml(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.load(f, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read the config file {path}: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        raise ConfigError(f"{path}: {where}invalid YAML: {getattr(e, 'problem', None) or e}") from None


def load_config(path: str | None, overrides: dict[str, Any] | None = None) -> GatewayConfig:
    """The config from `path` (None: no file, the default model) with `overrides` (flags the user gave, by
    option name: block_size, port, ...) applied on top: a flag wins over every level of the file."""
    raw = read_yaml(path) if path is not None else {}
    if overrides:
        if not isinstance(raw, dict):  # let parse_config report the shape
            return parse_config(raw, path or "")
        raw = apply_overrides(raw, overrides, path or "the config")
    return parse_config(raw, path or "", os.path.dirname(path) if path else "")


def apply_overrides(raw: dict, overrides: dict[str, Any], source: str) -> dict:
    flags = _Checker("", "")
    raw = dict(raw)
    for key, value in overrides.items():
        flag = "--" + key.replace("_", "-")
        if key not in ENGINE_TYPES and key not in SERVE_TYPES:
            raise ConfigError(f"{flag}: not a config option")
        value = flags.value(value, *(ENGINE_TYPES.get(key) or SERVE_TYPES[key]), flag, key)
        if key in ("model", "tokenizer") and value != DEFAULT_MODEL_NAME:
            value = os.path.abspath(value)  # relative to the current directory, not to the file
        if key in ("model", "served_model_name") and "models" in raw:
            raise ConfigError(f"{flag}: {source} has a models: list; set {key} per model in the file instead")
        drop = {key, *(a for a, n in ALIASES.items() if n == key), ALIASES.get(key, key)}
        for k in drop:
            raw.pop(k, None)
        raw[key] = value
        if key in ENGINE_TYPES and isinstance(raw.get("models"), list):
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
