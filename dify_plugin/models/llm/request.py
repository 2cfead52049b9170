"""The OpenAI request of one Dify call: the path, and the body with the messages or the prompt, the sampling
parameters, stop words and user, and what the model's features add (models/llm/schema.py names the parameters):

- tools: Dify's PromptMessageTool (name, description, parameters: a JSON schema) as OpenAI `tools`, in chat mode.
  tool_choice is the `tool_choice` parameter, else "auto" (OpenAI's default when tools are given; kvgate needs the
  model served with --enable-auto-tool-choice --tool-call-parser NAME for it); "required" makes kvgate's guided
  decoding produce calls valid for the tools' parameters. One call per turn (function_calling_type
  single_tool_call) sends parallel_tool_calls false. Without tools neither is sent. Tools are sent whenever Dify
  gives them: the form's function-calling field only says what Dify may use (Dify gives tools only to a model that
  declares tool calling).
- response_format: `json_object`, or `json_schema` with the `json_schema` parameter, which is either OpenAI's
  json_schema object ({"name", "schema", "strict"}: what Dify's structured output sends) or a bare JSON schema (what
  a user may type into the parameter's box); a schema without response_format means json_schema. The schema's
  validity is the gateway's to judge (its 400 names the problem).
- enable_thinking: chat_template_kwargs {"enable_thinking": ...} (a hybrid thinking model's template reads it).

Mistakes in these parameters are ValueErrors naming the parameter (the SDK reports them as bad requests).
"""
from __future__ import annotations

import json
from typing import Any

from dify_plugin.entities.model.message import PromptMessage, PromptMessageTool

from models.llm.messages import chat_messages, completion_prompt
from models.llm.schema import ENABLE_THINKING, JSON_SCHEMA, RESPONSE_FORMAT, TOOL_CHOICE, TOOL_CHOICES
from models.llm.settings import LLMSettings

# Dify's parameter name -> the OpenAI field kvgate reads (the same names)
SAMPLING_PARAMETERS = ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty", "max_tokens", "seed")
DEFAULT_SCHEMA_NAME = "llm_response"  # the name Dify's structured output gives its schemas


def request_body(settings: LLMSettings, prompt_messages: list[PromptMessage], parameters: dict[str, Any],
                 tools: list[PromptMessageTool] | None, stop: list[str] | None, stream: bool,
                 user: str | None) -> tuple[str, dict[str, Any]]:
    """(path, body) of the gateway request for one call; ValueError for parameters that cannot be sent."""
    body: dict[str, Any] = {"model": settings.model_name, "stream": stream}
    if settings.mode == "chat":
        path, body["messages"] = "/v1/chat/completions", chat_messages(prompt_messages)
        body.update(tool_fields(settings, tools, parameters))
        body.update(thinking_fields(parameters))
    else:
        if tools:
            raise ValueError("tools need the model's Completion mode to be chat: /v1/completions has no tools")
        path, body["prompt"] = "/v1/completions", completion_prompt(prompt_messages)
    body.update({k: parameters[k] for k in SAMPLING_PARAMETERS if parameters.get(k) is not None})
    response_format = response_format_of(parameters)
    if response_format is not None:
        body["response_format"] = response_format
    if stop:
        body["stop"] = list(stop)
    if user:
        body["user"] = user
    if stream:
        body["stream_options"] = {"include_usage": True}  # the gateway's own token counts end the stream
    return path, body


def openai_tool(tool: PromptMessageTool) -> dict[str, Any]:
    """One Dify tool as an OpenAI function tool."""
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.parameters}
    if tool.description:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def tool_fields(settings: LLMSettings, tools: list[PromptMessageTool] | None,
                parameters: dict[str, Any]) -> dict[str, Any]:
    """tools, tool_choice and parallel_tool_calls for a chat call ({} without tools)."""
    if not tools:
        return {}
    choice = parameters.get(TOOL_CHOICE) or "auto"
    if choice not in TOOL_CHOICES:
        raise ValueError(f"{TOOL_CHOICE} must be one of {', '.join(TOOL_CHOICES)}, got {choice!r}")
    fields: dict[str, Any] = {"tools": [openai_tool(t) for t in tools], "tool_choice": choice}
    if not settings.parallel_tool_calls:
        fields["parallel_tool_calls"] = False
    return fields


def thinking_fields(parameters: dict[str, Any]) -> dict[str, Any]:
    """chat_template_kwargs for the thinking switch ({} when it is not set)."""
    enable = parameters.get(ENABLE_THINKING)
    return {} if enable is None else {"chat_template_kwargs": {"enable_thinking": bool(enable)}}


def response_format_of(parameters: dict[str, Any]) -> dict[str, Any] | None:
    """OpenAI's response_format from the response_format and json_schema parameters (None: free text)."""
    kind = parameters.get(RESPONSE_FORMAT) or None
    schema_text = parameters.get(JSON_SCHEMA)
    schema_text = schema_text.strip() if isinstance(schema_text, str) else schema_text
    if kind is None and schema_text:
        kind = "json_schema"
    if kind in (None, "text", "json_object") and schema_text:
        raise ValueError(f"{JSON_SCHEMA} is set but {RESPONSE_FORMAT} is {kind}: set {RESPONSE_FORMAT} to "
                         f"json_schema to use the schema, or clear the schema")
    if kind is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise ValueError(f"{RESPONSE_FORMAT} must be one of text, json_object, json_schema, got {kind!r}")
    if not schema_text:
        raise ValueError(f"{RESPONSE_FORMAT} json_schema needs the {JSON_SCHEMA} parameter: a JSON schema")
    return {"type": "json_schema", "json_schema": json_schema_object(schema_text)}


def json_schema_object(schema_text: Any) -> dict[str, Any]:
    """OpenAI's json_schema object from the parameter's JSON text: kept as it is when it has a "schema" object
    (OpenAI's shape), else the text is the schema itself and gets Dify's default name."""
    try:
        value = json.loads(schema_text) if isinstance(schema_text, str) else schema_text
    except ValueError as e:
        raise ValueError(f"{JSON_SCHEMA} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{JSON_SCHEMA} must be a JSON object (a JSON schema), got {type(value).__name__}")
    if isinstance(value.get("schema"), dict):
        return value
    return {"name": DEFAULT_SCHEMA_NAME, "schema": value}
