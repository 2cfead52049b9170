"""Tool calling, structured outputs and reasoning at the API, through the real openai client and a real gateway on a
tiny model whose chat template renders tools. The engine answers with recorded model outputs (ScriptedEngine) and
records what it was asked, so these tests check the gateway's side whatever the engine's guided decoding does:
what reaches the template and the engine (StructuredOutputsParams), how outputs become tool_calls and
reasoning_content, streamed and not, and every 400. tests/test_structured_outputs.py runs the same requests on the
real engine."""
from __future__ import annotations

import asyncio
import json
from typing import Any, Iterator

import httpx
import openai
import pytest
from mock_upstream import serving
from tool_helpers import HERMES_TWO_CALLS, TIME, TOOLS, WEATHER, ScriptedEngine, build_tool_model

from kvgate.engine.async_engine import AsyncEngineArgs, AsyncLLMEngine
from kvgate.engine.structured_output.params import StructuredOutputsParams
from kvgate.gateway.app import create_app
from kvgate.gateway.router import ModelRouter
from kvgate.gateway.serving import OpenAIServing

USER = [{"role": "user", "content": "Weather and time in Paris?"}]
ARGS = '{"city": "Paris", "unit": "celsius"}'
MODELS = {  # name -> the gateway's per-model settings
    "auto": {"enable_auto_tool_choice": True, "tool_call_parser": "hermes"},
    "plain": {},
    "think": {"enable_auto_tool_choice": True, "tool_call_parser": "hermes", "reasoning_parser": "qwen3"},
    "r1": {"reasoning_parser": "deepseek_r1"},
}


class Script:
    """What every scripted engine answers next (tests set `text`)."""
    text = "Hello there."


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, ScriptedEngine]]]:
    model = build_tool_model(tmp_path_factory.mktemp("tools") / "model")
    real = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=model, num_gpu_blocks_override=160))
    try:
        asyncio.run(real.wait_until_ready(timeout=60))
        engines = {name: ScriptedEngine(real, lambda sp: Script.text, **settings) for name, settings in MODELS.items()}
        router = ModelRouter()
        for name, e in engines.items():
            router.add_model(name, OpenAIServing(name, e))  # type: ignore[arg-type]
        with serving(create_app(router)) as base:
            yield base, engines
    finally:
        real.shutdown()


@pytest.fixture
def client(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway[0]}/v1", api_key="unused", max_retries=0)


def reassemble(chunks: list[Any]) -> tuple[str, str, list[tuple[str, str]], str | None]:
    """(content, reasoning, [(name, arguments)], finish_reason) of a streamed choice, as an SDK accumulates it."""
    content, reasoning, calls, finish = "", "", {}, None
    for ch in chunks:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        reasoning += getattr(d, "reasoning_content", None) or ""
        for tc in d.tool_calls or []:
            if tc.id is not None:
                assert tc.index not in calls and tc.type == "function" and tc.function.name
                calls[tc.index] = [tc.function.name, tc.function.arguments or ""]
            else:
                assert tc.function.name is None
                calls[tc.index][1] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return content, reasoning, [tuple(calls[i]) for i in sorted(calls)], finish  # type: ignore[misc]


def both(client: openai.OpenAI, **kwargs: Any) -> tuple[Any, tuple]:
    """The non-streamed response and the reassembled stream of the same request."""
    full = client.chat.completions.create(**kwargs)
    return full, reassemble(list(client.chat.completions.create(**kwargs, stream=True)))


def calls_of(message: Any) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def last_request(gateway, model: str) -> tuple[str, Any]:
    prompt, sp = gateway[1][model].requests[-1]
    return gateway[1][model]._engine.tokenizer.decode(prompt), sp


