"""The plugin's text-embedding model through the SDK's public invoke(), against kvgate's embed gateway (a tiny
embedding model): vectors and usage equal the gateway's own answer, max_chunks splits a call into ordered requests
that carry the model's headers, token counts come from /tokenize, the form is checked by one real request, and a
text over the context is refused with the limit named, never cut."""
from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from dify_helpers import CONTEXT, EMBED_MODEL, MODEL, embedding_credentials, gateway_embeddings, gateway_post, marker
from dify_plugin.entities.model import ModelPropertyKey, ModelType
from dify_plugin.errors.model import (
    CredentialsValidateFailedError,
    InvokeAuthorizationError,
    InvokeBadRequestError,
    InvokeConnectionError,
)

AUTH_KEY = "sekret-dify"  # kvgate_server.py's auth gateway


def sentences(tag: str, count: int) -> list[str]:
    """Texts of several tokens each, all carrying `tag` (to find them in the engine's record)."""
    return [f"Sentence number {i} about kvgate embeddings {tag}" for i in range(count)]


def direct_vectors(url: str, texts: list[str]) -> tuple[list[list[float]], int]:
    """The gateway's own answer to one /v1/embeddings request for `texts`: (vectors, prompt tokens)."""
    answer = gateway_embeddings(url, texts)
    assert [d["index"] for d in answer["data"]] == list(range(len(texts)))
    return [d["embedding"] for d in answer["data"]], answer["usage"]["prompt_tokens"]


def tokenize_count(url: str, text: str) -> int:
    return gateway_post(url, "/tokenize", {"model": EMBED_MODEL, "prompt": text})["count"]


