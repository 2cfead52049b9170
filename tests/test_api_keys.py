"""API keys with limits (requests and tokens per minute, requests in flight) and the access log, through a real
uvicorn server and the openai client; keys from config.yaml, an api_keys_file and the environment."""
from __future__ import annotations

import asyncio
import logging
import re
import threading
from pathlib import Path

import httpx
import openai
import pytest
from test_gateway import MODEL, running

from kvgate.engine.async_engine import AsyncEngineArgs, AsyncLLMEngine
from kvgate.gateway.auth import APIKey
from kvgate.gateway.config import ConfigError, load_config

KEYS = [APIKey("two-a-minute", "sk-rpm-2-secret", rpm=2), APIKey("one-at-a-time", "sk-conc-1-secret", max_concurrent=1),
        APIKey("few-tokens", "sk-tpm-secret", tpm=20), APIKey("free", "sk-free-secret"),
        APIKey("burst", "sk-burst-secret", rpm=3)]
SECRETS = [k.key for k in KEYS]
HI = [{"role": "user", "content": "Say hi to the secret garden"}]


@pytest.fixture(scope="module")
def base(tiny_model_dirs: dict[str, str]):
    """Prefills are held up to 30 s to batch them (scheduler_delay): a request that sends X-Max-Batch-Delay-Ms: 0
    releases the held ones, so a test can keep a request in flight as long as it needs to."""
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=tiny_model_dirs["llama"], max_num_seqs=8,
                                                             num_gpu_blocks_override=64, scheduler_delay=30.0))
    with running(engine, api_keys=KEYS) as url:
        yield url


def client(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0,
                         default_headers={"X-Max-Batch-Delay-Ms": "0"})


def chat(base: str, key: str, **kw) -> openai.types.chat.ChatCompletion:
    return client(base, key).chat.completions.create(model=MODEL, messages=HI, max_tokens=4, **kw)


def test_unknown_and_missing_keys_get_401(base: str) -> None:
    for key in ("sk-wrong", "sk-free-secreT", ""):
        with pytest.raises(openai.AuthenticationError) as e:
            chat(base, key or "-")
        assert e.value.body["code"] == "invalid_api_key"
    assert httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "x"}).status_code == 401
    assert httpx.get(f"{base}/health").status_code == 200  # no key needed outside /v1/ and tokenizing


def test_a_key_over_its_request_rate_gets_429_and_others_are_unaffected(base: str) -> None:
    chat(base, "sk-rpm-2-secret")
    chat(base, "sk-rpm-2-secret")
    with pytest.raises(openai.RateLimitError) as e:
        chat(base, "sk-rpm-2-secret")
    assert e.value.body["code"] == "rate_limit_exceeded"
    assert "over its limit of 2 requests per minute" in e.value.body["message"]
    retry = int(e.value.response.headers["retry-after"])
    assert 1 <= retry <= 30  # two a minute: the next one is at most 30 s away
    for _ in range(3):
        assert chat(base, "sk-free-secret").choices[0].message.content is not None
    text = httpx.get(f"{base}/metrics").text  # per key, by name
    assert re.search(r'kvgate:api_key_rate_limited_total\{key_name="two-a-minute"\} 1\n', text)
    assert re.search(r'kvgate:api_key_requests_total\{key_name="two-a-minute"\} 2\n', text)
    assert not any(s in text for s in SECRETS)


def test_a_key_over_its_token_rate_waits(base: str) -> None:
    r = chat(base, "sk-tpm-secret", extra_body={"ignore_eos": True})  # > 20 tokens with the prompt
    assert r.usage.prompt_tokens + r.usage.completion_tokens > 20
    with pytest.raises(openai.RateLimitError, match="over its limit of 20 tokens per minute"):
        chat(base, "sk-tpm-secret")


def test_a_key_at_its_concurrency_limit_gets_429_until_one_ends(base: str, tiny_model_dirs) -> None:
    held = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="sk-conc-1-secret", max_retries=0)

    async def main() -> None:
        first = asyncio.ensure_future(held.chat.completions.create(model=MODEL, messages=HI, max_tokens=4))
        while httpx.get(f"{base}/metrics").text.find('kvgate:api_key_requests_in_flight{key_name="one-at-a-time"} 1') < 0:
            await asyncio.sleep(0.01)  # the first is admitted and held by the batching window
        with pytest.raises(openai.RateLimitError, match="1 requests in flight, its limit of 1 concurrent"):
            await asyncio.to_thread(chat, base, "sk-conc-1-secret")
        await asyncio.to_thread(chat, base, "sk-free-secret")  # no window: releases the held batch
        assert (await first).choices[0].finish_reason is not None
        await asyncio.to_thread(chat, base, "sk-conc-1-secret")  # its seat is free again

    asyncio.run(main())