def test_tools_and_the_history_reach_the_chat_template(client: openai.OpenAI, gateway) -> None:
    Script.text = "It is 21 °C and sunny in Paris."
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 °C, sunny"}]
    r = client.chat.completions.create(model="auto", messages=history, tools=TOOLS)
    assert r.choices[0].message.content == Script.text and r.choices[0].finish_reason == "stop"
    assert not r.choices[0].message.tool_calls
    prompt, sp = last_request(gateway, "auto")
    assert "<tools>\n" + json.dumps(WEATHER) + "\n" + json.dumps(TIME) + "\n</tools>" in prompt
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>' in prompt  # an object
    assert "<|im_start|>user\n<tool_response>\n21 °C, sunny\n</tool_response><|im_end|>" in prompt
    assert sp.structured_outputs is None and sp.skip_special_tokens is False  # hermes tags may be special
    Script.text = HERMES_TWO_CALLS
    r = client.chat.completions.create(model="auto", messages=USER, tools=TOOLS, tool_choice="none")
    prompt, sp = last_request(gateway, "auto")
    assert "<tools>" not in prompt and sp.skip_special_tokens is True
    assert r.choices[0].message.content == HERMES_TWO_CALLS and not r.choices[0].message.tool_calls


def test_auto_tool_calls_streamed_equal_the_response(client: openai.OpenAI) -> None:
    Script.text = HERMES_TWO_CALLS
    full, streamed = both(client, model="auto", messages=USER, tools=TOOLS)
    m = full.choices[0].message
    expected = [("get_weather", ARGS), ("get_time", '{"zone": "CET"}')]
    assert m.content == "I will look both up." and calls_of(m) == expected
    assert full.choices[0].finish_reason == "tool_calls"
    assert all(c.id.startswith("call_") and len(c.id) == 29 and c.type == "function" for c in m.tool_calls)
    assert streamed == (m.content, "", expected, "tool_calls")
    one = client.chat.completions.create(model="auto", messages=USER, tools=TOOLS, parallel_tool_calls=False)
    assert calls_of(one.choices[0].message) == expected[:1]
    Script.text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris",}}\n</tool_call>'
    full, streamed = both(client, model="auto", messages=USER, tools=TOOLS)  # malformed: content, as generated
    assert full.choices[0].message.content == Script.text and not full.choices[0].message.tool_calls
    assert streamed == (Script.text, "", [], "stop") and full.choices[0].finish_reason == "stop"
    Script.text = HERMES_TWO_CALLS  # cut off inside the first call by max_tokens: content, "length"
    full, streamed = both(client, model="auto", messages=USER, tools=TOOLS, max_tokens=20)
    assert full.choices[0].finish_reason == "length" and not full.choices[0].message.tool_calls
    assert streamed[0] == full.choices[0].message.content and streamed[2:] == ([], "length")


def test_named_tool_choice_guides_to_the_parameters_and_returns_the_call(client: openai.OpenAI, gateway) -> None:
    Script.text = '{"city":"Paris","unit":"celsius"}'
    named = {"type": "function", "function": {"name": "get_weather"}}
    for model in ("plain", "auto"):  # no parser needed
        full, streamed = both(client, model=model, messages=USER, tools=TOOLS, tool_choice=named)
        _, sp = last_request(gateway, model)
        assert sp.structured_outputs == StructuredOutputsParams(json=WEATHER["function"]["parameters"])
        m = full.choices[0].message
        assert m.content is None and calls_of(m) == [("get_weather", Script.text)]
        assert full.choices[0].finish_reason == "tool_calls" and streamed == ("", "", calls_of(m), "tool_calls")
    no_params = [{"type": "function", "function": {"name": "ping"}}]
    Script.text = "{}"
    r = client.chat.completions.create(model="plain", messages=USER, tools=no_params,
                                       tool_choice={"type": "function", "function": {"name": "ping"}})
    assert last_request(gateway, "plain")[1].structured_outputs.json == {"type": "object", "properties": {}}
    assert calls_of(r.choices[0].message) == [("ping", "{}")]


