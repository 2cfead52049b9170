"""Tool-call parsers: how `tool_choice: "auto"` finds calls in a model's output, one format per file, registered
by name (`--tool-call-parser NAME`). Built-in: hermes, llama3_json, mistral. Add a format with a ToolParser
subclass decorated with `@ToolParserManager.register_module("my_format")`, imported before the server starts."""
from kvgate.gateway.tool_parsers.abstract_tool_parser import (
    ToolParser,
    ToolParserManager,
)
from kvgate.gateway.tool_parsers.hermes_tool_parser import HermesToolParser
from kvgate.gateway.tool_parsers.llama3_json_tool_parser import Llama3JsonToolParser
from kvgate.gateway.tool_parsers.mistral_tool_parser import MistralToolParser

__all__ = ["HermesToolParser", "Llama3JsonToolParser", "MistralToolParser", "ToolParser", "ToolParserManager"]
