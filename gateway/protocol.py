"""OpenAI request models (pydantic, the HTTP edge only) and their translation into SamplingParams.

Types are strict where OpenAI's API is: a boolean is true or false (not "yes", not 1), an integer is a JSON number
without a fraction (5 or 5.0, as JSON Schema's "integer" has it; not 5.5, not "5", not true), a number is a JSON
number. These models are the ones the embedded backend validates with, and the ones /openapi.json documents.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, StrictBool, StrictInt, ValidationInfo
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

from kvgate.engine.sampling_params import RequestOutputKind, SamplingParams
from kvgate.engine.structured_output.params import StructuredOutputsParams

def as_int(value: Any) -> Any:
    """`value` as an int where it is a JSON integer (an int that is not a bool, or a float without a fraction);
    anything else unchanged, for the strict check to refuse."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int = Annotated[StrictInt, BeforeValidator(as_int)]
Bool = StrictBool
Float = Annotated[float, Strict()]  # a JSON number: an integer is accepted, a string or a boolean is not
MAX_STOP_SEQUENCES = 64  # stop strings per request: each is looked for after every token
PROMPT_SHAPES = "a string, a list of strings, a list of token ids or a list of lists of token ids"


def _prompt_shape(value: Any, info: ValidationInfo) -> Any:
    """One of OpenAI's four prompt shapes, one kind per request (ids are JSON integers), else a 400 that lists
    them. Emptiness is the serving's to judge (it names the empty item)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        if all(isinstance(x, str) for x in value):
            return value
        ids = [as_int(x) for x in value]
        if all(type(x) is int for x in ids):
            return ids
        lists = [[as_int(t) for t in x] if isinstance(x, list) else x for x in value]
        if all(isinstance(x, list) and all(type(t) is int for t in x) for x in lists):
            return lists
    raise PydanticCustomError("prompt_shape", "{field} must be " + PROMPT_SHAPES + " (one kind per request)",
                              {"field": info.field_name})


def _stop_shape(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        if len(value) > MAX_STOP_SEQUENCES:
            raise PydanticCustomError("stop_shape", "stop has {count} strings, more than the limit of {limit}",
                                      {"count": len(value), "limit": MAX_STOP_SEQUENCES})
        return value
    raise PydanticCustomError("stop_shape", "stop must be a string or a list of strings", {})


def doc(default: Any, **bounds: float) -> Any:
    """A field whose bounds are documented in the JSON schema (for /openapi.json and the tools that read it) but
    checked where they are decided, by SamplingParams and the engine, with messages that say the limit."""
    return Field(default, json_schema_extra=bounds)


Unsupported = SkipJsonSchema[Any]  # fields of OpenAI's API refused unless empty: not in the documented schema
PromptInput = Annotated[str | list[str] | list[StrictInt] | list[list[StrictInt]], BeforeValidator(_prompt_shape)]
Stop = Annotated[str | list[str] | None, BeforeValidator(_stop_shape)]

# fields of the OpenAI API that kvgate does not implement: a 400 that names them, never a silent drop
UNSUPPORTED_FIELDS = ("functions", "function_call", "logit_bias", "suffix", "audio", "modalities", "prediction",
                      "web_search_options")
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")  # chat's, refused on /v1/completions
UNSUPPORTED_WHY = {"functions": "use tools", "function_call": "use tool_choice",
                   **{k: "tool calling is served on /v1/chat/completions" for k in TOOL_FIELDS}}
TOOL_CHOICES = 'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": NAME}}'


def _tool_choice_shape(value: Any) -> Any:
    """OpenAI's tool_choice shapes, else a 400 that lists them."""
    if value is None or value in ("none", "auto", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function" and set(value) <= {"type", "function"}:
        f = value.get("function")
        if isinstance(f, dict) and set(f) == {"name"} and isinstance(f["name"], str):
            return value
    raise PydanticCustomError("tool_choice_shape", TOOL_CHOICES + ", got {got}",
                              {"got": json.dumps(value)[:80] if isinstance(value, (str, int, float)) else
                               "an object" if isinstance(value, dict) else "an array" if isinstance(value, list)
                               else "null"})


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: Bool = False
    continuous_usage_stats: Bool = False


class ContentPart(BaseModel):
    """A part of a message's content. Parts other than text (image_url, input_audio, file) parse, so that the
    gateway can refuse them with a message that says so (ChatMessage.text)."""
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str | dict[str, Any]  # OpenAI sends the JSON text; an object is taken too


class ToolCallParam(BaseModel):
    """A call in an assistant message of the history."""
    model_config = ConfigDict(extra="forbid")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # assistant messages: the calls the model made
    tool_call_id: str | None = None  # tool messages: the call this is the result of
    reasoning_content: str | None = None  # assistant messages: what a reasoning parser split off (templates may use it)

    def text(self, index: int = 0) -> str:
        """The content as one string; ValueError (naming the part) for a part kvgate's text models cannot read."""
        if isinstance(self.content, list):
            for j, p in enumerate(self.content):
                if p.type != "text" or p.text is None:
                    what = "has no text" if p.type == "text" else f"has type {p.type!r}"
                    raise ValueError(f"messages[{index}].content[{j}] {what}: kvgate serves text models, which "
                                     f"read only {{\"type\": \"text\", \"text\": ...}} content parts")
            return "".join(p.text for p in self.content)  # type: ignore[misc]
        return self.content or ""


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments (None: no arguments)
    strict: Bool | None = None


class ChatCompletionToolsParam(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class ChatCompletionNamedToolChoiceParam(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Annotated[Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam | None,
                       BeforeValidator(_tool_choice_shape)]


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: Bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, json_object (any JSON object) or json_schema (a JSON schema)."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(BaseModel):
    """vLLM's `structured_outputs` field: exactly one of json (a JSON schema), regex, choice, grammar (EBNF),
    json_object; disable_any_whitespace (default true) keeps generated JSON compact."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_schema: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: Bool | None = None
    disable_any_whitespace: Bool | None = None


class _Common(BaseModel):
    """Sampling fields shared by chat and completions (OpenAI's, then vLLM's extras). `model` may be left out
    when the gateway serves one model (it goes to that one)."""
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    n: Int = doc(1, minimum=1)
    temperature: Float | None = doc(None, minimum=0)
    top_p: Float | None = doc(None, exclusiveMinimum=0, maximum=1)
    stream: Bool = False
    stream_options: StreamOptions | None = None
    stop: Stop = None
    seed: Int | None = None
    presence_penalty: Float = doc(0.0, minimum=-2, maximum=2)
    frequency_penalty: Float = doc(0.0, minimum=-2, maximum=2)
    user: str | None = None
    priority: Int | None = doc(None, minimum=0, maximum=100)  # kvgate: higher first (vLLM's is lower-first)
    # vLLM extras
    top_k: Int | None = doc(None, minimum=-1)  # None here and below: the model's generation config, else vLLM's default
    min_p: Float | None = doc(None, minimum=0, maximum=1)
    repetition_penalty: Float | None = doc(None, exclusiveMinimum=0, maximum=2)
    ignore_eos: Bool = False
    min_tokens: Int = doc(0, minimum=0)
    stop_token_ids: list[Annotated[Int, Field(json_schema_extra={"minimum": 0})]] | None = None
    skip_special_tokens: Bool = True
    include_stop_str_in_output: Bool = False
    # structured outputs (gateway/structured_outputs.py): OpenAI's response_format, vLLM's guided_* and
    # structured_outputs; at most one of them per request
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # accepted and ignored: they do not change what is generated
    store: Bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # rejected with a clear message (see UNSUPPORTED_FIELDS)
    functions: Unsupported = None
    function_call: Unsupported = None
    logit_bias: Unsupported = None

    refused: ClassVar[tuple[str, ...]] = UNSUPPORTED_FIELDS

    def unsupported(self) -> tuple[str, str] | None:
        """(field, message) for the first field of `refused` this request sets, else None."""
        for name in self.refused:
            if getattr(self, name, None) not in (None, [], {}):
                why = UNSUPPORTED_WHY.get(name)
                return name, f"{name!r} is not supported by kvgate" + (f" ({why})" if why else "")
        return None

    def sampling_params(self, max_tokens: int, logprobs: int | None, defaults: dict[str, Any],
                        structured_outputs: StructuredOutputsParams | None = None,
                        skip_special_tokens: bool | None = None) -> SamplingParams:
        """`defaults` (the model's generation config) fill in the sampling fields this request left out;
        `structured_outputs` and `skip_special_tokens` (where not None) are the serving's decisions."""
        def pick(name: str, fallback: float) -> Any:
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, fallback)

        return SamplingParams(
            n=self.n, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0), top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0), seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=pick("repetition_penalty", 1.0), logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens if skip_special_tokens is None else skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, output_kind=RequestOutputKind.DELTA,
            structured_outputs=structured_outputs)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = doc(None, minimum=1)
    max_completion_tokens: Int | None = doc(None, minimum=1)
    logprobs: Bool = False
    top_logprobs: Int | None = doc(None, minimum=0, maximum=20)
    add_generation_prompt: Bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # tool calling (gateway/chat_tools.py); without tool_choice, "auto" when tools are given, else "none"
    tools: list[ChatCompletionToolsParam] | None = None
    tool_choice: ToolChoice = None
    parallel_tool_calls: Bool | None = None  # None: true (OpenAI's default)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self, max_tokens: int, defaults: dict[str, Any], **decided: Any) -> SamplingParams:
        return self.sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None, defaults,
                                    **decided)


