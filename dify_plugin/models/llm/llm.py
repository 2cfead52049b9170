"""A kvgate model as a Dify LLM: chat or completion calls, streamed (with the gateway's usage) or blocking.

Every request carries the model's batching window (X-Max-Batch-Delay-Ms) and priority (X-Priority), and every
wait for the gateway is bounded by the model's `timeout` credential. Token counts come from the gateway (its
usage, its /tokenize), never from a tokenizer downloaded at run time.
"""
from __future__ import annotations

from collections.abc import Generator, Mapping
from typing import Any

import httpx
from dify_plugin import LargeLanguageModel
from dify_plugin.entities import I18nObject
from dify_plugin.entities.model import (
    AIModelEntity,
    FetchFrom,
    ModelPropertyKey,
    ModelType,
    ParameterRule,
    ParameterType,
)
from dify_plugin.entities.model.llm import LLMResult, LLMResultChunk, LLMResultChunkDelta, LLMUsage
from dify_plugin.entities.model.message import (
    AssistantPromptMessage,
    PromptMessage,
    PromptMessageTool,
    UserPromptMessage,
)
from dify_plugin.errors.model import CredentialsValidateFailedError, InvokeError

from models.common.client import count_tokens, send
from models.common.errors import INVOKE_ERROR_MAPPING, error_for_exception
from models.llm.messages import chat_messages, completion_prompt
from models.llm.responses import StreamState, blocking_answer, sse_events
from models.llm.settings import LLMSettings

# Dify's parameter name -> the OpenAI field kvgate reads (the same names)
SAMPLING_PARAMETERS = ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty", "max_tokens", "seed")


class KvgateLargeLanguageModel(LargeLanguageModel):
    # ---- invoking ---------------------------------------------------------------------------------------------
    def _invoke(self, model: str, credentials: dict, prompt_messages: list[PromptMessage], model_parameters: dict,
                tools: list[PromptMessageTool] | None = None, stop: list[str] | None = None, stream: bool = True,
                user: str | None = None) -> LLMResult | Generator[LLMResultChunk, None, None]:
        if tools:
            raise ValueError("tool calling is not supported by kvgate yet: remove the tools from this model's use")
        settings = LLMSettings.from_credentials(model, credentials)
        path, body = self._request_body(settings, prompt_messages, model_parameters, stop, stream, user)
        client = settings.client()
        try:  # the answer's status is checked here, so HTTP errors surface through the SDK's error mapping
            response = send(client, settings, path, body, stream)
        except BaseException:
            client.close()
            raise
        if not stream:
            try:
                return self._blocking_result(model, credentials, settings, prompt_messages, response)
            finally:
                client.close()
        return self._stream_chunks(model, credentials, settings, prompt_messages, client, response)

    def _request_body(self, settings: LLMSettings, prompt_messages: list[PromptMessage], parameters: dict,
                      stop: list[str] | None, stream: bool, user: str | None) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {"model": settings.model_name, "stream": stream}
        if settings.mode == "chat":
            path, body["messages"] = "/v1/chat/completions", chat_messages(prompt_messages)
        else:
            path, body["prompt"] = "/v1/completions", completion_prompt(prompt_messages)
        body.update({k: parameters[k] for k in SAMPLING_PARAMETERS if parameters.get(k) is not None})
        if stop:
            body["stop"] = list(stop)
        if user:
            body["user"] = user
        if stream:
            body["stream_options"] = {"include_usage": True}  # the gateway's own token counts end the stream
        return path, body

    def _blocking_result(self, model: str, credentials: dict, settings: LLMSettings,
                         prompt_messages: list[PromptMessage], response: httpx.Response) -> LLMResult:
        try:
            text, _, usage = blocking_answer(response.json(), settings.mode)
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise error_for_exception(ValueError(str(e)), str(response.url), settings.timeout) from e
        return LLMResult(model=model, message=AssistantPromptMessage(content=text),
                         usage=self._usage(model, credentials, settings, prompt_messages, text, usage))

    def _stream_chunks(self, model: str, credentials: dict, settings: LLMSettings,
                       prompt_messages: list[PromptMessage], client: httpx.Client,
                       response: httpx.Response) -> Generator[LLMResultChunk, None, None]:
        """Content chunks as they arrive, then one last chunk with the usage and the finish reason.

        The SDK does not map errors raised while a stream is read, so they are raised here as its types."""
        state, index = StreamState(settings.mode), 0
        try:
            for payload in sse_events(response.iter_lines()):
                text = state.feed(payload)
                if text:
                    yield LLMResultChunk(model=model, delta=LLMResultChunkDelta(
                        index=index, message=AssistantPromptMessage(content=text)))
                    index += 1
            tail = state.finish()
        except InvokeError:
            raise
        except Exception as e:  # noqa: BLE001 - every failure reaches Dify as one of the SDK's error types
            raise error_for_exception(e, str(response.url), settings.timeout) from e
        finally:
            response.close()
            client.close()
        usage = self._usage(model, credentials, settings, prompt_messages, state.text, state.usage)
        yield LLMResultChunk(model=model, delta=LLMResultChunkDelta(
            index=index, message=AssistantPromptMessage(content=tail), usage=usage,
            finish_reason=state.finish_reason or "stop"))

    def _usage(self, model: str, credentials: dict, settings: LLMSettings, prompt_messages: list[PromptMessage],
               text: str, usage: Mapping[str, int] | None) -> LLMUsage:
        """The gateway's usage; an upstream that sent none is counted with the gateway's /tokenize."""
        if usage and usage.get("prompt_tokens") is not None and usage.get("completion_tokens") is not None:
            prompt, completion = int(usage["prompt_tokens"]), int(usage["completion_tokens"])
        else:
            with settings.client() as client:
                prompt = count_tokens(client, settings, _prompt_body(settings, prompt_messages))
                answer = {"prompt": text, "add_special_tokens": False}
                completion = count_tokens(client, settings, answer) if text else 0
        return self._calc_response_usage(model, credentials, prompt, completion)

    # ---- token counting -----------------------------------------------------------------------------------------
    def get_num_tokens(self, model: str, credentials: dict, prompt_messages: list[PromptMessage],
                       tools: list[PromptMessageTool] | None = None) -> int:
        """The prompt's length in the gateway model's own tokens (kvgate's /tokenize applies its chat template)."""
        settings = LLMSettings.from_credentials(model, credentials)
        with settings.client() as client:
            return count_tokens(client, settings, _prompt_body(settings, prompt_messages))

    # ---- credentials and schema ---------------------------------------------------------------------------------
    def validate_credentials(self, model: str, credentials: dict) -> None:
        """One small real request (1 token) through the same path as every call: headers, key, model, mode."""
        try:
            settings = LLMSettings.from_credentials(model, credentials)
        except ValueError as e:
            raise CredentialsValidateFailedError(str(e)) from e
        path, body = self._request_body(settings, [_ping()], {"max_tokens": 1, "temperature": 0}, None, False, None)
        try:
            with settings.client() as client:
                send(client, settings, path, body).close()
        except InvokeError as e:
            raise CredentialsValidateFailedError(str(e)) from e

    def get_customizable_model_schema(self, model: str, credentials: Mapping) -> AIModelEntity:
        try:
            settings = LLMSettings.from_credentials(model, credentials)
            mode, context, max_tokens = settings.mode, settings.context_size, settings.max_tokens
        except ValueError:  # a bad form is reported by validate_credentials and by _invoke; keep the UI usable
            mode, context, max_tokens = "chat", 4096, 4096
        return AIModelEntity(
            model=model, label=I18nObject(en_US=model), model_type=ModelType.LLM,
            fetch_from=FetchFrom.CUSTOMIZABLE_MODEL, features=[],
            model_properties={ModelPropertyKey.MODE: mode, ModelPropertyKey.CONTEXT_SIZE: context},
            parameter_rules=parameter_rules(max_tokens))

    @property
    def _invoke_error_mapping(self) -> dict[type[InvokeError], list[type[Exception]]]:
        return INVOKE_ERROR_MAPPING


