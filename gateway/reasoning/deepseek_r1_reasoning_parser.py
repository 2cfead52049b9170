"""deepseek_r1: DeepSeek-R1 and its distills (and QwQ, Qwen3 *-Thinking-2507: every template that opens the
thinking block in the prompt). The output is reasoning from its start (an opening `<think>` is optional) up to
`</think>`; the rest is content. Without `</think>` (cut off while thinking) it is all reasoning:

    <think>
    The user wants the capital of France. That is Paris.
    </think>

    The capital of France is Paris."""
from __future__ import annotations

from kvgate.gateway.reasoning.abs_reasoning_parsers import (
    ReasoningParser,
    ReasoningParserManager,
)


@ReasoningParserManager.register_module("deepseek_r1")
class DeepSeekR1ReasoningParser(ReasoningParser):
    starts_in_reasoning = True