class CompletionRequest(_Common):
    prompt: PromptInput
    # max_tokens None: the generation config's, else --max-tokens-default, else 16 (OpenAI's)
    max_tokens: Int | None = doc(None, minimum=1)
    echo: Bool = False
    logprobs: Int | None = doc(None, minimum=0, maximum=20)
    best_of: Int | None = doc(None, minimum=1)
    suffix: Unsupported = None
    tools: Unsupported = None
    tool_choice: Unsupported = None
    parallel_tool_calls: Unsupported = None
    refused: ClassVar[tuple[str, ...]] = UNSUPPORTED_FIELDS + TOOL_FIELDS

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def to_sampling_params(self, max_tokens: int, defaults: dict[str, Any], **decided: Any) -> SamplingParams:
        return self.sampling_params(max_tokens, self.logprobs, defaults, **decided)

    def prompts(self) -> list[str | list[int]]:
        return one_by_one(self.prompt)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: Bool = True
    add_generation_prompt: Bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[Int]


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings: OpenAI's fields, kvgate's `priority` and vLLM's `normalize` (None: the model's
    pooler config decides). `input`: a string, a list of strings, a list of token ids, or a list of lists of
    token ids; each is embedded on its own. `model` may be left out when the gateway serves one model."""
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: PromptInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = doc(None, minimum=1)
    user: str | None = None
    priority: Int | None = doc(None, minimum=0, maximum=100)  # kvgate: higher first (read by the app, like chat's)
    normalize: Bool | None = None

    def inputs(self) -> list[str | list[int]]:
        return one_by_one(self.input)


def one_by_one(x: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """OpenAI's prompt / input one by one: a string or a list of token ids is one, a list of strings or of id
    lists is several."""
    if isinstance(x, str):
        return [x]
    if x and all(isinstance(t, int) for t in x):
        return [list(x)]  # type: ignore[arg-type]
    return list(x)  # type: ignore[arg-type]
