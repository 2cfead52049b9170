"""Tools in a chat request, as vLLM's OpenAI server serves them: what the chat template gets (`tools=`, and the
history's assistant tool_calls and tool results), what tool_choice means (ToolPlan), and the guided-decoding
schemas of the forced choices.

tool_choice (default "auto" when tools are given, else "none"):
- "none": the template gets no tools; the output is content.
- "auto": the template gets the tools; the model's text goes through the model's tool-call parser
  (`--enable-auto-tool-choice --tool-call-parser NAME`), which turns the calls it finds into tool_calls.
- a named function: guided decoding to that function's parameters schema; the output is its arguments.
- "required": guided decoding to a JSON array of {"name", "parameters"} objects (at least one; at most one when
  parallel_tool_calls is false), each name with its own parameters schema; the output is the calls.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvgate.engine.structured_output.params import StructuredOutputsParams
from kvgate.gateway.errors import APIError
from kvgate.gateway.protocol import ChatCompletionRequest, ChatMessage
from kvgate.gateway.structured_outputs import check_json_schema
from kvgate.gateway.tool_parsers import ToolParser, ToolParserManager
from kvgate.gateway.tool_parsers.forced_tool_calls import NamedToolCall, RequiredToolCalls

NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
DEFINITION_KEYS = ("$defs", "definitions")  # local definitions: "#/$defs/X" refs resolve from the schema's root


@dataclass
class ToolPlan:
    """What a chat request's tools and tool_choice mean for one served model: `mode` ("none", "auto", "named",
    "required"), the tools the chat template gets (None: none), the guided decoding of a forced choice, the named
    function, the parser of "auto" and the most calls kept (1 when parallel_tool_calls is false)."""
    mode: str = "none"
    template_tools: list[dict[str, Any]] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    named: str | None = None
    parser: type[ToolParser] | None = None
    max_calls: int | None = None

    def output_parser(self, tokenizer: Any) -> ToolParser | NamedToolCall | RequiredToolCalls | None:
        """A new parser for one choice's output (None: the output is content as it is)."""
        if self.mode == "auto" and self.parser is not None:
            return self.parser(tokenizer, max_calls=self.max_calls)
        if self.mode == "named":
            return NamedToolCall(self.named or "")
        if self.mode == "required":
            return RequiredToolCalls()
        return None


def plan_tools(req: ChatCompletionRequest, parser: type[ToolParser] | None, enable_auto: bool) -> ToolPlan:
    """The request's ToolPlan for a model served with `parser` (--tool-call-parser) and `enable_auto`
    (--enable-auto-tool-choice); a 400 naming the problem for tools or a tool_choice it cannot serve."""
    tools = req.tools or []
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if not tools:
        if choice != "none":
            shown = choice if isinstance(choice, str) else f"naming {choice.function.name!r}"
            raise APIError(400, f"tool_choice {shown} needs tools, and the request gives none", "tool_choice")
        return ToolPlan()
    seen: dict[str, int] = {}
    for i, t in enumerate(tools):
        name = t.function.name
        if not name:
            raise APIError(400, f"tools[{i}].function.name is empty: every function needs a name", "tools")
        if name in seen:
            raise APIError(400, f"tools[{i}].function.name {name!r} is given twice (also tools[{seen[name]}]): "
                                "function names must be unique", "tools")
        seen[name] = i
        if t.function.parameters is not None:
            check_json_schema(t.function.parameters, f"tools[{i}].function.parameters")
    if choice == "none":
        return ToolPlan()
    template_tools = [t.model_dump(exclude_none=True) for t in tools]
    parallel = req.parallel_tool_calls is not False
    if choice == "auto":
        if not enable_auto or parser is None:
            raise APIError(400, 'tool_choice "auto" (the default when tools are given) needs the model served with '
                                "--enable-auto-tool-choice and --tool-call-parser NAME (registered: "
                                f"{', '.join(ToolParserManager.list_registered())}); or send tool_choice "
                                '"required", a named function or "none"', "tool_choice")
        return ToolPlan("auto", template_tools, parser=parser, max_calls=None if parallel else 1)
    if choice == "required":
        return ToolPlan("required", template_tools, StructuredOutputsParams(json=required_schema(req, parallel)))
    name = choice.function.name  # type: ignore[union-attr]
    if name not in seen:
        raise APIError(400, f"tool_choice names function {name!r}, which is not in tools (they are: "
                            f"{', '.join(seen)})", "tool_choice")
    params = tools[seen[name]].function.parameters
    return ToolPlan("named", template_tools, StructuredOutputsParams(json=params or NO_PARAMETERS), named=name)


def required_schema(req: ChatCompletionRequest, parallel: bool) -> dict[str, Any]:
    """The JSON schema of tool_choice "required" (vLLM's): an array of one or more (at most one unless
    `parallel`) {"name": NAME, "parameters": NAME's parameters} objects. The tools' local definitions ($defs,
    definitions) move to the root, where their "#/$defs/..." references point; a name two tools define
    differently is a 400."""
    hoisted: dict[str, dict[str, Any]] = {}
    items = []
    for i, t in enumerate(req.tools or []):
        params = dict(t.function.parameters or NO_PARAMETERS)
        for key in DEFINITION_KEYS:
            defs = params.pop(key, None)
            if not isinstance(defs, dict):
                continue
            into = hoisted.setdefault(key, {})
            for def_name, definition in defs.items():
                if def_name in into and into[def_name] != definition:
                    raise APIError(400, f"tools[{i}].function.parameters.{key}.{def_name} differs from another "
                                        f"tool's {key}.{def_name}: tool_choice \"required\" needs one meaning per "
                                        "definition name", "tools")
                into[def_name] = definition
        items.append({"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                       "parameters": params},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return {**schema, **hoisted}


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The conversation as the chat template reads it (HF's format): role and content (text), tool_calls with their
    arguments as objects (what Qwen, Llama and Mistral templates expect), tool_call_id, an assistant's
    reasoning_content. As in vLLM, what a message may carry is the template's to judge (a tool result without
    tool_call_id is refused by templates that need one, as a 400); a 400 naming the message for arguments that are
    not the JSON text of an object, or content a text model cannot read."""
    out = []
    for i, m in enumerate(messages):
        try:
            d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text(i)}
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            d["tool_calls"] = [_template_call(i, j, c) for j, c in enumerate(m.tool_calls)]
        if m.reasoning_content is not None and m.role == "assistant":
            d["reasoning_content"] = m.reasoning_content
        out.append(d)
    return out


def _template_call(i: int, j: int, call: Any) -> dict[str, Any]:
    args = call.function.arguments
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            args = None
        if not isinstance(args, dict):
            raise APIError(400, f"messages[{i}].tool_calls[{j}].function.arguments must be the JSON text of an "
                                "object", "messages")
    d: dict[str, Any] = {"type": "function", "function": {"name": call.function.name, "arguments": args}}
    if call.id is not None:
        d["id"] = call.id
    return d
