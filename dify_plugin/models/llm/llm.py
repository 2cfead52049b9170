"""A kvgate model as a Dify LLM: chat or completion calls, streamed (with the gateway's usage) or blocking, with
tool calling, structured output and reasoning as the model's form turns them on (models/llm/schema.py).

Every request carries the model's batching window (X-Max-Batch-Delay-Ms) and priority (X-Priority), and every
wait for the gateway is bounded by the model's `timeout` credential. Token counts come from the gateway (its
usage, its /tokenize), never from a tokenizer downloaded at run time. The request body is built by
models/llm/request.py, answers are read by models/llm/responses.py.
"""
from __future__ import annotations

from collections.abc import Generator, Mapping
from typing import Any

import httpx
from dify_plugin import LargeLanguageModel
from dify_plugin.entities import I18nObject
from dify_plugin.entities.model import AIModelEntity, FetchFrom, ModelPropertyKey, ModelType
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
from models.common.settings import DEFAULT_CONTEXT_SIZE
from models.llm.messages import chat_messages, completion_prompt
from models.llm.request import request_body
from models.llm.responses import StreamState, blocking_answer, sse_events
from models.llm.schema import model_features, parameter_rules, sampling_rules
from models.llm.settings import LLMSettings

PING_TOOL = PromptMessageTool(name="ping", description="Answers pong.", parameters={"type": "object",
                                                                                   "properties": {}})


class KvgateLargeLanguageModel(LargeLanguageModel):
    # ---- invoking ---------------------------------------------------------------------------------------------
    def _invoke(self, model: str, credentials: dict, prompt_messages: list[PromptMessage], model_parameters: dict,
                tools: list[PromptMessageTool] | None = None, stop: list[str] | None = None, stream: bool = True,
                user: str | None = None) -> LLMResult | Generator[LLMResultChunk, None, None]:
        """The answer, with the tool calls the model made when `tools` were given (complete calls: in the
        LLMResult's message, or in one chunk before the last one of a stream)."""
        settings = LLMSettings.from_credentials(model, credentials)
        path, body = request_body(settings, prompt_messages, model_parameters, tools, stop, stream, user)
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

    def _blocking_result(self, model: str, credentials: dict, settings: LLMSettings,
                         prompt_messages: list[PromptMessage], response: httpx.Response) -> LLMResult:
        try:
            answer = blocking_answer(response.json(), settings.mode)
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise error_for_exception(ValueError(str(e)), str(response.url), settings.timeout) from e
        generated = _answer_text(answer.text, answer.tool_calls)
        return LLMResult(model=model, message=AssistantPromptMessage(content=answer.text, tool_calls=answer.tool_calls),
                         usage=self._usage(model, credentials, settings, prompt_messages, generated, answer.usage))

    def _stream_chunks(self, model: str, credentials: dict, settings: LLMSettings,
                       prompt_messages: list[PromptMessage], client: httpx.Client,
                       response: httpx.Response) -> Generator[LLMResultChunk, None, None]:
        """Content chunks as they arrive; then, if the model made tool calls, one chunk with the complete calls
        (OpenAI's fragments assembled: Dify runs every call it finds in a chunk); then one last chunk with the
        usage and the finish reason ("tool_calls" when the model stopped to call tools).

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
            calls = state.calls()
        except InvokeError:
            raise
        except Exception as e:  # noqa: BLE001 - every failure reaches Dify as one of the SDK's error types
            raise error_for_exception(e, str(response.url), settings.timeout) from e
        finally:
            response.close()
            client.close()
        if calls:
            yield LLMResultChunk(model=model, delta=LLMResultChunkDelta(
                index=index, message=AssistantPromptMessage(content=tail, tool_calls=calls)))
            index, tail = index + 1, ""
        usage = self._usage(model, credentials, settings, prompt_messages, _answer_text(state.text, calls),
                            state.usage)
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
        """The prompt's length in the gateway model's own tokens (kvgate's /tokenize applies its chat template).
        `tools` are not counted: kvgate's /tokenize takes no tools (a call's usage counts them)."""
        settings = LLMSettings.from_credentials(model, credentials)
        with settings.client() as client:
            return count_tokens(client, settings, _prompt_body(settings, prompt_messages))

    # ---- credentials and schema ---------------------------------------------------------------------------------
    def validate_credentials(self, model: str, credentials: dict) -> None:
        """One small real request (1 token) through the same path as every call: headers, key, model, mode; with
        function calling on, it gives a tool (tool_choice auto, what a call with tools sends by default), so that a
        model served without tool calling is refused here, with the gateway's reason."""
        try:
            settings = LLMSettings.from_credentials(model, credentials)
        except ValueError as e:
            raise CredentialsValidateFailedError(str(e)) from e
        tools = [PING_TOOL] if settings.tool_calls else None
        path, body = request_body(settings, [_ping()], {"max_tokens": 1, "temperature": 0}, tools, None, False, None)
        try:
            with settings.client() as client:
                send(client, settings, path, body).close()
        except InvokeError as e:
            prefix = "function calling is on for this model, and a request with a tool failed: " if tools else ""
            raise CredentialsValidateFailedError(prefix + str(e)) from e

    def get_customizable_model_schema(self, model: str, credentials: Mapping) -> AIModelEntity:
        """The model's mode, context size, features and parameters, as its form says (models/llm/schema.py)."""
        try:
            settings = LLMSettings.from_credentials(model, credentials)
            mode, context = settings.mode, settings.context_size
            features, rules = model_features(settings), parameter_rules(settings)
        except ValueError:  # a bad form is reported by validate_credentials and by _invoke; keep the UI usable
            mode, context, features, rules = "chat", DEFAULT_CONTEXT_SIZE, [], sampling_rules(DEFAULT_CONTEXT_SIZE)
        return AIModelEntity(
            model=model, label=I18nObject(en_US=model), model_type=ModelType.LLM,
            fetch_from=FetchFrom.CUSTOMIZABLE_MODEL, features=features,
            model_properties={ModelPropertyKey.MODE: mode, ModelPropertyKey.CONTEXT_SIZE: context},
            parameter_rules=rules)

    @property
    def _invoke_error_mapping(self) -> dict[type[InvokeError], list[type[Exception]]]:
        return INVOKE_ERROR_MAPPING


def _ping() -> PromptMessage:
    return UserPromptMessage(content="ping")


def _answer_text(text: str, calls: list[AssistantPromptMessage.ToolCall]) -> str:
    """What an answer generated, as text: its content and its calls' names and arguments (for counting the
    completion's tokens where the gateway sent no usage)."""
    return text + "".join(c.function.name + c.function.arguments for c in calls)


def _prompt_body(settings: LLMSettings, prompt_messages: list[PromptMessage]) -> dict[str, Any]:
    """/tokenize's body for the prompt as the gateway sees it: chat messages (it applies the chat template) or the
    completion prompt."""
    if settings.mode == "chat":
        return {"messages": chat_messages(prompt_messages)}
    return {"prompt": completion_prompt(prompt_messages)}
