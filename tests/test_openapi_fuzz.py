"""Schemathesis, a property-based API fuzzer, against /openapi.json of a real gateway (uvicorn on loopback): valid
and schema-violating requests to every operation, a bounded number per operation for CI, and not one 5xx. The
generate endpoints are in the document (generated from the request models the backends validate with), so the
fuzzer reaches them: the last test checks that it did."""
from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any, Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from mock_upstream import serving
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from tiny_models import build_tiny_embedding_model

from kvgate.engine.async_engine import AsyncEngineArgs, AsyncLLMEngine
from kvgate.gateway.app import create_app
from kvgate.gateway.router import ModelRouter

EXAMPLES = 25  # per operation and mode (valid, schema-violating): enough to cross every field's type, few enough for CI
GENERATE = {"/v1/chat/completions": "gen", "/v1/completions": "gen", "/v1/embeddings": "emb"}
SENT: Counter[str] = Counter()  # requests the fuzzer sent, by path
STATUSES: Counter[tuple[str, int]] = Counter()


@pytest.fixture(scope="module")
def api(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A gateway with a generative model ("gen": 64 tokens of context keep random max_tokens cheap) and an
    embedding model ("emb")."""
    emb = build_tiny_embedding_model(tmp_path_factory.mktemp("fuzz") / "emb", "llama", seed=7)
    engines = {"gen": AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=tiny_llama, max_model_len=64,
                                                                      max_num_seqs=4, num_gpu_blocks_override=32)),
               "emb": AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=emb, max_model_len=64,
                                                                      num_gpu_blocks_override=16))}
    try:
        router = ModelRouter()
        for name, engine in engines.items():
            asyncio.run(engine.wait_until_ready(timeout=60))
            router.add_model(name, engine)
        with serving(create_app(router, max_body_bytes=1 << 20)) as base:
            yield base
    finally:
        for engine in engines.values():
            engine.shutdown()


def fuzz_operation(api: str, operation: Any, mode: GenerationMode, failures: list[str]) -> None:
    """EXAMPLES cases of `mode` for one operation (derandomized: the same cases on every run), each sent to the
    server and checked for a 5xx; failures are collected, not raised (no shrinking: CI time)."""
    path = operation.path

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        if path in GENERATE and isinstance(case.body, dict) and isinstance(case.body.get("model", ""), str):
            case.body["model"] = GENERATE[path]  # a served model, so that requests get past routing into the models
        response = case.call(base_url=api, timeout=60)
        SENT[path] += 1
        STATUSES[(path, response.status_code)] += 1
        try:
            case.validate_response(response, checks=[not_a_server_error])
        except Exception as e:  # noqa: BLE001 - reported together at the end
            failures.append(f"{operation.label} {mode.value}: {e}\n{case.as_curl_command()}")

    try:
        run()
    except Unsatisfiable:  # nothing to violate (an operation without parameters or body): no negative cases
        assert mode == GenerationMode.NEGATIVE, operation.label


def test_no_request_gets_a_server_error(api: str) -> None:
    """The schema comes from the running server's /openapi.json. (Schemathesis's pytest plugin is not used: its
    fixture-based loader reads a pytest internal that pytest 9 removed.)"""
    schema = schemathesis.openapi.from_url(f"{api}/openapi.json")
    failures: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            fuzz_operation(api, operation, mode, failures)
    assert not failures, "\n\n".join(failures[:5])


def test_the_fuzzer_reached_the_generate_endpoints() -> None:
    for path in GENERATE:
        assert SENT[path] >= EXAMPLES, (SENT, STATUSES)
        assert any(p == path and status == 200 for p, status in STATUSES), STATUSES  # some got through
