"""Dify's prompt messages as kvgate's OpenAI bodies: chat messages, or one prompt string in completion mode."""
from __future__ import annotations

from dify_plugin.entities.model.message import (
    PromptMessage,
    PromptMessageContentType,
    PromptMessageRole,
)

# kvgate's chat endpoint takes these roles (developer is read as system)
_ROLES = {PromptMessageRole.SYSTEM: "system", PromptMessageRole.USER: "user",
          PromptMessageRole.ASSISTANT: "assistant"}
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


def chat_messages(prompt_messages: list[PromptMessage]) -> list[dict[str, str]]:
    """OpenAI chat messages; tool messages are refused (this provider declares no tool calling)."""
    if not prompt_messages:
        raise ValueError("at least one prompt message is needed")
    messages = []
    for message in prompt_messages:
        role = _ROLES.get(message.role)
        if role is None:
            raise ValueError(f"{message.role.value} messages are not supported: kvgate has no tool calling yet "
                             f"(roles: system, user, assistant)")
        messages.append({"role": role, "content": message_text(message)})
    return messages


def completion_prompt(prompt_messages: list[PromptMessage]) -> str:
    """Completion mode: Dify sends the whole prompt as one message; several are joined by blank lines."""
    if not prompt_messages:
        raise ValueError("at least one prompt message is needed")
    return "\n\n".join(message_text(m) for m in prompt_messages)