def test_required_tool_choice_guides_to_an_array_of_calls(client: openai.OpenAI, gateway) -> None:
    Script.text = '[{"name":"get_weather","parameters":{"city":"Paris","unit":"celsius"}},' \
                  '{"name":"get_time","parameters":{"zone":"CET"}}]'
    full, streamed = both(client, model="plain", messages=USER, tools=TOOLS, tool_choice="required")
    schema = last_request(gateway, "plain")[1].structured_outputs.json
    items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                               "parameters": t["function"]["parameters"]},
              "required": ["name", "parameters"], "additionalProperties": False} for t in TOOLS]
    assert schema == {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    expected = [("get_weather", '{"city":"Paris","unit":"celsius"}'), ("get_time", '{"zone":"CET"}')]
    assert calls_of(full.choices[0].message) == expected and full.choices[0].message.content is None
    assert streamed == ("", "", expected, "tool_calls") and full.choices[0].finish_reason == "tool_calls"
    client.chat.completions.create(model="plain", messages=USER, tools=TOOLS, tool_choice="required",
                                   parallel_tool_calls=False)
    assert last_request(gateway, "plain")[1].structured_outputs.json["maxItems"] == 1
    defs = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "integer"}}}
    client.chat.completions.create(model="plain", messages=USER, tool_choice="required",
                                   tools=[{"type": "function", "function": {"name": "f", "parameters": defs}}])
    schema = last_request(gateway, "plain")[1].structured_outputs.json  # local definitions move to the root
    assert schema["$defs"] == {"P": {"type": "integer"}} and "$defs" not in schema["items"]["properties"]["parameters"]


TOOL_ERRORS = [
    ({"model": "plain", "tools": TOOLS}, 'tool_choice "auto" (the default when tools are given) needs the model '
                                         "served with --enable-auto-tool-choice and --tool-call-parser NAME"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice names function 'nope', which is not in tools (they are: get_weather, get_time)"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name 'get_weather' is given twice (also tools[0])"),
    ({"tool_choice": "required"}, "tool_choice required needs tools, and the request gives none"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "invalid tools[0].function.parameters: Input should be a valid dictionary"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}]},
     "tools[0].function.parameters is not a valid JSON schema: 'bogus' is not valid under any of the given schemas"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name is empty"),
    ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "invalid tools[0].type"),
    ({"tool_choice": "any"}, 'tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                             '{"name": NAME}}, got "any"'),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice required and the request's output constraint (response_format, guided_*, structured_outputs) "
     "cannot both apply"),
    ({"messages": USER + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]}]},
     "messages[1].tool_calls[0].function.arguments must be the JSON text of an object"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs may not set tools"),
]


@pytest.mark.parametrize("fields, message", TOOL_ERRORS, ids=[m[:40] for _, m in TOOL_ERRORS])
def test_tool_requests_the_gateway_cannot_serve_get_a_400_naming_the_problem(gateway, fields: dict,
                                                                             message: str) -> None:
    r = httpx.post(f"{gateway[0]}/v1/chat/completions", json={"model": "auto", "messages": USER, **fields})
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"], r.json()
    r = httpx.post(f"{gateway[0]}/v1/completions", json={"model": "auto", "prompt": "x", "tools": TOOLS})
    assert r.status_code == 400 and "tool calling is served on /v1/chat/completions" in r.json()["error"]["message"]


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["n"]}
CONSTRAINTS = [
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}},
     StructuredOutputsParams(json=SCHEMA)),
    ({"response_format": {"type": "text"}}, None),
    ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
    ({"guided_json": json.dumps(SCHEMA)}, StructuredOutputsParams(json=SCHEMA)),
    ({"guided_regex": "[0-9]{3}"}, StructuredOutputsParams(regex="[0-9]{3}")),
    ({"guided_choice": ["yes", "no"]}, StructuredOutputsParams(choice=["yes", "no"])),
    ({"guided_grammar": 'root ::= "a" | "b"'}, StructuredOutputsParams(grammar='root ::= "a" | "b"')),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": False}},
     StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=False)),
    ({"structured_outputs": {"choice": ["a"]}}, StructuredOutputsParams(choice=["a"])),
]


@pytest.mark.parametrize("fields, expected", CONSTRAINTS, ids=[json.dumps(f)[:50] for f, _ in CONSTRAINTS])
def test_structured_output_fields_reach_the_engine_on_chat_and_completions(gateway, fields: dict,
                                                                           expected: StructuredOutputsParams) -> None:
    Script.text = '{"n":3}'
    for path, body in (("chat/completions", {"messages": USER}), ("completions", {"prompt": "Give n"})):
        r = httpx.post(f"{gateway[0]}/v1/{path}", json={"model": "plain", **body, **fields})
        assert r.status_code == 200, r.text
        assert last_request(gateway, "plain")[1].structured_outputs == expected


