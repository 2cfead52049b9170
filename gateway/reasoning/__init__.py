"""Reasoning parsers: how `--reasoning-parser NAME` splits a model's thinking (message.reasoning_content) from its
answer (message.content). Built-in: deepseek_r1, qwen3. Add a format with a ReasoningParser subclass decorated with
`@ReasoningParserManager.register_module("my_format")`, imported before the server starts."""
from kvgate.gateway.reasoning.abs_reasoning_parsers import (
    ReasoningParser,
    ReasoningParserManager,
)
from kvgate.gateway.reasoning.deepseek_r1_reasoning_parser import (
    DeepSeekR1ReasoningParser,
)
from kvgate.gateway.reasoning.qwen3_reasoning_parser import Qwen3ReasoningParser

__all__ = ["DeepSeekR1ReasoningParser", "Qwen3ReasoningParser", "ReasoningParser", "ReasoningParserManager"]
