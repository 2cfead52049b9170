"""The kvgate model provider: every model is added by hand (customizable-model), with its own credentials."""
from __future__ import annotations

from dify_plugin import ModelProvider


class KvgateProvider(ModelProvider):
    def validate_provider_credentials(self, credentials: dict) -> None:
        """kvgate has no provider-wide credentials: each model's form (gateway URL, key, limits) is checked by
        its model type's validate_credentials (KvgateLargeLanguageModel, KvgateTextEmbeddingModel) when the model is
        added."""
