"""Small helpers of the Dify plugin tests (dify venv only): credentials as Dify's form sends them, prompts with a
unique marker (to find a request in the engine's record), calls straight to the gateway to compare with."""
from __future__ import annotations

import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx
from dify_plugin.entities.model.llm import LLMResultChunk, LLMUsage
from dify_plugin.entities.model.message import (
    AssistantPromptMessage,
    PromptMessage,
    PromptMessageTool,
    SystemPromptMessage,
    UserPromptMessage,
)

REPO = Path(__file__).resolve().parents[2]
PLUGIN_DIR = REPO / "dify_plugin"
MODEL = "tiny"  # the name kvgate_server.py serves the tiny model under
EMBED_MODEL = "tiny-embed"  # the name its embed gateway serves the tiny embedding model under
CONTEXT = 512  # the tiny models' context length
EMBED_WINDOW_MS = 100  # the embedding tests' batching window: every input of a request shares one engine step
TOOLS_MODEL = "tiny-tools"  # the tools gateway's model: a tools chat template, hermes tool-call parser
THINK_MODEL = "tiny-think"  # the same engine with a reasoning parser (deepseek_r1) as well
TOOLS_CONTEXT = 2048  # the tool model's context length
# Dify tools whose arguments guided decoding keeps short (an enum, a bounded pattern): tests/tool_helpers.py's
WEATHER = PromptMessageTool(name="get_weather", description="The current weather in a city", parameters={
    "type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"},
                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False})
TIME = PromptMessageTool(name="get_time", description="The time in a time zone", parameters={
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False})
TOOLS = [WEATHER, TIME]
GUIDED_MAX_TOKENS = 400  # the tiny tokenizer spends a token on every character or two of JSON


def credentials(url: str, **overrides: Any) -> dict[str, str]:
    """A model's credentials the way Dify sends them: every value a string."""
    form = {"vllm_endpoint": url, "mode": "chat", "context_size": str(CONTEXT), "max_tokens_to_sample": "256",
            "timeout": "60", "max_batch_delay": "50", "priority": "50"}
    form.update({k: str(v) for k, v in overrides.items()})
    return form


def tools_credentials(url: str, **overrides: Any) -> dict[str, str]:
    """A tool-calling model's credentials: function calling (several calls per turn), streamed tool calls and
    structured output on, as an admin sets them for a model kvgate serves with a tool-call parser."""
    form = {"context_size": TOOLS_CONTEXT, "max_tokens_to_sample": 1024, "function_calling_type": "tool_call",
            "stream_function_calling": "supported", "structured_output_support": "supported"}
    return credentials(url, **{**form, **overrides})


def embedding_credentials(url: str, **overrides: Any) -> dict[str, str]:
    """An embedding model's credentials as Dify sends them: the LLM-only fields (mode, max_tokens_to_sample) are
    hidden for this model type (show_on) and so never sent. Its batching window is EMBED_WINDOW_MS."""
    form = {"vllm_endpoint": url, "context_size": str(CONTEXT), "max_chunks": "8", "timeout": "60",
            "max_batch_delay": str(EMBED_WINDOW_MS), "priority": "50"}
    form.update({k: str(v) for k, v in overrides.items()})
    return form


def gateway_embeddings(url: str, texts: list[str]) -> dict[str, Any]:
    """The embed gateway's own answer to one /v1/embeddings request (float vectors), batched like the plugin's:
    all texts held EMBED_WINDOW_MS into one engine step (see kvgate_server.py)."""
    body = {"model": EMBED_MODEL, "input": texts, "encoding_format": "float"}
    response = httpx.post(url + "/v1/embeddings", json=body, headers={"X-Max-Batch-Delay-Ms": str(EMBED_WINDOW_MS)},
                          timeout=60)
    response.raise_for_status()
    return response.json()


def marker() -> str:
    return f"marker{uuid.uuid4().hex[:10]}"


def prompt(text: str) -> list[PromptMessage]:
    return [SystemPromptMessage(content="be brief"), UserPromptMessage(content=text)]


def openai_messages(text: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]


def gateway_post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The gateway's own answer, with no batching hold (the main gateway holds requests 30 s by default)."""
    response = httpx.post(url + path, json=body, headers={"X-Max-Batch-Delay-Ms": "0"}, timeout=60)
    response.raise_for_status()
    return response.json()


def joined(chunks: Iterable[LLMResultChunk]) -> tuple[str, LLMUsage | None, str | None, int]:
    """(text, usage of the last chunk, finish reason of the last chunk, number of chunks)."""
    chunks = list(chunks)
    text = "".join(c.delta.message.content or "" for c in chunks)
    return text, chunks[-1].delta.usage, chunks[-1].delta.finish_reason, len(chunks)


def tool_calls(chunks: Iterable[LLMResultChunk]) -> list[AssistantPromptMessage.ToolCall]:
    """Every tool call the chunks carry, in order (Dify's agent runs each one it finds in a chunk)."""
    return [call for c in chunks for call in c.delta.message.tool_calls]