def plugin_requests(gateways: Any, tag: str, priority: int) -> list[list[dict[str, Any]]]:
    """The engine's records of the plugin's texts (told apart from direct calls by `priority`), grouped by the
    gateway request they came in, in arrival order (request ids are "embd-<hex>-<input index>")."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for record in gateways.engine_records(tag):
        if record["server"] == "embed" and record["priority"] == priority:
            groups.setdefault(record["request_id"].rsplit("-", 1)[0], []).append(record)
    return list(groups.values())


def test_vectors_usage_and_token_counts_are_the_gateways(gateways: Any, embedding: Callable[[], Any]) -> None:
    texts = sentences(marker(), 4)
    vectors, tokens = direct_vectors(gateways["embed"], texts)
    creds = embedding_credentials(gateways["embed"], max_chunks=8)

    result = embedding().invoke(EMBED_MODEL, creds, texts, user="dify-user")
    assert result.model == EMBED_MODEL
    assert result.embeddings == vectors  # float, exact: the same request gives the same vectors
    assert len(vectors[0]) == 64 and result.usage.tokens == result.usage.total_tokens == tokens

    counts = embedding().get_num_tokens(EMBED_MODEL, creds, texts)
    assert counts == [tokenize_count(gateways["embed"], t) for t in texts] and sum(counts) == tokens


def test_max_chunks_splits_a_call_into_ordered_requests_with_the_models_headers(
        gateways: Any, embedding: Callable[[], Any]) -> None:
    tag = marker()
    texts = sentences(tag, 5)
    creds = embedding_credentials(gateways["embed"], max_chunks=2, priority=70, max_batch_delay=40)
    result = embedding().invoke(EMBED_MODEL, creds, texts)

    requests = plugin_requests(gateways, tag, priority=70)
    assert [sorted(r["prompt"] for r in request) for request in requests] == [texts[0:2], texts[2:4], texts[4:5]]
    assert all(r["max_batch_delay"] == pytest.approx(0.04) == r["batch_window"] for req in requests for r in req)
    expected = [direct_vectors(gateways["embed"], texts[i:i + 2]) for i in range(0, 5, 2)]  # the same requests
    assert result.embeddings == [v for vectors, _ in expected for v in vectors]
    assert result.usage.tokens == sum(tokens for _, tokens in expected)


def test_no_texts_make_no_request(gateways: Any, embedding: Callable[[], Any]) -> None:
    closed = embedding_credentials("http://127.0.0.1:9")  # nothing may be called
    result = embedding().invoke(EMBED_MODEL, closed, [])
    assert result.embeddings == [] and result.usage.tokens == 0


def test_a_text_over_the_context_is_refused_with_the_limit(gateways: Any, embedding: Callable[[], Any]) -> None:
    long = "word " * 600
    assert tokenize_count(gateways["embed"], long) > CONTEXT
    creds = embedding_credentials(gateways["embed"])
    with pytest.raises(InvokeBadRequestError, match=f"maximum context length is {CONTEXT} tokens, but input has"):
        embedding().invoke(EMBED_MODEL, creds, [long])
    short = sentences(marker(), 3)
    with pytest.raises(InvokeBadRequestError, match=rf"maximum context length is {CONTEXT} tokens, but input\[1\] has"
                                                    r".*in the request for texts 2\.\.3 of 4"):
        embedding().invoke(EMBED_MODEL, embedding_credentials(gateways["embed"], max_chunks=2), [*short, long])


@pytest.fixture(scope="module")
def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_validation_passes_for_a_good_form(gateways: Any, embedding: Callable[[], Any]) -> None:
    embedding().validate_credentials(EMBED_MODEL, embedding_credentials(gateways["embed"] + "/v1/", priority=90))
    embedding().validate_credentials("my-dify-name", embedding_credentials(gateways["embed"],
                                                                           endpoint_model_name=EMBED_MODEL))
    # the LLM-only fields are not the embedding model's business, even if a form sends them
    embedding().validate_credentials(EMBED_MODEL, embedding_credentials(gateways["embed"], mode="edit",
                                                                        max_tokens_to_sample=99999))


def test_validation_fails_for_a_wrong_url_key_or_model(gateways: Any, embedding: Callable[[], Any],
                                                       closed_port_url: str) -> None:
    with pytest.raises(CredentialsValidateFailedError, match=f"cannot reach kvgate at {closed_port_url}"):
        embedding().validate_credentials(EMBED_MODEL, embedding_credentials(closed_port_url))
    for key in ("wrong", None):
        creds = embedding_credentials(gateways["auth"], **({"api_key": key} if key else {}))
        with pytest.raises(CredentialsValidateFailedError, match="kvgate answered 401: invalid or missing API key"):
            embedding().validate_credentials(EMBED_MODEL, creds)
    with pytest.raises(CredentialsValidateFailedError,
                       match=f"400: `{MODEL}` is a text-generation model: .* not /v1/embeddings"):
        embedding().validate_credentials(MODEL, embedding_credentials(gateways["main"]))
    with pytest.raises(CredentialsValidateFailedError, match="404: The model `nope` does not exist"):
        embedding().validate_credentials("nope", embedding_credentials(gateways["embed"]))


def test_failed_calls_raise_the_sdks_error_types(gateways: Any, embedding: Callable[[], Any],
                                                 closed_port_url: str) -> None:
    with pytest.raises(InvokeConnectionError, match="cannot reach kvgate"):
        embedding().invoke(EMBED_MODEL, embedding_credentials(closed_port_url), ["hi"])
    with pytest.raises(InvokeAuthorizationError):
        embedding().invoke(EMBED_MODEL, embedding_credentials(gateways["auth"], api_key="wrong"), ["hi"])
    with pytest.raises(InvokeBadRequestError, match="is a text-generation model"):
        embedding().invoke(MODEL, embedding_credentials(gateways["main"]), ["hi"])


@pytest.mark.parametrize("field, value, message", [
    ("max_chunks", "lots", r"max_chunks must be a whole number of texts in \[1, 2048\], got 'lots'"),
    ("max_chunks", "0", r"max_chunks must be in \[1, 2048\] .*got 0"),
    ("max_chunks", "4096", r"max_chunks must be in \[1, 2048\] .*got 4096"),
    ("context_size", "4k", "context_size must be a whole number of tokens >= 1, got '4k'"),
    ("timeout", "0", r"timeout must be in \[1, 86400\] seconds, got 0"),
    ("vllm_endpoint", "kvgate:8000", "must start with http:// or https://"),
])
def test_bad_form_values_say_what_is_wrong(gateways: Any, embedding: Callable[[], Any], field: str, value: str,
                                           message: str) -> None:
    creds = embedding_credentials(gateways["embed"], **{field: value})
    with pytest.raises(CredentialsValidateFailedError, match=message):
        embedding().validate_credentials(EMBED_MODEL, creds)
    with pytest.raises(InvokeBadRequestError, match=message):
        embedding().invoke(EMBED_MODEL, creds, ["hi"])


def test_schema_carries_context_size_and_max_chunks(gateways: Any, embedding: Callable[[], Any]) -> None:
    model = embedding()
    creds = embedding_credentials(gateways["embed"], context_size=300, max_chunks=5)
    schema = model.get_model_schema("any-name", creds)
    assert schema.model_type == ModelType.TEXT_EMBEDDING and schema.parameter_rules == []
    assert schema.model_properties == {ModelPropertyKey.CONTEXT_SIZE: 300, ModelPropertyKey.MAX_CHUNKS: 5}
    assert (model._get_context_size("any-name", creds), model._get_max_chunks("any-name", creds)) == (300, 5)
    defaults = model.get_model_schema("any-name", embedding_credentials(gateways["embed"], max_chunks="x"))
    assert defaults.model_properties[ModelPropertyKey.MAX_CHUNKS] == 32  # the form's default, UI kept usable


def test_the_embed_gateway_serves_an_embedding_model(gateways: Any) -> None:
    """It refuses chat: the tiny embedding model really is served by the pooling runner."""
    response = httpx.post(gateways["embed"] + "/v1/chat/completions", timeout=30, json={
        "model": EMBED_MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 400 and "is an embedding model" in response.json()["error"]["message"]
