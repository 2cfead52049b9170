"""OpenAI's /v1/embeddings on an embedding model (an AsyncLLMEngine of the pooling runner): inputs, limits, and the
response with float or base64 vectors (vLLM's OpenAIServingEmbedding).

Every input of one request enters the engine at once (one engine request each, batched by the scheduler); if one
is refused or the client goes away, the others are aborted, so no KV block outlives the request.
"""
from __future__ import annotations

import array
import asyncio
import base64
import sys
import time
import uuid
from typing import Any

from pydantic import ValidationError

from kvgate.engine.outputs import PoolingRequestOutput
from kvgate.engine.pooling_params import PoolingParams
from kvgate.gateway.errors import APIError, validation_error
from kvgate.gateway.protocol import EmbeddingRequest
from kvgate.gateway.serving import OpenAIServing

MAX_EMBEDDING_INPUTS = 2048  # inputs per request, as OpenAI's API
TOKENIZE_IN_THREAD_CHARS = 1 << 16  # longer texts are tokenized off the event loop
_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "embeddings": "/v1/embeddings"}


def check_endpoint(kind: str, runner: str, model: str) -> None:
    """A 400 when the endpoint of `kind` does not fit the model's runner: embeddings need a pooling model, chat
    and completions a generative one. The message says which endpoint the model serves."""
    if kind == "embeddings" and runner != "pooling":
        raise APIError(400, f"`{model}` is a text-generation model: it serves /v1/chat/completions and "
                            f"/v1/completions, not /v1/embeddings (an embedding model is served with "
                            f"--runner pooling)", "model", "wrong_endpoint")
    if kind != "embeddings" and runner == "pooling":
        raise APIError(400, f"`{model}` is an embedding model (runner pooling): it serves /v1/embeddings, not "
                            f"{_PATHS.get(kind, kind)}", "model", "wrong_endpoint")


def encode_embedding(embedding: list[float], encoding_format: str) -> list[float] | str:
    """float: the list as it is; base64: little-endian float32 bytes, base64 (OpenAI's and vLLM's format)."""
    if encoding_format == "float":
        return embedding
    packed = array.array("f", embedding)
    if sys.byteorder == "big":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")


class OpenAIServingEmbedding:
    """/v1/embeddings for one served model (its OpenAIServing: engine, tokenizer, name)."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, body: dict[str, Any], priority: int, delay: float | None) -> dict:
        """The response body for an /v1/embeddings request body; APIError (400) for invalid input, RuntimeError
        when the engine is not running."""
        try:
            req = EmbeddingRequest.model_validate(body)
        except ValidationError as e:
            first = e.errors()[0] if e.errors() else {}
            if first.get("loc", ())[:1] == ("input",) and first.get("type") != "missing":  # one message, not 4
                raise APIError(400, "input must be a string, a list of strings, a list of token ids or a list of "
                                    "lists of token ids (one kind per request)", "input") from None
            raise validation_error(e) from None
        config = self.serving.engine.config
        try:
            params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize)
            params.verify(config.pooler_config, config.model_config.hidden_size)
        except ValueError as e:
            raise APIError(400, str(e), "dimensions") from None
        prompts = await self.prompts(req)
        rid = f"embd-{uuid.uuid4().hex}"
        outs = await self._run(prompts, params, rid, priority, delay)
        tokens = sum(len(p) for p in prompts)
        data = [{"object": "embedding", "index": k, "embedding": encode_embedding(o.outputs.embedding,
                                                                                  req.encoding_format)}
                for k, o in enumerate(outs)]
        return {"id": rid, "object": "list", "created": int(time.time()), "model": self.serving.name, "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def prompts(self, req: EmbeddingRequest) -> list[list[int]]:
        """Token ids of every input, each checked: not empty, ids in the vocabulary, at most max_model_len tokens
        (a pooling prompt needs no room for output)."""
        inputs = req.inputs()
        if not inputs:
            raise APIError(400, "input must not be empty: give a string, a list of strings, a list of token ids "
                                "or a list of lists of token ids", "input")
        if len(inputs) > MAX_EMBEDDING_INPUTS:
            raise APIError(400, f"input has {len(inputs)} items, more than the limit of {MAX_EMBEDDING_INPUTS} "
                                f"per request", "input")

        def name(k: int) -> str:  # how the messages call input k
            return "input" if len(inputs) == 1 else f"input[{k}]"

        for k, x in enumerate(inputs):
            if not x:
                raise APIError(400, f"{name(k)} is empty: every input needs at least one token", "input")
        texts = [x for x in inputs if isinstance(x, str)]
        encoded = iter(await self._tokenize(texts) if texts else [])
        prompts = [next(encoded) if isinstance(x, str) else x for x in inputs]
        vocab = self.serving.engine.config.model_config.vocab_size
        limit = self.serving.max_model_len
        for k, (x, ids) in enumerate(zip(inputs, prompts)):
            if not isinstance(x, str) and (bad := next((t for t in ids if not 0 <= t < vocab), None)) is not None:
                raise APIError(400, f"{name(k)} has token id {bad}, out of range: ids must be in [0, {vocab})",
                               "input")
            if not ids:
                raise APIError(400, f"{name(k)} has no tokens after tokenization: at least one is needed", "input")
            if len(ids) > limit:
                raise APIError(400, f"This model's maximum context length is {limit} tokens, but {name(k)} has "
                                    f"{len(ids)} tokens. Please shorten it.", "input", "context_length_exceeded")
        return prompts

    async def _tokenize(self, texts: list[str]) -> list[list[int]]:
        tok = self.serving.tokenizer
        if tok is None:
            raise APIError(400, "this model is served without a tokenizer (skip_tokenizer_init): send token ids as "
                                "input", "input")

        def run() -> list[list[int]]:
            return [tok.encode(t) for t in texts] if len(texts) == 1 else list(tok(texts)["input_ids"])

        if sum(len(t) for t in texts) > TOKENIZE_IN_THREAD_CHARS:
            return await asyncio.to_thread(run)
        return run()

    async def _run(self, prompts: list[list[int]], params: PoolingParams, rid: str, priority: int,
                   delay: float | None) -> list[PoolingRequestOutput]:
        """Every prompt at once; the first failure (or a cancellation) aborts the rest before it propagates."""
        engine = self.serving.engine

        async def one(k: int, ids: list[int]) -> PoolingRequestOutput:
            final = None
            async for out in engine.encode({"prompt_token_ids": ids}, params, f"{rid}-{k}", priority, delay):
                final = out
            assert final is not None
            return final

        tasks = [asyncio.ensure_future(one(k, ids)) for k, ids in enumerate(prompts)]
        try:
            return list(await asyncio.gather(*tasks))
        except ValueError as e:  # refused by the engine (it checks what the gateway checked, and more)
            raise APIError(400, str(e), "input") from e
        finally:
            pending = [t for t in tasks if not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
