"""config.yaml for `kvgate serve --config`: the parsed shape, flag overrides, and invalid files refused with the
key path and the reason."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from kvgate.gateway.cli import build_parser, main, serve_overrides
from kvgate.gateway.config import ConfigError, load_config

TWO_MODELS = """
block_size: 32            # a default for every embedded engine
max_num_seqs: 8
port: 9000
api_key: sekret
models:
  - name: small
    model: small-model    # relative to this file
    block_size: 64
  - name: big
    deployments:
      - url: http://127.0.0.1:9001/v1
        api_key: up-key
        timeout: 30
        weight: 2
      - model: big.gguf
        max_batch_size: 4
router:
  strategy: least_loaded
  fallbacks: {big: [small]}
  num_retries: 1
routes:
  - name: auto
    function: mypackage.routing:handle_request
    strategy: latency
"""


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> str:
    (tmp_path / "small-model").mkdir(exist_ok=True)
    (tmp_path / "small-model" / "config.json").write_text("{}")
    (tmp_path / "big.gguf").write_bytes(b"GGUF")
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_two_model_file_parses_into_the_router_shape(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, TWO_MODELS))
    assert (cfg.port, cfg.host, cfg.api_key, cfg.max_queue_len) == (9000, "127.0.0.1", "sekret", 1024)
    small, big = cfg.models
    assert small.name == "small" and len(small.deployments) == 1 and not small.deployments[0].is_remote
    assert small.deployments[0].engine_args == {"block_size": 64, "max_num_seqs": 8,
                                                "model": os.path.join(str(tmp_path), "small-model")}
    remote, local = big.deployments
    assert (remote.url, remote.api_key, remote.timeout, remote.weight) == ("http://127.0.0.1:9001/v1", "up-key",
                                                                           30.0, 2.0)
    assert remote.is_remote and remote.engine_args == {}
    assert local.engine_args == {"block_size": 32, "max_num_seqs": 4, "model": str(tmp_path / "big.gguf")}
    assert (cfg.router.strategy, cfg.router.fallbacks, cfg.router.num_retries) == ("least_loaded", {"big": ["small"]}, 1)
    assert [(r.name, r.function, r.strategy) for r in cfg.routes] == [
        ("auto", "mypackage.routing:handle_request", "latency")]


def test_product_brief_flat_keys_make_one_model(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "model: big.gguf\ntensor_parallel_size: 1\npipeline_parallel_size: 1\n"
                                      "block_size: 16\nenable_prefix_caching: false\nmax_num_seqs: 64\n"))
    (m,) = cfg.models
    assert m.name == "big" and cfg.routes == [] and cfg.router.strategy == "latency"
    assert m.deployments[0].engine_args == {"model": str(tmp_path / "big.gguf"), "tensor_parallel_size": 1,
                                            "pipeline_parallel_size": 1, "block_size": 16,
                                            "enable_prefix_caching": False, "max_num_seqs": 64}
    empty = load_config(write(tmp_path, "", "empty.yaml"))
    assert [m.name for m in empty.models] == ["SmolLM2-135M-Instruct"] and empty.port == 8000


def test_flags_override_the_file_only_when_given(tmp_path: Path) -> None:
    path = write(tmp_path, TWO_MODELS)
    args = build_parser().parse_args(["serve", "--config", path, "--port", "9100", "--block-size", "16",
                                      "--max-num-seqs", "2", "--no-enable-prefix-caching"])
    overrides = serve_overrides(args)
    assert overrides == {"port": 9100, "block_size": 16, "max_num_seqs": 2, "enable_prefix_caching": False}
    cfg = load_config(path, overrides)
    assert cfg.port == 9100 and cfg.api_key == "sekret"  # given flag wins; the file keeps the rest
    for d in (cfg.models[0].deployments[0], cfg.models[1].deployments[1]):  # over every level of the file
        assert d.engine_args["block_size"] == 16 and d.engine_args["max_num_seqs"] == 2
        assert d.engine_args["enable_prefix_caching"] is False and "max_batch_size" not in d.engine_args
    assert serve_overrides(build_parser().parse_args(["serve", "--config", path])) == {}
    single = load_config(write(tmp_path, "model: big.gguf\nport: 9000\n", "one.yaml"),
                         {"model": str(tmp_path / "small-model"), "served_model_name": "mine"})
    assert single.models[0].name == "mine" and single.port == 9000
    assert single.models[0].deployments[0].engine_args["model"] == str(tmp_path / "small-model")
    with pytest.raises(ConfigError, match="--model: .* has a models: list"):
        load_config(path, {"model": str(tmp_path / "small-model")})
    with pytest.raises(ConfigError, match="^--block-size: must be one of 16, 32, 64, got 7$"):
        load_config(path, {"block_size": 7})


@pytest.mark.parametrize("text, message", [
    ("models:\n  - name: a\n    model: small-model\n  - name: b\n    model: small-model\n    block_size: 7\n",
     "config.yaml: models[1].block_size: must be one of 16, 32, 64, got 7"),
    ("max_num_seq: 8\n", "config.yaml: unknown key 'max_num_seq' (did you mean 'max_num_seqs'?)"),
    ("models:\n  - name: a\n    model: small-model\n    max_num_seqs: many\n",
     "config.yaml: models[0].max_num_seqs: must be an integer, got 'many'"),
    ("port: 0\n", "config.yaml: port: must be in [1, 65535], got 0"),
    ("gpu_memory_utilization: 1.5\n", "config.yaml: gpu_memory_utilization: must be in (0, 1], got 1.5"),
    ("enable_prefix_caching: 1\n", "config.yaml: enable_prefix_caching: must be true or false, got 1"),
    ("models:\n  - model: small-model\n", "config.yaml: models[0].name: each model needs a name"),
    ("models:\n  - name: a\n    model: small-model\n  - name: a\n    model: big.gguf\n",
     "config.yaml: models[1].name: duplicate name 'a' (also at index 0)"),
    ("models:\n  - name: a\n", "config.yaml: models[0]: needs model: (a local HF directory or .gguf file"),
    ("models:\n  - name: a\n    deployments:\n      - url: http://h/v1\n        model: big.gguf\n",
     "config.yaml: models[0].deployments[0]: give either url: or model:, not both"),
    ("models:\n  - name: a\n    deployments:\n      - url: h:9001\n",
     "config.yaml: models[0].deployments[0].url: must be an http:// or https:// URL, got 'h:9001'"),
    ("models:\n  - name: a\n    deployments:\n      - url: http://h/v1\n        block_size: 32\n",
     "config.yaml: models[0].deployments[0].block_size: engine args apply to embedded"),
    ("models:\n  - name: a\n    served_model_name: b\n    model: small-model\n",
     "config.yaml: models[0]: unknown key 'served_model_name' (name each entry of models: with name: instead)"),
    ("models:\n  - name: a\n    model: nowhere\n", "config.yaml: models[0].model: no model at 'nowhere'"),
    ("model: small-model\nmodels:\n  - name: a\n    model: big.gguf\n",
     "config.yaml: model: give either a top-level model or a models: list"),
    ("models: []\n", "config.yaml: models: must be a non-empty list (…), got an empty list"),
    ("router:\n  strategy: fastest\n", "config.yaml: router.strategy: must be one of latency, least_loaded, "
                                       "round_robin, weighted, prefix_affinity, got 'fastest'"),
    ("router:\n  fallbacks: {SmolLM2-135M-Instruct: [other]}\n",
     "config.yaml: router.fallbacks.SmolLM2-135M-Instruct[0]: unknown model 'other'"),
    ("routes:\n  - name: auto\n    function: not a function\n",
     "config.yaml: routes[0].function: must look like 'package.module:function'"),
    ("routes:\n  - name: SmolLM2-135M-Instruct\n", "config.yaml: routes[0].name: … already a model's name"),
    ("block_size: 16\nblock_size: 32\n", "config.yaml: line 2, column 1: invalid YAML: duplicate key 'block_size'"),
    ("models:\n  - name: a\n   model: x\n", "config.yaml: line 3, column 4: invalid YAML"),
    ("- a\n- b\n", "config.yaml: must be a mapping (of top-level keys), got a list"),
])
def test_invalid_files_name_the_key_and_the_reason(tmp_path: Path, text: str, message: str) -> None:
    """`message` is the start of the expected error; "…" stands for any text."""
    write(tmp_path, text)
    cwd = os.getcwd()
    os.chdir(tmp_path)  # messages name the file as the user gave it
    try:
        with pytest.raises(ConfigError) as err:
            load_config("config.yaml")
    finally:
        os.chdir(cwd)
    assert re.match(".*".join(map(re.escape, message.split("…"))), str(err.value)), str(err.value)


def test_missing_file_and_unimportable_route_function_are_refused_by_serve(tmp_path: Path, capsys) -> None:
    with pytest.raises(ConfigError, match="config file not found: .*nope.yaml"):
        load_config(str(tmp_path / "nope.yaml"))
    assert main(["serve", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "kvgate: error: config file not found" in capsys.readouterr().err
    bad_route = "models:\n  - name: big\n    deployments:\n      - url: http://127.0.0.1:9/v1\n" \
                "routes:\n  - name: auto\n    function: no_such_module_kvgate:pick\n"
    assert main(["serve", "--config", write(tmp_path, bad_route)]) == 2  # before anything loads or listens
    err = capsys.readouterr().err
    assert "route function 'no_such_module_kvgate:pick': cannot import 'no_such_module_kvgate'" in err
