"""OpenAI request models (pydantic, the HTTP edge only) and their translation into SamplingParams."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvgate.engine.sampling_params import RequestOutputKind, SamplingParams

# fields of the OpenAI API that kvgate does not implement yet: a 400 that names them, never a silent drop
UNSUPPORTED_FIELDS = ("tools", "tool_choice", "functions", "function_call", "logit_bias", "suffix", "audio",
                      "modalities", "prediction", "parallel_tool_calls", "web_search_options")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ContentPart(BaseModel):
    """A part of a message's content. Parts other than text (image_url, input_audio, file) parse, so that the
    gateway can refuse them with a message that says so (ChatMessage.text)."""
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

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


class _Common(BaseModel):
    """Sampling fields shared by chat and completions (OpenAI's, then vLLM's extras)."""
    model_config = ConfigDict(extra="forbid")
    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    priority: int | None = None  # kvgate: 0-100, higher first (vLLM's body priority is lower-first)
    # vLLM extras
    top_k: int | None = None  # None here and below: the model's generation config, else vLLM's default
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # accepted and ignored: they do not change what is generated
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    response_format: dict[str, Any] | None = None
    # rejected with a clear message (see UNSUPPORTED_FIELDS)
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    logit_bias: Any = None
    parallel_tool_calls: Any = None

    def unsupported(self) -> str | None:
        for name in UNSUPPORTED_FIELDS:
            if getattr(self, name, None) not in (None, [], {}):
                return name
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            return "response_format"
        return None

    def sampling_params(self, max_tokens: int, logprobs: int | None, defaults: dict[str, Any]) -> SamplingParams:
        """`defaults` (the model's generation config) fill in the sampling fields this request left out."""
        def pick(name: str, fallback: float) -> Any:
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, fallback)

        return SamplingParams(
            n=self.n, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0), top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0), seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=pick("repetition_penalty", 1.0), logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens, include_stop_str_in_output=self.include_stop_str_in_output,
            output_kind=RequestOutputKind.DELTA)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self, max_tokens: int, defaults: dict[str, Any]) -> SamplingParams:
        return self.sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None, defaults)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = None  # None: the generation config's, else --max-tokens-default, else 16 (OpenAI's)
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: Any = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def to_sampling_params(self, max_tokens: int, defaults: dict[str, Any]) -> SamplingParams:
        return self.sampling_params(max_tokens, self.logprobs, defaults)

    def prompts(self) -> list[str | list[int]]:
        return one_by_one(self.prompt)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings: OpenAI's fields, kvgate's `priority` and vLLM's `normalize` (None: the model's
    pooler config decides). `input`: a string, a list of strings, a list of token ids, or a list of lists of
    token ids; each is embedded on its own."""
    model_config = ConfigDict(extra="forbid")
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    priority: int | None = None  # kvgate: 0-100, higher first (read by the app, like chat's)
    normalize: bool | None = None

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
