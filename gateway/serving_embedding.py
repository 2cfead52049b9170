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
        """Token ids of every input, each checked as OpenAIServing.input_ids checks prompts (not empty, at most
        MAX_PROMPTS, texts within the byte bound and tokenized off the event loop when long, ids in the vocabulary),
        and at most max_model_len tokens (a pooling prompt needs no room for output)."""
        inputs = req.inputs()
        prompts = await self.serving.input_ids(inputs, "input")
        limit = self.serving.max_model_len
        for k, ids in enumerate(prompts):
            if len(ids) > limit:
                name = "input" if len(inputs) == 1 else f"input[{k}]"
                raise APIError(400, f"This model's maximum context length is {limit} tokens, but {name} has "
                                    f"{len(ids)} tokens. Please shorten it.", "input", "context_length_exceeded")
        return prompts

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
