"""The provider's one credential form serves both model types: read by the SDK from provider/kvgate.yaml and
filtered per type the way Dify filters it (a field with `show_on` on `__model_type` exists only for that type),
each type sees and requires only its own fields, and the form's defaults are the plugin's."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from dify_helpers import EMBED_MODEL, MODEL
from dify_plugin.entities.model import ModelType

SHARED = {"vllm_endpoint", "api_key", "endpoint_model_name", "context_size", "timeout", "max_batch_delay", "priority"}


def form_for(registration: Any, model_type: ModelType) -> dict[str, Any]:
    """The form's fields that Dify shows (and validates, and sends) for `model_type`, by variable."""
    provider = registration.models_mapping["kvgate"][0]
    fields = {}
    for field in provider.model_credential_schema.credential_form_schemas:
        if all(s.variable == "__model_type" and s.value == model_type.value for s in field.show_on):
            fields[field.variable] = field
    return fields


def test_the_provider_offers_llm_and_text_embedding(registration: Any) -> None:
    provider = registration.models_mapping["kvgate"][0]
    assert provider.supported_model_types == [ModelType.LLM, ModelType.TEXT_EMBEDDING]
    assert registration.get_model_instance("kvgate", ModelType.TEXT_EMBEDDING) is not None


@pytest.mark.parametrize("model_type, own, required", [
    (ModelType.LLM, {"mode", "max_tokens_to_sample", "function_calling_type", "stream_function_calling",
                     "structured_output_support", "agent_thought_support"},
     {"vllm_endpoint", "context_size", "max_tokens_to_sample"}),
    (ModelType.TEXT_EMBEDDING, {"max_chunks"}, {"vllm_endpoint", "context_size", "max_chunks"}),
])
def test_each_type_sees_and_requires_only_its_fields(registration: Any, model_type: ModelType, own: set[str],
                                                     required: set[str]) -> None:
    fields = form_for(registration, model_type)
    assert set(fields) == SHARED | own
    assert {name for name, field in fields.items() if field.required} == required


@pytest.mark.parametrize("model_type, model, instance", [
    (ModelType.LLM, MODEL, "llm"), (ModelType.TEXT_EMBEDDING, EMBED_MODEL, "embedding")])
def test_a_form_left_at_its_defaults_is_valid(request: pytest.FixtureRequest, gateways: Any, registration: Any,
                                              model_type: ModelType, model: str, instance: str) -> None:
    """What Dify sends for a form where the admin filled in only the URL validates, and the schema carries the
    form's defaults (an LLM is checked against the main gateway, an embedding model against the embed one)."""
    fields = form_for(registration, model_type)
    creds = {name: str(field.default) for name, field in fields.items() if field.default is not None}
    creds["vllm_endpoint"] = gateways["main" if model_type == ModelType.LLM else "embed"]
    make: Callable[[], Any] = request.getfixturevalue(instance)
    make().validate_credentials(model, creds)
    properties = {key.value: value for key, value in make().get_model_schema(model, creds).model_properties.items()}
    assert properties["context_size"] == int(fields["context_size"].default)
    if model_type == ModelType.TEXT_EMBEDDING:
        assert properties["max_chunks"] == int(fields["max_chunks"].default)
