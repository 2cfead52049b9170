"""A hostile client against a real gateway (uvicorn on loopback): invalid Unicode and UTF-8, deep nesting, bad types
and ranges, huge prompts, lying headers, wrong methods. Every answer is a 4xx in OpenAI's error shape (never a
5xx), the server stays responsive, the engines keep serving and no KV block is left behind. (Several prompts in
one request: tests/test_completions_prompts.py; the byte bound and off-loop tokenization:
tests/test_prompt_tokenizer.py.)"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import Any, Iterator

import httpx
import openai
import pytest
from mock_upstream import serving_engines
from tiny_models import build_tiny_embedding_model

from kvgate.engine.async_engine import AsyncEngineArgs, AsyncLLMEngine

GEN, EMB = "gen", "emb"
FIVE_MB = "hello world " * 440_000  # 5.28 MB of text
CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def gateway(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict]]:
    """One gateway: a generative model (4 seats) and an embedding model; body limit 8 MiB (the default)."""
    emb = build_tiny_embedding_model(tmp_path_factory.mktemp("hostile") / "emb", "llama", seed=3)
    engines = {GEN: AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=tiny_llama, max_num_seqs=4,
                                                                    num_gpu_blocks_override=64)),
               EMB: AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=emb, num_gpu_blocks_override=32))}
    with serving_engines(engines) as base:
        yield base, engines


def send(base: str, path: str, body: Any, headers: dict[str, str] | None = None, method: str = "POST"
         ) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.request(method, base + path, content=content, timeout=60,
                         headers={"content-type": "application/json", **(headers or {})})


def assert_refused(r: httpx.Response, words: str, status: int = 400) -> dict:
    """An OpenAI-shaped error of `status` whose message holds `words`."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and words in err["message"], err
    return err


def in_core(engine: AsyncLLMEngine, fn: Any) -> Any:
    async def main() -> Any:
        return await engine.call(fn)
    return asyncio.run(main())


def idle(core) -> tuple[list[str], bool]:
    return list(core.requests), core.block_manager.num_free_blocks == core.block_manager.num_blocks


# ---- encodings -------------------------------------------------------------------------------------------------------
LONE_SURROGATE = b'"\\ud800x"'


@pytest.mark.parametrize("path, body", [
    (CHAT, b'{"model": "gen", "messages": [{"role": "user", "content": %s}]}'),
    (COMPLETIONS, b'{"model": "gen", "prompt": %s}'),
    (COMPLETIONS, b'{"model": "gen", "prompt": ["ok", %s]}'),
    (EMBEDDINGS, b'{"model": "emb", "input": %s}'),
    ("/tokenize", b'{"model": "gen", "prompt": %s}'),
    ("/tokenize", b'{"model": "gen", "messages": [{"role": "user", "content": %s}]}'),
    ("/detokenize", b'{"model": "gen", "tokens": [1], "x": %s}'),
])
@pytest.mark.parametrize("bad", [LONE_SURROGATE, b'"\\udc00"', b'"a\\ud800\\u0041"'])
def test_a_lone_surrogate_is_refused_when_the_json_is_decoded(gateway, path: str, body: bytes, bad: bytes) -> None:
    assert_refused(send(gateway[0], path, body % bad), "lone UTF-16 surrogate")


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, EMBEDDINGS, "/tokenize"])
@pytest.mark.parametrize("raw, offset", [(b"\xff", 28), (b"\xc0\xaf", 28), (b"\xed\xa0\x80", 28), (b"ok\x80", 30)])
def test_invalid_utf8_bytes_are_refused_with_their_offset(gateway, path: str, raw: bytes, offset: int) -> None:
    body = b'{"model": "gen", "prompt": "' + raw + b'"}'
    assert_refused(send(gateway[0], path, body), f"the body is not valid UTF-8: byte {offset}")