def _ping() -> PromptMessage:
    return UserPromptMessage(content="ping")


def _prompt_body(settings: LLMSettings, prompt_messages: list[PromptMessage]) -> dict[str, Any]:
    """/tokenize's body for the prompt as the gateway sees it: chat messages (it applies the chat template) or the
    completion prompt."""
    if settings.mode == "chat":
        return {"messages": chat_messages(prompt_messages)}
    return {"prompt": completion_prompt(prompt_messages)}


# parameters that Dify knows by name (its templates add translated labels and help)
_TEMPLATES = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "max_tokens")


def _rule(name: str, kind: ParameterType, label: str, help_text: str, **limits: Any) -> ParameterRule:
    return ParameterRule(name=name, use_template=name if name in _TEMPLATES else None, label=I18nObject(en_US=label),
                         type=kind, help=I18nObject(en_US=help_text), required=False, **limits)


def parameter_rules(max_tokens: int) -> list[ParameterRule]:
    """The sampling parameters a Dify user can set; all go to kvgate under OpenAI's names."""
    return [
        _rule("temperature", ParameterType.FLOAT, "Temperature", "0 is greedy; higher is more random.",
              default=0.7, min=0.0, max=2.0, precision=2),
        _rule("top_p", ParameterType.FLOAT, "Top P", "Sample from the smallest set of tokens with this much "
              "probability.", default=1.0, min=0.01, max=1.0, precision=2),
        _rule("top_k", ParameterType.INT, "Top K", "Sample from the K most likely tokens only (0: all).",
              default=0, min=0, max=1000),
        _rule("presence_penalty", ParameterType.FLOAT, "Presence penalty", "Penalize tokens that already "
              "appeared.", default=0.0, min=-2.0, max=2.0, precision=2),
        _rule("frequency_penalty", ParameterType.FLOAT, "Frequency penalty", "Penalize tokens by how often they "
              "appeared.", default=0.0, min=-2.0, max=2.0, precision=2),
        _rule("max_tokens", ParameterType.INT, "Max tokens", f"Most tokens to generate (at most {max_tokens}).",
              default=min(512, max_tokens), min=1, max=max_tokens),
        _rule("seed", ParameterType.INT, "Seed", "Same seed and parameters, same answer.", min=0),
    ]
