"""An LLM's own credentials on top of the shared ones (models/common/settings.py): the completion mode, the largest
max_tokens a Dify user may pick, and which of Dify's LLM features the admin turned on for this model (function
calling, streamed tool calls, structured output, thinking).

The feature fields are selects in the form (provider/kvgate.yaml); their values are Dify's openai_api_compatible
provider's where that provider has the same field. They say what Dify may use; the gateway must serve the model
accordingly (see dify_plugin/README.md). Tool calling and the thinking switch need chat mode: /v1/completions takes
neither tools nor chat_template_kwargs, so a completion-mode model with them on is refused here, when it is saved.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from models.common.settings import GatewaySettings, text, whole

MODES = ("chat", "completion")
# function_calling_type: tool_call = OpenAI tools, several calls per turn (parallel_tool_calls left at its default,
# true); single_tool_call = at most one call per turn (parallel_tool_calls false); no_call = none
FUNCTION_CALLING = ("no_call", "tool_call", "single_tool_call")
SUPPORT = ("supported", "not_supported")
# agent_thought_support: supported = a hybrid model (thinking on or off, e.g. Qwen3): a "Thinking mode" switch;
# only_thinking_supported = it always thinks; not_supported = it never does
THINKING = ("not_supported", "supported", "only_thinking_supported")


def choice(credentials: Mapping[str, Any], key: str, allowed: tuple[str, ...], default: str) -> str:
    """A select field's value (`default` when empty); ValueError listing `allowed` otherwise."""
    value = text(credentials, key) or default
    if value not in allowed:
        raise ValueError(f"{key} must be one of {', '.join(allowed)}, got {value!r}")
    return value


@dataclass(frozen=True)
class LLMSettings(GatewaySettings):
    """What the plugin needs to call one LLM on one kvgate gateway."""

    mode: str  # "chat" or "completion"
    max_tokens: int  # the largest max_tokens a Dify user may pick, at most context_size
    function_calling: str  # one of FUNCTION_CALLING (function_calling_type)
    stream_tool_calls: bool  # Dify may stream a call with tools (stream_function_calling)
    structured_output: bool  # the response_format / json_schema parameters (structured_output_support)
    thinking: str  # one of THINKING (agent_thought_support)

    @property
    def tool_calls(self) -> bool:
        """Function calling is on (Dify may pass tools)."""
        return self.function_calling != "no_call"

    @property
    def parallel_tool_calls(self) -> bool:
        """Several calls per turn (function_calling_type tool_call); one per turn otherwise."""
        return self.function_calling == "tool_call"

    @property
    def thinking_switch(self) -> bool:
        """The "Thinking mode" parameter is offered (a hybrid thinking model)."""
        return self.thinking == "supported"

    @classmethod
    def type_fields(cls, credentials: Mapping[str, Any], common: Mapping[str, Any]) -> dict[str, Any]:
        mode = choice(credentials, "mode", MODES, "chat")
        context_size = common["context_size"]
        max_tokens = whole(credentials, "max_tokens_to_sample", context_size, "a whole number of tokens >= 1")
        if not 1 <= max_tokens <= context_size:
            raise ValueError(f"max_tokens_to_sample must be in [1, context_size={context_size}], got {max_tokens}")
        fields = {
            "mode": mode, "max_tokens": max_tokens,
            "function_calling": choice(credentials, "function_calling_type", FUNCTION_CALLING, "no_call"),
            "stream_tool_calls": choice(credentials, "stream_function_calling", SUPPORT, "supported") == "supported",
            "structured_output": choice(credentials, "structured_output_support", SUPPORT,
                                        "not_supported") == "supported",
            "thinking": choice(credentials, "agent_thought_support", THINKING, "not_supported"),
        }
        if mode == "completion":
            if fields["function_calling"] != "no_call":
                raise ValueError(f"function_calling_type {fields['function_calling']} needs mode chat: tools go "
                                 "through /v1/chat/completions (/v1/completions has no tools)")
            if fields["thinking"] == "supported":
                raise ValueError("agent_thought_support supported (a thinking-mode switch, sent as "
                                 "chat_template_kwargs) needs mode chat: /v1/completions applies no chat template")
        return fields