STRUCTURED_ERRORS = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": "one"}}}}}},
     "response_format.json_schema.schema is not a valid JSON schema: 'one' is not of type 'number' (at "
     "response_format.json_schema.schema.properties.n.minimum)"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     'response_format {"type": "json_schema"} needs json_schema.schema'),
    ({"response_format": {"type": "yaml"}}, "invalid response_format.type: Input should be 'text', 'json_object' or"),
    ({"guided_json": "{not json"}, "guided_json is not valid JSON"),
    ({"guided_json": {"type": 5}}, "guided_json is not a valid JSON schema"),
    ({"guided_choice": []}, "guided_choice is empty: give at least one string"),
    ({"guided_choice": ["a", ""]}, "guided_choice[1] is empty"),
    ({"guided_regex": ""}, "guided_regex is empty: give a regular expression"),
    ({"guided_grammar": ""}, "guided_grammar is empty: give an EBNF grammar"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex and guided_choice each constrain the output"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}},
     "structured_outputs takes exactly one of json, regex, choice, grammar, json_object; got regex, choice"),
    ({"structured_outputs": {"yaml": "a"}}, "unsupported field 'structured_outputs.yaml'"),
]


@pytest.mark.parametrize("fields, message", STRUCTURED_ERRORS, ids=[m[:40] for _, m in STRUCTURED_ERRORS])
def test_invalid_structured_outputs_get_a_400_before_the_engine(gateway, fields: dict, message: str) -> None:
    before = len(gateway[1]["plain"].requests)
    for path, body in (("chat/completions", {"messages": USER}), ("completions", {"prompt": "x"})):
        r = httpx.post(f"{gateway[0]}/v1/{path}", json={"model": "plain", **body, **fields})
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert len(gateway[1]["plain"].requests) == before


def test_reasoning_content_streamed_and_not(client: openai.OpenAI, gateway) -> None:
    Script.text = "<think>\nThe capital of France is Paris.\n</think>\n\nParis."
    for model, reasoning in (("r1", "The capital of France is Paris."), ("think", "The capital of France is Paris.")):
        full, streamed = both(client, model=model, messages=USER)
        m = full.choices[0].message
        assert (m.reasoning_content, m.content) == (reasoning, "Paris.")
        assert streamed == ("Paris.", reasoning, [], "stop")
        tokens = gateway[1][model]._engine.tokenizer.encode(Script.text, add_special_tokens=False)
        assert full.usage.completion_tokens == len(tokens)  # the thinking counts
    Script.text = "Paris."  # qwen3 with thinking off: all content; deepseek_r1: it was all thinking
    assert client.chat.completions.create(model="think", messages=USER).choices[0].message.reasoning_content is None
    assert client.chat.completions.create(model="r1", messages=USER).choices[0].message.content == ""
    Script.text = '{"n":3}'  # guided output holds no thinking: the reasoning parser leaves it alone
    r = client.chat.completions.create(model="r1", messages=USER, extra_body={"guided_json": SCHEMA})
    assert r.choices[0].message.content == '{"n":3}'
    Script.text = "<think>\nA tool is needed.\n</think>\n\n" + HERMES_TWO_CALLS  # then the tool-call parser
    full, streamed = both(client, model="think", messages=USER, tools=TOOLS)
    m = full.choices[0].message
    assert m.reasoning_content == "A tool is needed." and m.content == "I will look both up."
    assert [n for n, _ in calls_of(m)] == ["get_weather", "get_time"] and streamed[:3] == (
        m.content, m.reasoning_content, calls_of(m))


