"""What Dify learns about a kvgate LLM from its form: the features it declares and the parameters a Dify user can set.

Features (Dify's ModelFeature) follow the feature fields of the form (models/llm/settings.py):
- function calling on: tool-call, and multi-tool-call unless one call per turn was chosen; stream-tool-call as
  well unless "Stream function calling" is off (Dify's agent then calls the model blocking when it gives tools).
- structured output on: structured-output. Dify then sends its JSON schema in the `json_schema` parameter with
  `response_format` json_schema, and kvgate's guided decoding makes the answer match it.
- thinking on (either kind): agent-thought.

Parameters are OpenAI's sampling fields, plus, per feature, `tool_choice` (auto / required), `response_format`
(text / json_object / json_schema) with `json_schema`, and `enable_thinking` (a hybrid thinking model's switch).
The SDK drops every parameter a model's rules do not list, so a feature that is off also keeps its parameters out.
"""
from __future__ import annotations

from typing import Any

from dify_plugin.entities import I18nObject
from dify_plugin.entities.model import ModelFeature, ParameterRule, ParameterType

from models.llm.settings import LLMSettings

# the parameter names that models/llm/request.py reads
TOOL_CHOICE = "tool_choice"
TOOL_CHOICES = ("auto", "required")
RESPONSE_FORMAT = "response_format"
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
JSON_SCHEMA = "json_schema"
ENABLE_THINKING = "enable_thinking"

# parameters that Dify knows by name (its templates add translated labels and help)
_TEMPLATES = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "max_tokens", JSON_SCHEMA)


def model_features(settings: LLMSettings) -> list[ModelFeature]:
    """The features this model declares to Dify (see the module's docstring)."""
    features = []
    if settings.tool_calls:
        features.append(ModelFeature.TOOL_CALL)
        if settings.parallel_tool_calls:
            features.append(ModelFeature.MULTI_TOOL_CALL)
        if settings.stream_tool_calls:
            features.append(ModelFeature.STREAM_TOOL_CALL)
    if settings.structured_output:
        features.append(ModelFeature.STRUCTURED_OUTPUT)
    if settings.thinking != "not_supported":
        features.append(ModelFeature.AGENT_THOUGHT)
    return features


def _rule(name: str, kind: ParameterType, label: str, help_text: str, **limits: Any) -> ParameterRule:
    return ParameterRule(name=name, use_template=name if name in _TEMPLATES else None, label=I18nObject(en_US=label),
                         type=kind, help=I18nObject(en_US=help_text), required=False, **limits)


def sampling_rules(max_tokens: int) -> list[ParameterRule]:
    """The sampling parameters a Dify user can set on every model; all go to kvgate under OpenAI's names."""
    return [
        _rule("temperature", ParameterType.FLOAT, "Temperature", "0 is greedy; higher is more random.",
              default=0.7, min=0.0, max=2.0, precision=2),
        _rule("top_p", ParameterType.FLOAT, "Top P", "Sample from the smallest set of tokens with this much "
              "probability.", default=1.0, min=0.01, max=1.0, precision=2),
        _rule("top_k", ParameterType.INT, "Top K", "Sample from the K most likely tokens only (0: all).",
              default=0, min=0, max=1000),
        _rule("presence_penalty", ParameterType.FLOAT, "Presence penalty", "Penalize tokens that already "
              "appeared.", default=0.0, min=-2.0, max=2.0, precision=2),
        _rule("frequency_penalty", ParameterType.FLOAT, "Frequency penalty", "Penalize tokens by how often they "
              "appeared.", default=0.0, min=-2.0, max=2.0, precision=2),
        _rule("max_tokens", ParameterType.INT, "Max tokens", f"Most tokens to generate (at most {max_tokens}).",
              default=min(512, max_tokens), min=1, max=max_tokens),
        _rule("seed", ParameterType.INT, "Seed", "Same seed and parameters, same answer.", min=0),
    ]


def feature_rules(settings: LLMSettings) -> list[ParameterRule]:
    """The parameters of the features this model has on."""
    rules = []
    if settings.tool_calls:
        rules.append(_rule(TOOL_CHOICE, ParameterType.STRING, "Tool choice",
                           "When tools are given. auto: the model decides whether to call one (kvgate serves the "
                           "model with --enable-auto-tool-choice --tool-call-parser NAME). required: it must call "
                           "one, and kvgate's guided decoding makes every call valid for the tool's parameters (an "
                           "agent then never answers in text while it gives tools).",
                           default="auto", options=list(TOOL_CHOICES)))
    if settings.structured_output:
        rules.append(_rule(RESPONSE_FORMAT, ParameterType.STRING, "Response format",
                           "json_object: any JSON object; json_schema: JSON that matches the JSON Schema below "
                           "(kvgate's guided decoding enforces it).", options=list(RESPONSE_FORMATS)))
        rules.append(_rule(JSON_SCHEMA, ParameterType.TEXT, "JSON Schema",
                           'A JSON schema, or OpenAI\'s {"name": ..., "schema": {...}, "strict": true}; the answer '
                           "will match it."))
    if settings.thinking_switch:
        rules.append(_rule(ENABLE_THINKING, ParameterType.BOOLEAN, "Thinking mode",
                           "Whether a hybrid thinking model (e.g. Qwen3) thinks before it answers: sent as "
                           "chat_template_kwargs.enable_thinking. Unset: the model's own default."))
    return rules


def parameter_rules(settings: LLMSettings) -> list[ParameterRule]:
    """Every parameter a Dify user can set on this model."""
    return sampling_rules(settings.max_tokens) + feature_rules(settings)
