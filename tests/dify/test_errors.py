"""Credential validation (one small real request) and the SDK error types of failed calls: unreachable gateway,
401 (gateway with --api-key), 400 (the gateway's own limits), 429 (a full gateway), bad form values."""
from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from dify_helpers import MODEL, credentials, joined, marker, prompt
from dify_plugin.errors.model import (
    CredentialsValidateFailedError,
    InvokeAuthorizationError,
    InvokeBadRequestError,
    InvokeConnectionError,
    InvokeRateLimitError,
)

AUTH_KEY = "sekret-dify"  # kvgate_server.py's auth gateway


@pytest.fixture(scope="module")
def closed_port_url() -> str:
    """A loopback URL where nothing listens (the port was free a moment ago)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_validation_passes_with_good_credentials(gateways: Any, llm: Callable[[], Any]) -> None:
    tag = marker()
    llm().validate_credentials(MODEL, credentials(gateways["main"] + "/v1/", priority=70, max_batch_delay=10))
    llm().validate_credentials(MODEL, credentials(gateways["auth"], api_key=AUTH_KEY, mode="completion"))
    llm().validate_credentials(tag, credentials(gateways["main"], endpoint_model_name=MODEL))


@pytest.mark.parametrize("stream", [True, False])
def test_unreachable_gateway(closed_port_url: str, llm: Callable[[], Any], stream: bool) -> None:
    with pytest.raises(CredentialsValidateFailedError, match=f"cannot reach kvgate at {closed_port_url}"):
        llm().validate_credentials(MODEL, credentials(closed_port_url))
    with pytest.raises(InvokeConnectionError, match="cannot reach kvgate"):
        joined(llm().invoke(MODEL, credentials(closed_port_url), prompt("hi"), {"max_tokens": 2}, stream=stream))


@pytest.mark.parametrize("stream", [True, False])
def test_wrong_api_key_is_401(gateways: Any, llm: Callable[[], Any], stream: bool) -> None:
    for key in ("wrong", None):
        creds = credentials(gateways["auth"], **({"api_key": key} if key else {}))
        with pytest.raises(CredentialsValidateFailedError, match="kvgate answered 401: invalid or missing API key"):
            llm().validate_credentials(MODEL, creds)
        with pytest.raises(InvokeAuthorizationError):
            joined(llm().invoke(MODEL, creds, prompt("hi"), {"max_tokens": 2}, stream=stream))
    good = credentials(gateways["auth"], api_key=AUTH_KEY)
    assert joined(llm().invoke(MODEL, good, prompt("hi"), {"max_tokens": 3}, stream=stream))[1].completion_tokens == 3


def test_validation_reports_the_gateways_400_and_404(gateways: Any, llm: Callable[[], Any]) -> None:
    with pytest.raises(CredentialsValidateFailedError, match=r"400: priority must be in \[0, 100\].*got 150"):
        llm().validate_credentials(MODEL, credentials(gateways["main"], priority=150))
    with pytest.raises(CredentialsValidateFailedError, match=r"400: .*must be in \[0, 60000\] ms"):
        llm().validate_credentials(MODEL, credentials(gateways["main"], max_batch_delay=70000))
    with pytest.raises(CredentialsValidateFailedError, match="404: The model `nope` does not exist"):
        llm().validate_credentials("nope", credentials(gateways["main"]))


@pytest.mark.parametrize("field, value, message", [
    ("vllm_endpoint", "", "vllm_endpoint .* is required"),
    ("vllm_endpoint", "kvgate:8000", "must start with http:// or https://"),
    ("timeout", "soon", "timeout must be a number of seconds in \\[1, 86400\\], got 'soon'"),
    ("timeout", "0", "timeout must be in \\[1, 86400\\] seconds, got 0"),
    ("context_size", "4k", "context_size must be a whole number of tokens >= 1, got '4k'"),
    ("max_tokens_to_sample", "9999", "max_tokens_to_sample must be in \\[1, context_size=512\\], got 9999"),
    ("priority", "high", "priority must be a whole number in \\[0, 100\\]"),
    ("mode", "edit", "mode must be one of chat, completion, got 'edit'"),
])
def test_bad_form_values_say_what_is_wrong(gateways: Any, llm: Callable[[], Any], field: str, value: str,
                                           message: str) -> None:
    creds = credentials(gateways["main"], **{field: value})
    with pytest.raises(CredentialsValidateFailedError, match=message):
        llm().validate_credentials(MODEL, creds)
    with pytest.raises(InvokeBadRequestError, match=message):
        joined(llm().invoke(MODEL, creds, prompt("hi"), {"max_tokens": 2}))


@pytest.mark.parametrize("stream", [True, False])
def test_a_request_over_the_context_is_a_bad_request(gateways: Any, llm: Callable[[], Any], stream: bool) -> None:
    creds = credentials(gateways["main"], max_tokens_to_sample=512)
    with pytest.raises(InvokeBadRequestError, match="maximum context length is 512 tokens"):
        joined(llm().invoke(MODEL, creds, prompt("hi"), {"max_tokens": 510}, stream=stream))


@pytest.fixture(scope="module")
def busy_gateway(gateways: Any) -> Iterator[str]:
    """The busy gateway (one seat, no queue) while one long request runs on it: every other request gets 429.
    The blocker needs 300 steps of at least 50 ms each there: it outlives this module's tests."""
    tag = marker()
    body = {"model": MODEL, "prompt": f"blocker {tag}", "max_tokens": 300, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client, client.stream(
            "POST", gateways["busy"] + "/v1/completions", json=body, headers={"X-Max-Batch-Delay-Ms": "0"}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        while not next(lines).startswith("data:"):  # the first token: it holds the only seat now
            pass
        yield gateways["busy"]
    # leaving the stream disconnects it: kvgate aborts the blocker and frees the seat


@pytest.mark.parametrize("stream", [True, False])
def test_a_full_gateway_is_429(busy_gateway: str, llm: Callable[[], Any], stream: bool) -> None:
    with pytest.raises(CredentialsValidateFailedError, match="429: .*requests waiting \\(limit 0\\)"):
        llm().validate_credentials(MODEL, credentials(busy_gateway))
    with pytest.raises(InvokeRateLimitError, match="retry after 1 s"):
        joined(llm().invoke(MODEL, credentials(busy_gateway), prompt("hi"), {"max_tokens": 2}, stream=stream))