def test_a_remote_deployment_relays_tools_untouched(gateway) -> None:
    Script.text = HERMES_TWO_CALLS
    router = ModelRouter()
    router.add_model("relay", f"{gateway[0]}/v1", upstream_model="auto")
    with serving(create_app(router)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        full, streamed = both(client, model="relay", messages=USER, tools=TOOLS, parallel_tool_calls=False)
        assert calls_of(full.choices[0].message) == [("get_weather", ARGS)]
        assert streamed == ("I will look both up.", "", [("get_weather", ARGS)], "tool_calls")


def test_a_parser_name_that_is_not_registered_is_refused_where_the_serving_is_built(gateway) -> None:
    engine = gateway[1]["plain"]
    for settings, message in (({"tool_call_parser": "nope"}, "tool_call_parser must be a registered tool-call "
                                                             "parser (hermes, llama3_json, mistral), got 'nope'"),
                              ({"reasoning_parser": "nope"}, "reasoning_parser must be a registered reasoning "
                                                             "parser (deepseek_r1, qwen3), got 'nope'")):
        with pytest.raises(ValueError) as e:
            OpenAIServing("x", ScriptedEngine(engine._engine, lambda sp: "", **settings))  # type: ignore[arg-type]
        assert str(e.value) == message


def test_openapi_documents_the_new_fields(gateway) -> None:
    spec = httpx.get(f"{gateway[0]}/openapi.json").json()
    chat = spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"tools", "tool_choice", "parallel_tool_calls", "response_format", "guided_json",
            "structured_outputs"} <= set(chat)


def test_a_config_file_names_the_key_of_a_parser_that_is_not_registered(tiny_llama: str) -> None:
    from kvgate.gateway.config import ConfigError, parse_config

    model = {"name": "a", "model": tiny_llama, "enable_auto_tool_choice": True, "tool_call_parser": "hermes",
             "reasoning_parser": "qwen3"}
    spec = parse_config({"models": [model]}).models[0].deployments[0].engine_args
    assert (spec["tool_call_parser"], spec["reasoning_parser"], spec["enable_auto_tool_choice"]) == (
        "hermes", "qwen3", True)
    for key, value, message in (
            ("tool_call_parser", "nope", "models[0].tool_call_parser: must be a registered tool-call parser (hermes, "
                                         "llama3_json, mistral), got 'nope'"),
            ("reasoning_parser", "r2", "models[0].reasoning_parser: must be a registered reasoning parser "
                                       "(deepseek_r1, qwen3), got 'r2'"),
            ("tool_call_parser", None, "models[0].enable_auto_tool_choice: needs tool_call_parser")):
        with pytest.raises(ConfigError) as e:
            parse_config({"models": [{**model, key: value}]})
        assert message in str(e.value)


PLUGIN = '''
from kvgate.gateway.tool_parsers import ToolParser, ToolParserManager
from kvgate.gateway.tool_parsers.utils import TextPiece


@ToolParserManager.register_module("plugin_upper")
class Upper(ToolParser):  # a made-up format: the whole output, upper-cased, as content
    def parse(self, final):
        text = self.take(len(self.buffer)) if final else ""
        return [TextPiece(text.upper())] if text else []
'''


def test_a_parser_plugin_file_registers_a_format_before_the_models_are_checked(tiny_llama: str, tmp_path) -> None:
    from kvgate.gateway.config import ConfigError, load_config
    from kvgate.gateway.tool_parsers import ToolParserManager

    (tmp_path / "my_parsers.py").write_text(PLUGIN)
    config = tmp_path / "config.yaml"
    config.write_text(f"tool_parser_plugin: my_parsers.py\nmodels:\n  - name: a\n    model: {tiny_llama}\n"
                      "    enable_auto_tool_choice: true\n    tool_call_parser: plugin_upper\n")
    try:
        cfg = load_config(str(config))  # the relative path is the config file's
        assert cfg.models[0].deployments[0].engine_args["tool_call_parser"] == "plugin_upper"
        assert ToolParserManager.get_tool_parser("plugin_upper")().extract_tool_calls("hi").content == "HI"
    finally:
        ToolParserManager.tool_parsers.pop("plugin_upper", None)
    with pytest.raises(ConfigError, match="--tool-parser-plugin: no such file: .*nothing.py"):
        load_config(None, {"tool_parser_plugin": str(tmp_path / "nothing.py")})
    (tmp_path / "broken.py").write_text("raise RuntimeError('no luck')\n")
    with pytest.raises(ConfigError, match="importing .*broken.py failed: RuntimeError: no luck"):
        load_config(None, {"tool_parser_plugin": str(tmp_path / "broken.py")})
