"""Helpers for the tool-calling and structured-output tests: a Qwen-style chat template that renders tools, tool
calls and tool results (written into a copy of a tiny model), a ScriptedEngine that answers with recorded model
outputs (so the gateway side runs end to end without depending on what a random model generates), and the
tools and outputs the tests share."""
from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from tiny_models import build_tiny_model

from kvgate.engine.outputs import CompletionOutput, RequestOutput
from kvgate.engine.sampling_params import SamplingParams

# Qwen2.5's tool template, shortened: tools listed in the system turn, calls as <tool_call> JSON, results as
# <tool_response> in a user turn
TOOLS_TEMPLATE = """
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- '# Tools\n<tools>' }}
{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\n</tools>\nFor each call, return <tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}' }}
{{- '\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\n' + message.content }}{%- endif %}
{%- for call in message.tool_calls %}
{{- '\n<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' + (call.function.arguments | tojson) }}
{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
        "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]

# what models of each format answer (recorded shapes: Qwen2.5 / Hermes 3, Llama 3.1, Mistral)
HERMES_TWO_CALLS = ('I will look both up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                    '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": '
                    '"CET"}}\n</tool_call>')


def build_tool_model(dst: str | Path, arch: str = "qwen3") -> str:
    """A tiny random model whose chat template renders tools (TOOLS_TEMPLATE), with 2048 positions: the tiny
    tokenizer spends a token on every few characters of JSON, and tool schemas are long."""
    build_tiny_model(dst, arch, max_position_embeddings=2048)
    (Path(dst) / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    return str(dst)


class ScriptedEngine:
    """A loaded AsyncLLMEngine that answers every request with `reply(sampling_params)` (a recorded model output)
    instead of generating: the text's tokens (the model's tokenizer) one per output, finished with "stop", or
    with "length" at max_tokens. Everything else (config, tokenizer, readiness, shutdown) is the real engine's;
    `args` are its args with `overrides` (the gateway's per-model settings). `requests` records (prompt ids,
    SamplingParams) of every request."""

    def __init__(self, engine: Any, reply: Callable[[SamplingParams], str], **overrides: Any) -> None:
        self._engine, self.reply = engine, reply
        self.args = dataclasses.replace(engine.args, **overrides)
        self.requests: list[tuple[list[int], SamplingParams]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, prompt: dict, sp: SamplingParams, request_id: str, priority: int = 50,
                       max_batch_delay: float | None = None) -> AsyncIterator[RequestOutput]:
        prompt_ids = list(prompt["prompt_token_ids"])
        self.requests.append((prompt_ids, sp))
        tok = self._engine.tokenizer
        ids = tok.encode(self.reply(sp), add_special_tokens=False)
        n = len(ids) if sp.max_tokens is None else min(len(ids), sp.max_tokens)
        sent = ""
        for k in range(n):
            last = k == n - 1
            text = tok.decode(ids[:k + 1], skip_special_tokens=sp.skip_special_tokens)
            delta = "" if text.endswith("\ufffd") and not last else text[len(sent):]
            sent += delta
            finish = ("length" if n < len(ids) else "stop") if last else None
            outs = [CompletionOutput(i, delta, [ids[k]], finish_reason=finish) for i in range(sp.n)]
            yield RequestOutput(request_id, None, prompt_ids, outs, finished=last)
            await asyncio.sleep(0)
