"""A kvgate embedding model as a Dify text-embedding model: texts to vectors through the gateway's /v1/embeddings.

The texts of one call go to the gateway in requests of at most `max_chunks` texts each, one after the other, and
their vectors come back in the texts' order. Every request carries the model's API key, batching window
(X-Max-Batch-Delay-Ms) and priority (X-Priority), and every wait is bounded by its `timeout`, exactly as the LLM's.
Usage is the gateway's; token counts come from its /tokenize.

Texts are sent whole, never cut: a text longer than the model's context is refused by the gateway with a 400 that
names the limit, raised here as InvokeBadRequestError. (The SDK's generic OAICompatEmbeddingModel cuts such texts
at a character offset estimated with GPT-2's tokenizer, which is not the served model's; Dify's own
OpenAI-API-compatible provider no longer does, and Dify's knowledge base splits documents into chunks of a size
the admin picks: a silently shortened chunk would be indexed as if it were whole.)
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import httpx
from dify_plugin import TextEmbeddingModel
from dify_plugin.entities import I18nObject
from dify_plugin.entities.model import (
    AIModelEntity,
    EmbeddingInputType,
    FetchFrom,
    ModelPropertyKey,
    ModelType,
    PriceType,
)
from dify_plugin.entities.model.text_embedding import EmbeddingUsage, TextEmbeddingResult
from dify_plugin.errors.model import CredentialsValidateFailedError, InvokeError

from models.common.client import count_tokens, send
from models.common.errors import INVOKE_ERROR_MAPPING, error_for_exception
from models.common.settings import DEFAULT_CONTEXT_SIZE
from models.text_embedding.settings import DEFAULT_MAX_CHUNKS, EmbeddingSettings

EMBEDDINGS_PATH = "/v1/embeddings"


class KvgateTextEmbeddingModel(TextEmbeddingModel):
    # ---- invoking ---------------------------------------------------------------------------------------------
    def _invoke(self, model: str, credentials: dict, texts: list[str], user: str | None = None,
                input_type: EmbeddingInputType = EmbeddingInputType.DOCUMENT) -> TextEmbeddingResult:
        """One vector per text, in the texts' order, with the gateway's token usage summed over its requests.
        `input_type` (document or query) changes nothing: kvgate embeds a text as it is given."""
        settings = EmbeddingSettings.from_credentials(model, credentials)
        vectors: list[list[float]] = []
        tokens = 0
        with settings.client() as client:
            for start in range(0, len(texts), settings.max_chunks):
                batch = texts[start:start + settings.max_chunks]
                try:
                    batch_vectors, batch_tokens = self._embed(client, settings, batch, user)
                except InvokeError as e:
                    raise _in_batch(e, start, len(batch), len(texts)) from e
                vectors += batch_vectors
                tokens += batch_tokens
        return TextEmbeddingResult(model=model, embeddings=vectors,
                                   usage=self._calc_response_usage(model, credentials, tokens))

    @staticmethod
    def _embed(client: httpx.Client, settings: EmbeddingSettings, texts: list[str],
               user: str | None) -> tuple[list[list[float]], int]:
        """One /v1/embeddings request: (the vectors in the texts' order, the gateway's prompt tokens). Usage that an
        upstream left out is counted with the gateway's /tokenize."""
        body: dict[str, Any] = {"model": settings.model_name, "input": texts, "encoding_format": "float"}
        if user:
            body["user"] = user
        response = send(client, settings, EMBEDDINGS_PATH, body)
        try:
            answer = response.json()
            vectors = float_vectors(answer, len(texts))
            usage = answer.get("usage") or {}
            tokens = usage.get("prompt_tokens", usage.get("total_tokens"))
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
            raise error_for_exception(ValueError(str(e)), settings.url(EMBEDDINGS_PATH), settings.timeout) from e
        if tokens is None:
            return vectors, sum(count_tokens(client, settings, {"prompt": t}) for t in texts)
        return vectors, int(tokens)

    def _calc_response_usage(self, model: str, credentials: dict, tokens: int) -> EmbeddingUsage:
        """Dify's usage record for `tokens` input tokens: prices from the model schema (none: zero), latency since
        the SDK's invoke() started."""
        price = self.get_price(model=model, credentials=credentials, price_type=PriceType.INPUT, tokens=tokens)
        return EmbeddingUsage(tokens=tokens, total_tokens=tokens, unit_price=price.unit_price, price_unit=price.unit,
                              total_price=price.total_amount, currency=price.currency,
                              latency=time.perf_counter() - self.started_at if self.started_at else 0.0)

    # ---- token counting -----------------------------------------------------------------------------------------
    def get_num_tokens(self, model: str, credentials: dict, texts: list[str]) -> list[int]:
        """Each text's length in the served model's own tokens (the gateway's /tokenize), as /v1/embeddings counts
        it."""
        settings = EmbeddingSettings.from_credentials(model, credentials)
        with settings.client() as client:
            return [count_tokens(client, settings, {"prompt": text}) for text in texts]

    # ---- credentials and schema ---------------------------------------------------------------------------------
    def validate_credentials(self, model: str, credentials: Mapping) -> None:
        """One small real request (one short text) through the same path as every call: headers, key, model (it
        must be an embedding model on the gateway), and an answer of the promised shape."""
        try:
            settings = EmbeddingSettings.from_credentials(model, credentials)
        except ValueError as e:
            raise CredentialsValidateFailedError(str(e)) from e
        try:
            with settings.client() as client:
                self._embed(client, settings, ["ping"], None)
        except InvokeError as e:
            raise CredentialsValidateFailedError(str(e)) from e

    def get_customizable_model_schema(self, model: str, credentials: Mapping) -> AIModelEntity:
        """The model's context size and max chunks, as the form says."""
        try:
            settings = EmbeddingSettings.from_credentials(model, credentials)
            context, max_chunks = settings.context_size, settings.max_chunks
        except ValueError:  # a bad form is reported by validate_credentials and by _invoke; keep the UI usable
            context, max_chunks = DEFAULT_CONTEXT_SIZE, DEFAULT_MAX_CHUNKS
        return AIModelEntity(
            model=model, label=I18nObject(en_US=model), model_type=ModelType.TEXT_EMBEDDING,
            fetch_from=FetchFrom.CUSTOMIZABLE_MODEL, features=[],
            model_properties={ModelPropertyKey.CONTEXT_SIZE: context, ModelPropertyKey.MAX_CHUNKS: max_chunks},
            parameter_rules=[])

    @property
    def _invoke_error_mapping(self) -> dict[type[InvokeError], list[type[Exception]]]:
        return INVOKE_ERROR_MAPPING


def float_vectors(answer: Mapping[str, Any], count: int) -> list[list[float]]:
    """The vectors of an OpenAI embeddings answer, ordered by their `index`; ValueError unless there is exactly one
    list of numbers for each of the `count` inputs."""
    data = answer["data"]
    if sorted(item["index"] for item in data) != list(range(count)):
        raise ValueError(f"expected embeddings with indices 0..{count - 1}, got {len(data)} items")
    vectors = [item["embedding"] for item in sorted(data, key=lambda item: item["index"])]
    for vector in vectors:
        if not isinstance(vector, list) or not all(isinstance(x, (int, float)) for x in vector):
            raise ValueError(f"an embedding is not a list of floats: {str(vector)[:80]}")
    return [[float(x) for x in vector] for vector in vectors]


def _in_batch(error: InvokeError, start: int, size: int, total: int) -> InvokeError:
    """The error of the request for texts [start, start + size) of a call with `total` texts, with a note saying so
    when the call needed several requests (the gateway's input[i] counts from that request's first text)."""
    if size == total:
        return error
    return type(error)(f"{error} (in the request for texts {start}..{start + size - 1} of {total}: the gateway's "
                       f"input[i] is text {start}+i)")
