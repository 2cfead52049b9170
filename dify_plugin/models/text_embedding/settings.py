"""An embedding model's own credential on top of the shared ones (models/common/settings.py): max_chunks, the most
texts sent to the gateway in one /v1/embeddings request."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from models.common.settings import GatewaySettings, whole

DEFAULT_MAX_CHUNKS = 32  # the form's default too (provider/kvgate.yaml)
MAX_INPUTS_PER_REQUEST = 2048  # kvgate's (and OpenAI's) limit on the inputs of one /v1/embeddings request


@dataclass(frozen=True)
class EmbeddingSettings(GatewaySettings):
    """What the plugin needs to call one embedding model on one kvgate gateway."""

    max_chunks: int  # texts per gateway request, in [1, MAX_INPUTS_PER_REQUEST]

    @classmethod
    def type_fields(cls, credentials: Mapping[str, Any], common: Mapping[str, Any]) -> dict[str, Any]:
        what = f"a whole number of texts in [1, {MAX_INPUTS_PER_REQUEST}]"
        max_chunks = whole(credentials, "max_chunks", DEFAULT_MAX_CHUNKS, what)
        if not 1 <= max_chunks <= MAX_INPUTS_PER_REQUEST:
            raise ValueError(f"max_chunks must be in [1, {MAX_INPUTS_PER_REQUEST}] (texts per request to kvgate; "
                             f"{MAX_INPUTS_PER_REQUEST} is the gateway's limit), got {max_chunks}")
        return {"max_chunks": max_chunks}
