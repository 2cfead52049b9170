"""Dify's prompt messages as kvgate's OpenAI bodies: chat messages (with tool calls and tool results), or one prompt
string in completion mode."""
from __future__ import annotations

from typing import Any

from dify_plugin.entities.model.message import (
    AssistantPromptMessage,
    PromptMessage,
    PromptMessageContentType,
    PromptMessageRole,
)

# kvgate's chat endpoint takes these roles (developer is read as system)
_ROLES = {PromptMessageRole.SYSTEM: "system", PromptMessageRole.USER: "user",
          PromptMessageRole.ASSISTANT: "assistant", PromptMessageRole.TOOL: "tool"}
_DEVELOPER = getattr(PromptMessageRole, "DEVELOPER", None)
if _DEVELOPER is not None:
    _ROLES[_DEVELOPER] = "developer"


def message_text(message: PromptMessage) -> str:
    """The text of a message; kvgate serves text-only models, so images, audio, video and files are refused."""
    content = message.content
    if content is None or isinstance(content, str):
        return content or ""
    parts: list[str] = []
    for part in content:
        if part.type != PromptMessageContentType.TEXT:
            raise ValueError(f"kvgate serves text-only models: a {part.type.value} part in a "
                             f"{message.role.value} message cannot be sent (only text content is supported)")
        parts.append(part.data)
    return "".join(parts)


def _tool_call(call: AssistantPromptMessage.ToolCall) -> dict[str, Any]:
    """A call of the history in OpenAI's shape; its arguments stay the JSON text Dify keeps."""
    out: dict[str, Any] = {"type": "function",
                           "function": {"name": call.function.name, "arguments": call.function.arguments}}
    if call.id:
        out["id"] = call.id
    return out


def chat_message(message: PromptMessage) -> dict[str, Any]:
    """One OpenAI chat message: a tool result carries the id of the call it answers; an assistant message carries
    the calls it made (its content is null when it has only calls, as OpenAI sends it)."""
    role = _ROLES.get(message.role)
    if role is None:
        raise ValueError(f"{message.role.value} messages are not supported (roles: {', '.join(_ROLES.values())})")
    out: dict[str, Any] = {"role": role, "content": message_text(message)}
    if role == "tool":
        out["tool_call_id"] = getattr(message, "tool_call_id", None) or None
    elif role == "assistant" and getattr(message, "tool_calls", None):
        out["tool_calls"] = [_tool_call(c) for c in message.tool_calls]
        out["content"] = out["content"] or None
    return out


def chat_messages(prompt_messages: list[PromptMessage]) -> list[dict[str, Any]]:
    """The conversation as OpenAI chat messages."""
    if not prompt_messages:
        raise ValueError("at least one prompt message is needed")
    return [chat_message(m) for m in prompt_messages]


def completion_prompt(prompt_messages: list[PromptMessage]) -> str:
    """Completion mode: Dify sends the whole prompt as one message; several are joined by blank lines."""
    if not prompt_messages:
        raise ValueError("at least one prompt message is needed")
    return "\n\n".join(message_text(m) for m in prompt_messages)
