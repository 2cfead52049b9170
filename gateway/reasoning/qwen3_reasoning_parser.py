"""qwen3: Qwen3 (hybrid thinking). An output that starts with `<think>` has its reasoning up to `</think>`, the
rest is content; one that does not (thinking off: `enable_thinking: false` in chat_template_kwargs, or `/no_think`)
is all content:

    <think>
    Paris is the capital of France.
    </think>

    Paris."""
from __future__ import annotations

from kvgate.gateway.reasoning.abs_reasoning_parsers import (
    ReasoningParser,
    ReasoningParserManager,
)


@ReasoningParserManager.register_module("qwen3")
class Qwen3ReasoningParser(ReasoningParser):
    starts_in_reasoning = False