def test_access_log_has_one_line_per_request_and_never_a_key_or_prompt(base: str, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="kvgate.access"):
        chat(base, "sk-free-secret", extra_body={"ignore_eos": True})
        list(client(base, "sk-free-secret").completions.create(model=MODEL, prompt="the secret garden", max_tokens=3,
                                                               stream=True, extra_body={"ignore_eos": True}))
        httpx.get(f"{base}/health")
        httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer sk-nope"})
    lines = [r.getMessage() for r in caplog.records if r.name == "kvgate.access"]
    assert re.fullmatch(r'127\.0\.0\.1:\d+ "POST /v1/chat/completions" 200 model=tiny key=free prompt_tokens=\d+ '
                        r'completion_tokens=4 latency_ms=[\d.]+', lines[0]), lines
    assert re.fullmatch(r'.*"POST /v1/completions" 200 model=tiny key=free prompt_tokens=\d+ completion_tokens=3 '
                        r'latency_ms=[\d.]+ stream=true', lines[1]), lines
    assert re.fullmatch(r'.*"GET /v1/models" 401 key=- latency_ms=[\d.]+', lines[2]), lines  # /health: DEBUG only
    assert len(lines) == 3
    everything = "\n".join(r.getMessage() for r in caplog.records)
    assert not any(s in everything for s in SECRETS) and "garden" not in everything


def test_access_log_off(tiny_model_dirs: dict[str, str], caplog) -> None:
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=tiny_model_dirs["llama"], max_num_seqs=2,
                                                             num_gpu_blocks_override=16))
    with caplog.at_level(logging.DEBUG, logger="kvgate.access"), running(engine, log_requests=False) as url:
        openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0).chat.completions.create(
            model=MODEL, messages=HI, max_tokens=2)
    assert not [r for r in caplog.records if r.name == "kvgate.access"]


def test_keys_from_config_file_and_environment(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TEAM_B_KEY", "sk-from-env")
    (tmp_path / "keys.yaml").write_text("- {name: ci, key: sk-from-file, max_concurrent: 2}\n")
    config = tmp_path / "config.yaml"
    config.write_text("api_key: sk-default\napi_keys_file: keys.yaml\napi_keys:\n"
                      "  - {name: team-a, key: sk-inline, rpm: 60, tpm: 100000}\n  - {name: team-b, key_env: TEAM_B_KEY}\n")
    keys = {k.name: k for k in load_config(str(config)).api_keys}
    assert {n: (k.key, k.rpm, k.tpm, k.max_concurrent) for n, k in keys.items()} == {
        "team-a": ("sk-inline", 60, 100000, None), "team-b": ("sk-from-env", None, None, None),
        "ci": ("sk-from-file", None, None, 2), "default": ("sk-default", None, None, None)}
    assert "sk-" not in repr(keys["team-a"])  # a key never reaches a repr, hence never a log


@pytest.mark.parametrize("entries, message", [
    ("  - {key: sk-1}\n", "api_keys[0].name: each API key needs a name"),
    ("  - {name: a, key: sk-1, key_env: X}\n", "api_keys[0]: give either key: or key_env:, not both"),
    ("  - {name: a}\n", "api_keys[0]: needs key: (the key) or key_env:"),
    ("  - {name: a, key_env: KVGATE_TEST_UNSET}\n", "api_keys[0].key_env: the environment variable KVGATE_TEST_UNSET "
                                                     "is not set"),
    ("  - {name: a, key: sk-dup-secret}\n  - {name: b, key: sk-dup-secret}\n",
     "api_keys[1]: API keys 'a' and 'b' are the same key"),
    ("  - {name: a, key: sk-1}\n  - {name: a, key: sk-2}\n", "api_keys[1].name: duplicate API key name 'a'"),
    ("  - {name: a, key: sk-1, rpm: 0}\n", "api_keys[0].rpm: must be >= 1, got 0"),
    ("  - {name: a, key: sk-1, rps: 5}\n", "api_keys[0]: unknown key 'rps' (did you mean 'rpm'?)"),
])
def test_invalid_key_entries_are_refused_without_the_secret(tmp_path: Path, entries: str, message: str) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("api_keys:\n" + entries)
    with pytest.raises(ConfigError) as e:
        load_config(str(config))
    assert message in str(e.value) and "sk-" not in str(e.value)


def test_rate_limits_are_exact_under_concurrency(base: str) -> None:
    """Six requests of a key allowed three a minute, all at once: exactly three are admitted (the checks run on
    the event loop, so no two admissions interleave; a minute refills three, the test takes well under one)."""
    results: list[int] = []
    lock = threading.Lock()

    def one() -> None:
        r = httpx.post(f"{base}/v1/chat/completions", headers={"Authorization": "Bearer sk-burst-secret",
                                                               "X-Max-Batch-Delay-Ms": "0"},
                       json={"model": MODEL, "messages": HI, "max_tokens": 1}, timeout=30)
        with lock:
            results.append(r.status_code)

    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [200, 200, 200, 429, 429, 429]