def test_other_encodings_and_non_objects(gateway) -> None:
    base = gateway[0]
    ok = {"model": GEN, "prompt": "a\u0000b \U0001F600 \ud83d\ude00", "max_tokens": 2}  # NUL, emoji, a valid pair
    assert send(base, COMPLETIONS, ok).status_code == 200
    assert_refused(send(base, COMPLETIONS, b"\xef\xbb\xbf" + json.dumps(ok).encode()), "byte order mark")
    assert_refused(send(base, COMPLETIONS, json.dumps(ok).encode("utf-16")), "not valid UTF-8")
    for raw, words in ((b"", "the body is empty"), (b"[]", "must be a JSON object, got an array"),
                       (b'"x"', "got a string"), (b"null", "got null"), (b"{not json", "malformed JSON body"),
                       (b'{"a": NaN}', "malformed JSON body"), (b'{"a": 1e999}', "malformed JSON body")):
        for path in (CHAT, "/tokenize"):
            assert_refused(send(base, path, raw), words)


# ---- nesting ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, EMBEDDINGS, "/tokenize", "/detokenize"])
def test_deep_nesting_is_refused_with_the_limit(gateway, path: str) -> None:
    base = gateway[0]
    assert_refused(send(base, path, b"[" * 100_000), "more than 1024 levels deep")
    assert_refused(send(base, path, b'{"model": "gen", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"), "1024 levels")
    deep_ok = b'{"model": "gen", "metadata": ' + b"[" * 1000 + b"]" * 1000 + b"}"  # parses; then a field error
    assert send(base, path, deep_ok).status_code == 400


# ---- types and ranges ------------------------------------------------------------------------------------------------
BAD_FIELDS = [
    ({"stream": "yes"}, "invalid stream: Input should be a valid boolean, got \"yes\""),
    ({"stream": 1}, "invalid stream: Input should be a valid boolean, got 1"),
    ({"echo": "true"}, "invalid echo: Input should be a valid boolean"),
    ({"max_tokens": "5"}, "invalid max_tokens: Input should be a valid integer, got \"5\""),
    ({"max_tokens": 5.5}, "invalid max_tokens: Input should be a valid integer, got 5.5"),
    ({"max_tokens": True}, "invalid max_tokens: Input should be a valid integer, got true"),
    ({"max_tokens": 10 ** 30}, "maximum context length is 512 tokens"),  # orjson: 1e30, a float
    ({"max_tokens": 0}, "max_tokens must be at least 1, got 0"),
    ({"max_tokens": 100_000}, "maximum context length is 512 tokens"),
    ({"n": "2"}, "invalid n: Input should be a valid integer"),
    ({"n": 0}, "n must be an integer >= 1, got 0"),
    ({"n": 1000}, "n=1000 samples cannot run together: max_num_seqs is 4"),
    ({"temperature": "0.5"}, "invalid temperature: Input should be a valid number, got \"0.5\""),
    ({"temperature": False}, "invalid temperature: Input should be a valid number"),
    ({"temperature": -1}, "temperature must be >= 0, got -1"),
    ({"top_p": 2}, "top_p must be in (0, 1], got 2"),
    ({"top_k": 2.5}, "invalid top_k: Input should be a valid integer"),
    ({"logprobs": 100}, "logprobs must be in [0, 20], got 100"),
    ({"seed": "1"}, "invalid seed: Input should be a valid integer"),
    ({"stop": [1]}, "stop must be a string or a list of strings"),
    ({"stop": ["x"] * 65}, "stop has 65 strings, more than the limit of 64"),
    ({"stop_token_ids": [-1]}, "stop_token_ids must be non-negative integers"),
    ({"stream_options": {"include_usage": "yes"}}, "invalid stream_options.include_usage: Input should be a valid"),
    ({"priority": "50"}, "priority must be an integer in [0, 100], got a string"),
    ({"priority": 50.5}, "priority must be an integer in [0, 100], got a number"),
    ({"priority": 500.0}, "priority must be in [0, 100]"),
    ({"priority": 101}, "priority must be in [0, 100]"),
    ({"model": 5}, "model must be a string (a model's id), got a number"),
    ({"model": ["gen"]}, "model must be a string"),
    ({"prompt": []}, "prompt must not be empty"),
    ({"prompt": [[]]}, "prompt is empty: every prompt needs at least one token"),
    ({"prompt": ""}, "prompt is empty"),
    ({"prompt": ["a", ""]}, "prompt[1] is empty"),
    ({"prompt": [1, "a"]}, "prompt must be a string, a list of strings, a list of token ids or a list of lists"),
    ({"prompt": [True, False]}, "prompt must be a string, a list of strings"),
    ({"prompt": [1.5]}, "prompt must be a string, a list of strings"),
    ({"prompt": {"a": 1}}, "prompt must be a string, a list of strings"),
    ({"prompt": [5, 100_000]}, "prompt has token id 100000, out of range: ids must be in [0, 512)"),
    ({"prompt": [[5], [-1]]}, "prompt[1] has token id -1, out of range"),
    ({"prompt": ["a"] * 2049}, "prompt has 2049 items, more than the limit of 2048 per request"),
    ({"prompt": [[5] * 600]}, "maximum context length is 512 tokens"),
    ({"prompt": [[5] * 10, [5] * 600]}, "(600 in the prompt[1], 2 in the completion)"),
    ({"best_of": 3}, "best_of is not supported"),
    ({"Str": 1}, "unsupported field 'Str'"),
    ({"stream_options": {"list[int]": 1}}, "unsupported field 'stream_options.list[int]'"),
]


@pytest.mark.parametrize("fields, words", BAD_FIELDS, ids=[json.dumps(f)[:40] for f, _ in BAD_FIELDS])
def test_bad_completion_fields_get_a_clear_400(gateway, fields: dict, words: str) -> None:
    assert_refused(send(gateway[0], COMPLETIONS, {"model": GEN, "prompt": "hi", "max_tokens": 2, **fields}), words)


@pytest.mark.parametrize("fields, words", [
    ({"messages": []}, "invalid messages: List should have at least 1 item"),
    ({"messages": "hi"}, "invalid messages: Input should be a valid list"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "invalid messages[0].role: Input should be 'system'"),
    ({"messages": [{"role": "user", "content": 5}]}, "invalid messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "invalid messages[0].content[0].type: Field"),
    ({"messages": [5]}, "invalid messages[0]"),
    ({"logprobs": "yes"}, "invalid logprobs: Input should be a valid boolean"),
    ({"max_completion_tokens": 1.5}, "invalid max_completion_tokens: Input should be a valid integer"),
    ({"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, "chat_template_kwargs may not set chat_template"),
    ({"chat_template_kwargs": {"x": 1}, "add_generation_prompt": "no"}, "invalid add_generation_prompt"),
])
def test_bad_chat_fields_get_a_clear_400(gateway, fields: dict, words: str) -> None:
    assert_refused(send(gateway[0], CHAT, {"model": GEN, "messages": MSG, "max_tokens": 2, **fields}), words)


@pytest.mark.parametrize("path, body, words", [
    (EMBEDDINGS, {"model": EMB, "input": [True]}, "input must be a string, a list of strings"),
    (EMBEDDINGS, {"model": EMB, "input": "x", "dimensions": "8"}, "invalid dimensions: Input should be a valid int"),
    (EMBEDDINGS, {"model": EMB, "input": "x", "normalize": "no"}, "invalid normalize"),
    ("/tokenize", {"model": GEN, "prompt": 5}, "invalid prompt: Input should be a valid string, got 5"),
    ("/tokenize", {"model": GEN, "prompt": "x", "add_special_tokens": "no"}, "invalid add_special_tokens"),
    ("/detokenize", {"model": GEN, "tokens": [1.5]}, "invalid tokens[0]: Input should be a valid integer"),
    ("/detokenize", {"model": GEN, "tokens": [10 ** 6]}, "token ids must be in [0, 512)"),
])
def test_bad_fields_elsewhere_get_a_clear_400(gateway, path: str, body: dict, words: str) -> None:
    assert_refused(send(gateway[0], path, body), words)


def test_what_the_openai_sdk_and_dify_send_still_works(gateway) -> None:
    base = gateway[0]
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(model=GEN, messages=MSG, max_tokens=3, temperature=0.7, top_p=1, seed=1,
                                       presence_penalty=0, frequency_penalty=0.5, stop=["\n\n"], user="u", n=1)
    assert r.choices[0].finish_reason in ("length", "stop")
    chunks = list(client.completions.create(model=GEN, prompt="hi", max_tokens=2, temperature=1, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 2
    dify = {"model": GEN, "stream": False, "messages": MSG, "temperature": 0.7, "top_p": 1.0, "top_k": 0,
            "presence_penalty": 0.0, "frequency_penalty": 0.0, "max_tokens": 3, "seed": 3, "stop": ["x"], "user": "u"}
    assert send(base, CHAT, dify).status_code == 200
    # JSON Schema's integers: 2.0 is one (a client that writes every number as a float still works)
    assert send(base, COMPLETIONS, {"model": GEN, "prompt": [5.0, 6.0], "max_tokens": 2.0, "n": 1.0}).status_code == 200
    del dify["messages"]
    assert send(base, COMPLETIONS, {**dify, "prompt": "hi", "stream": True,
                                    "stream_options": {"include_usage": True}}).status_code == 200


@pytest.mark.parametrize("fields", [{"top_k": 10 ** 30}, {"seed": 10 ** 30}, {"seed": -1},
                                    {"stop_token_ids": [10 ** 30]}, {"temperature": 1e308},
                                    {"stop": ["a" * 100_000]}, {"top_k": -1, "min_p": 1}])
def test_extreme_values_of_valid_types_are_served(gateway, fields: dict) -> None:
    """Values past int64 or float extremes reach the engine: they must not fail its step (a top_k of 10**30 once
    overflowed the sampler's tensor, failing the step and so the deployment for everyone)."""
    r = send(gateway[0], COMPLETIONS, {"model": GEN, "prompt": "hi", "max_tokens": 2, **fields})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop"), r.text
    assert httpx.get(gateway[0] + "/health").json() == {"status": "ok"}


# ---- headers and methods ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("header, value, words", [
    ("X-Priority", "abc", "x-priority must be an integer in [0, 100], got 'abc'"),
    ("X-Priority", "50.5", "x-priority must be an integer"),
    ("X-Priority", "", "x-priority must be an integer"),
    ("X-Priority", "9" * 30, "x-priority must be an integer"),
    ("X-Priority", "101", "priority must be in [0, 100]"),
    ("X-Max-Batch-Delay-Ms", "abc", "x-max-batch-delay-ms must be a number of milliseconds"),
    ("X-Max-Batch-Delay-Ms", "nan", "must be in [0, 60000] ms"),
    ("X-Max-Batch-Delay-Ms", "-1", "must be in [0, 60000] ms"),
])
def test_bad_headers_get_a_clear_400(gateway, header: str, value: str, words: str) -> None:
    for path, body in ((CHAT, {"model": GEN, "messages": MSG, "max_tokens": 1}),
                       (EMBEDDINGS, {"model": EMB, "input": "x"})):
        assert_refused(send(gateway[0], path, body, {header: value}), words)
    assert send(gateway[0], CHAT, {"model": GEN, "messages": MSG, "max_tokens": 1}, {"X-Priority": "+70"}
                ).status_code == 200


def raw_http(base: str, request: bytes, half_close: bool = False) -> bytes:
    """Send bytes on a fresh connection; what came back before the server closed it (or 1 s passed: a body that
    ends early leaves the server waiting for the rest, as HTTP/1.1 has it)."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=1) as s:
        s.sendall(request)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    return data


@pytest.mark.parametrize("path", [COMPLETIONS, "/tokenize"])
def test_content_length_lies_never_get_a_5xx(gateway, path: str) -> None:
    base = gateway[0]
    body = b'{"model": "gen", "prompt": "hi", "max_tokens": 1}'
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
    for length, half_close in (("5", False), ("1000", True), ("abc", False), ("-1", False), ("99999999999", False)):
        answer = raw_http(base, head + f"Content-Length: {length}\r\n\r\n".encode() + body, half_close)
        statuses = [line.split(b" ")[1] for line in answer.split(b"\r\n") if line.startswith(b"HTTP/1.1 ")]
        assert all(s.startswith(b"4") for s in statuses), (length, answer[:300])
        if length == "99999999999":
            assert b"over the limit of 8388608 bytes" in answer
    assert httpx.get(f"{base}/health", timeout=5).status_code == 200


@pytest.mark.parametrize("path", [COMPLETIONS, "/tokenize"])
def test_a_chunked_body_over_the_limit_is_413(gateway, path: str) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "gen", "prompt": "'
        for _ in range(9):
            yield b"x" * (1 << 20)
        yield b'"}'

    r = httpx.post(gateway[0] + path, content=chunks(), headers={"content-type": "application/json"}, timeout=60)
    assert_refused(r, "over the limit of 8388608 bytes", 413)


@pytest.mark.parametrize("method, path, allow", [
    ("GET", CHAT, "POST"), ("PUT", COMPLETIONS, "POST"), ("DELETE", EMBEDDINGS, "POST"), ("HEAD", CHAT, "POST"),
    ("PATCH", "/tokenize", "POST"), ("GET", "/detokenize", "POST"), ("POST", "/v1/models", "GET"),
    ("DELETE", "/v1/models/gen", "GET"), ("POST", "/health", "GET"), ("PUT", "/metrics", "GET"),
    ("POST", "/version", "GET"), ("POST", "/openapi.json", "GET"),
])
def test_every_405_carries_allow(gateway, method: str, path: str, allow: str) -> None:
    r = httpx.request(method, gateway[0] + path, timeout=10)
    assert r.status_code == 405 and allow in r.headers["allow"].split(", "), (r.headers, r.text)
    if method != "HEAD":
        assert_refused(r, f"{path} takes {r.headers['allow']}, not {method}", 405)


def test_openapi_documents_the_generate_endpoints(gateway) -> None:
    doc = httpx.get(gateway[0] + "/openapi.json").json()
    for path, model in ((CHAT, "ChatCompletionRequest"), (COMPLETIONS, "CompletionRequest"),
                        (EMBEDDINGS, "EmbeddingRequest")):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body["$ref"].endswith("/" + model)
    props = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert props["stream"]["type"] == "boolean" and props["n"]["type"] == "integer"
    assert "model" not in doc["components"]["schemas"]["CompletionRequest"].get("required", [])


# ---- sizes -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path, body, words", [
    (COMPLETIONS, {"model": GEN, "prompt": FIVE_MB}, "the prompt is 5280000 bytes"),
    (COMPLETIONS, {"model": GEN, "prompt": ["hi", FIVE_MB]}, "the prompt[1] is 5280000 bytes"),
    (CHAT, {"model": GEN, "messages": [{"role": "system", "content": "x"}, {"role": "user", "content": FIVE_MB}]},
     "the messages is 5280001 bytes"),
    (EMBEDDINGS, {"model": EMB, "input": FIVE_MB}, "the input is 5280000 bytes"),
    ("/tokenize", {"model": GEN, "prompt": FIVE_MB}, "the prompt is 5280000 bytes"),
])
def test_a_5mb_prompt_is_refused_by_its_size_while_the_server_stays_responsive(gateway, path: str, body: dict,
                                                                               words: str) -> None:
    base = gateway[0]
    answer: list[httpx.Response] = []
    big = threading.Thread(target=lambda: answer.append(send(base, path, body)))
    health: list[float] = []
    big.start()
    while big.is_alive() or len(health) < 3:
        t0 = time.perf_counter()
        assert httpx.get(f"{base}/health", timeout=5).status_code == 200
        health.append(time.perf_counter() - t0)
        time.sleep(0.02)
    big.join()
    assert max(health) < 1.0, health  # the bound: /health answers within 1 s meanwhile
    err = assert_refused(answer[0], words)
    assert "more than this model can take in its context" in err["message"] and "max_model_len 512" in err["message"]
    assert err["code"] == "context_length_exceeded"


def test_nothing_was_left_behind_and_every_engine_still_serves(gateway) -> None:
    base, engines = gateway
    for name, engine in engines.items():
        deadline = time.time() + 10
        while time.time() < deadline and in_core(engine, idle) != ([], True):
            time.sleep(0.05)
        assert engine.num_requests == 0 and in_core(engine, idle) == ([], True), name
    assert send(base, COMPLETIONS, {"model": GEN, "prompt": "hi", "max_tokens": 2}).status_code == 200
    assert send(base, EMBEDDINGS, {"model": EMB, "input": "hi"}).status_code == 200
