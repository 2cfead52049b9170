"""Structured outputs at the API: a request's response_format (OpenAI's), guided_json / guided_regex /
guided_choice / guided_grammar (vLLM's extras) or structured_outputs (vLLM's newer field) as the engine's
StructuredOutputsParams (engine/structured_output/params.py), on chat and completions.

What the gateway can judge is judged here, before anything reaches the engine, with a 400 that names the field: a
JSON schema must pass its meta-schema (the `jsonschema` package), a choice list must hold non-empty strings, a
regex or grammar must not be empty, and a request gives at most one constraint. What only the grammar library can
judge (a regex it cannot compile, a schema feature it does not support) comes back from the engine as a ValueError,
which the serving answers with a 400 too."""
from __future__ import annotations

import functools
import json
from typing import Any

import jsonschema

from kvgate.engine.structured_output.params import StructuredOutputsParams
from kvgate.gateway.errors import APIError
from kvgate.gateway.protocol import ChatCompletionRequest, CompletionRequest

MAX_MESSAGE = 300  # characters of a schema error's own message in ours


def check_json_schema(schema: Any, param: str) -> dict[str, Any]:
    """`schema` (a dict, or the JSON text of one) as a dict that its meta-schema accepts (draft 2020-12 unless its
    `$schema` names another draft); else a 400 naming `param` and what is wrong where. Verdicts are cached by the
    schema's text: agents send the same tools with every turn, and a check costs about a millisecond."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise APIError(400, f"{param} is not valid JSON: {e}", param) from None
    if not isinstance(schema, dict):
        raise APIError(400, f"{param} must be a JSON schema (a JSON object), got {type(schema).__name__}", param)
    try:
        problem = _schema_problem(json.dumps(schema, sort_keys=True))
    except RecursionError:
        problem = ("is nested too deeply to be checked as a JSON schema", "$")
    if problem is not None:
        what, where = problem
        at = "" if where == "$" else f" (at {where.replace('$', param, 1)})"
        raise APIError(400, f"{param} {what}{at}", param)
    return schema


@functools.lru_cache(maxsize=1024)
def _schema_problem(text: str) -> tuple[str, str] | None:
    """What is wrong with the schema whose JSON text is `text`, and where (a JSON path); None if nothing is."""
    schema = json.loads(text)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        what = e.message if len(e.message) <= MAX_MESSAGE else e.message[:MAX_MESSAGE] + "..."
        return f"is not a valid JSON schema: {what}", e.json_path
    except RecursionError:
        return "is nested too deeply to be checked as a JSON schema", "$"
    except Exception as e:  # noqa: BLE001 - an unusual $schema value, ...
        return f"cannot be checked as a JSON schema: {e}", "$"
    return None


def _text(value: str, param: str, what: str) -> str:
    if not value:
        raise APIError(400, f"{param} is empty: give {what}", param)
    return value


def _choice(value: list[str], param: str) -> list[str]:
    if not value:
        raise APIError(400, f"{param} is empty: give at least one string the output may be", param)
    for k, c in enumerate(value):
        if not c:
            raise APIError(400, f"{param}[{k}] is empty: every choice must be a non-empty string", param)
    return value


def _from_response_format(req: ChatCompletionRequest | CompletionRequest) -> StructuredOutputsParams | None:
    rf = req.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if rf.json_schema is None or rf.json_schema.json_schema is None:
        raise APIError(400, 'response_format {"type": "json_schema"} needs json_schema.schema (a JSON schema)',
                       "response_format")
    return StructuredOutputsParams(json=check_json_schema(rf.json_schema.json_schema,
                                                          "response_format.json_schema.schema"))


def _from_structured_outputs(req: ChatCompletionRequest | CompletionRequest) -> StructuredOutputsParams | None:
    so = req.structured_outputs
    if so is None:
        return None
    given = [k for k, v in (("json", so.json_schema), ("regex", so.regex), ("choice", so.choice),
                            ("grammar", so.grammar), ("json_object", so.json_object)) if v not in (None, False)]
    if len(given) != 1:
        raise APIError(400, "structured_outputs takes exactly one of json, regex, choice, grammar, json_object; got "
                       + (", ".join(given) if given else "none"), "structured_outputs")
    kind, param = given[0], f"structured_outputs.{given[0]}"
    ws = {} if so.disable_any_whitespace is None else {"disable_any_whitespace": so.disable_any_whitespace}
    if kind == "json":
        return StructuredOutputsParams(json=check_json_schema(so.json_schema, param), **ws)
    if kind == "choice":
        return StructuredOutputsParams(choice=_choice(so.choice or [], param), **ws)
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True, **ws)
    what = "a regular expression" if kind == "regex" else "an EBNF grammar"
    return StructuredOutputsParams(**{kind: _text(getattr(so, kind), param, what)}, **ws)


def structured_outputs_of(req: ChatCompletionRequest | CompletionRequest) -> StructuredOutputsParams | None:
    """The request's output constraint (None: free text); a 400 when it gives more than one, or an invalid one."""
    sources: list[tuple[str, Any]] = [
        ("response_format", req.response_format if req.response_format and req.response_format.type != "text"
         else None),
        ("guided_json", req.guided_json), ("guided_regex", req.guided_regex), ("guided_choice", req.guided_choice),
        ("guided_grammar", req.guided_grammar), ("structured_outputs", req.structured_outputs)]
    given = [name for name, value in sources if value is not None]
    if len(given) > 1:
        raise APIError(400, f"{' and '.join(given)} each constrain the output: give only one of them", given[1])
    if not given:
        return None
    name = given[0]
    if name == "response_format":
        return _from_response_format(req)
    if name == "structured_outputs":
        return _from_structured_outputs(req)
    if name == "guided_json":
        return StructuredOutputsParams(json=check_json_schema(req.guided_json, name))
    if name == "guided_choice":
        return StructuredOutputsParams(choice=_choice(req.guided_choice or [], name))
    what = "a regular expression" if name == "guided_regex" else "an EBNF grammar"
    return StructuredOutputsParams(**{name.removeprefix("guided_"): _text(getattr(req, name), name, what)})
