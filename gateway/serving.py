"""OpenAI chat and completions on top of an AsyncLLMEngine: prompt building, limits, JSON and SSE responses."""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator, Callable

from kvgate.engine.async_engine import AsyncLLMEngine
from kvgate.engine.outputs import Logprob, RequestOutput
from kvgate.engine.sampling_params import SamplingParams
from kvgate.gateway.errors import APIError
from kvgate.gateway.protocol import ChatCompletionRequest, CompletionRequest

OnOutput = Callable[[RequestOutput], None]
OPENAI_COMPLETIONS_MAX_TOKENS = 16  # /v1/completions' default max_tokens in OpenAI's API (and vLLM's)


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


class ChunkTemplate:
    """The SSE chunks of one stream that differ only in one text field, rendered exactly as `sse(payload)` would
    render them, for the cost of encoding that string (the streaming hot path: one chunk per token or so)."""
    MARK = "\x00kvgate-text\x00"

    def __init__(self, payload: dict) -> None:  # payload holds MARK where the text goes
        self.head, found, self.tail = sse(payload).partition(json.dumps(self.MARK, ensure_ascii=False))
        assert found, "the payload must hold ChunkTemplate.MARK"

    def __call__(self, text: str) -> str:
        return self.head + json.dumps(text, ensure_ascii=False) + self.tail


class OpenAIServing:
    """One served model: its engine, tokenizer and limits."""

    def __init__(self, name: str, engine: AsyncLLMEngine) -> None:
        self.name = name
        self.engine = engine
        self.created = int(time.time())

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.config.max_model_len

    # ---- prompts and limits ------------------------------------------------------------------------------------
    @property
    def default_sampling_params(self) -> dict[str, Any]:
        """What the model's generation config sets (temperature, top_p, top_k, min_p, repetition_penalty,
        max_tokens): the defaults for what a request leaves out."""
        return self.engine.config.default_sampling_params

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        try:
            messages = [{"role": m.role if m.role != "developer" else "system", "content": m.text(i)}
                        for i, m in enumerate(req.messages)]
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None
        try:
            return list(self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=req.add_generation_prompt, tokenize=True, return_dict=False,
                **(req.chat_template_kwargs or {})))
        except Exception as e:  # a template that rejects this conversation
            raise APIError(400, f"cannot apply the chat template: {e}", "messages") from e

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return prompt

    def check_length(self, prompt_len: int, max_tokens: int | None, what: str, fallback: int | None = None) -> int:
        """The request's max_tokens, checked against the context (a 400 that says the limit). When it gives none:
        the generation config's max_new_tokens, else the server's max_tokens_default, else `fallback` (None: up to
        the context), never more than the room the prompt leaves."""
        limit = self.max_model_len
        if prompt_len == 0:
            raise APIError(400, "the prompt is empty: at least one token is needed", "prompt")
        if max_tokens is not None and max_tokens < 1:
            raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
        room = limit - prompt_len
        if room < 1 or (max_tokens is not None and max_tokens > room):
            asked = prompt_len + (max_tokens or 1)
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{asked} tokens ({prompt_len} in the {what}, {max_tokens or 1} in the completion). "
                                f"Please reduce the length of the {what} or completion.", "max_tokens"
                           if room >= 1 else what, "context_length_exceeded")
        if max_tokens is not None:
            return max_tokens
        default = self.default_sampling_params.get("max_tokens") or self.engine.config.args.max_tokens_default \
            or fallback
        return room if default is None else min(default, room)

    def sampling(self, req: Any, max_tokens: int) -> SamplingParams:
        try:
            return req.to_sampling_params(max_tokens, self.default_sampling_params)
        except ValueError as e:
            msg = str(e)
            raise APIError(400, msg, msg.split(" ", 1)[0]) from e

    # ---- streams -------------------------------------------------------------------------------------------------
    async def _outputs(self, prompt: list[int], sp: SamplingParams, rid: str, priority: int,
                       delay: float | None, on_output: OnOutput | None) -> AsyncIterator[RequestOutput]:
        try:
            async for out in self.engine.generate({"prompt_token_ids": prompt}, sp, rid, priority, delay):
                if on_output is not None:
                    on_output(out)
                yield out
        except ValueError as e:
            raise APIError(400, str(e)) from e

    async def chat(self, req: ChatCompletionRequest, priority: int, delay: float | None,
                   on_output: OnOutput | None = None) -> dict | AsyncIterator[str]:
        """`on_output` sees every engine output (the router learns TTFT and token rates from them)."""
        prompt = self.chat_prompt(req)
        max_tokens = self.check_length(len(prompt), req.requested_max_tokens, "messages")
        sp = self.sampling(req, max_tokens)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        outs = self._outputs(prompt, sp, rid, priority, delay, on_output)
        if req.stream:
            first = await anext_or_none(outs)  # surface invalid input as an HTTP error, before the stream starts
            return self._chat_stream(req, rid, len(prompt), first, outs)
        texts, tokens, finish, logprobs = self._empty(req.n)
        async for out in outs:
            self._accumulate(out, texts, tokens, finish, logprobs)
        choices = [{"index": i, "message": {"role": "assistant", "content": texts[i]},
                    "logprobs": {"content": self._chat_logprobs(logprobs[i], tokens[i], req.top_logprobs or 0)}
                    if req.logprobs else None,
                    "finish_reason": finish[i]} for i in range(req.n)]
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": self.name,
                "choices": choices, "usage": usage(len(prompt), sum(len(t) for t in tokens))}

    async def _chat_stream(self, req: ChatCompletionRequest, rid: str, prompt_len: int, first: RequestOutput | None,
                           outs: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
        created, completion = int(time.time()), 0

        def chunk(choices: list[dict], **extra: Any) -> str:
            return sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.name,
                        "choices": choices, **extra})

        plain = ChunkTemplate({"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.name,
                               "choices": [{"index": 0, "delta": {"content": ChunkTemplate.MARK}, "logprobs": None,
                                            "finish_reason": None}]}) if req.n == 1 and not req.logprobs else None

        def render(out: RequestOutput) -> str | None:
            nonlocal completion
            if plain is not None and len(out.outputs) == 1 and out.outputs[0].finish_reason is None:
                o = out.outputs[0]  # the common case: one sample, text, not the end
                completion += len(o.token_ids)
                return plain(o.text) if o.text else None
            choices = []
            for o in out.outputs:
                completion += len(o.token_ids)
                if not o.text and o.finish_reason is None:  # tokens whose text is held back: nothing to send yet
                    continue
                lp = {"content": self._chat_logprobs(o.logprobs or [], o.token_ids, req.top_logprobs or 0)} \
                    if req.logprobs else None
                choices.append({"index": o.index, "delta": {"content": o.text} if o.text else {}, "logprobs": lp,
                                "finish_reason": o.finish_reason})
            return chunk(choices) if choices else None

        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for i in range(req.n)])
        if first is not None and (text := render(first)) is not None:
            yield text
        if first is not None and not first.finished:
            async for out in outs:
                if (text := render(out)) is not None:
                    yield text
        if req.stream_options and req.stream_options.include_usage:
            yield chunk([], usage=usage(prompt_len, completion))
        yield sse("[DONE]")

    async def completions(self, req: CompletionRequest, priority: int, delay: float | None,
                          on_output: OnOutput | None = None) -> dict | AsyncIterator[str]:
        if req.best_of not in (None, req.n):
            raise APIError(400, "best_of is not supported (only best_of == n)", "best_of")
        prompts = [self.encode(p) for p in req.prompts()]
        if req.stream and len(prompts) > 1:
            raise APIError(400, "streaming supports one prompt per request", "prompt")
        max_tokens = [self.check_length(len(p), req.max_tokens, "prompt", OPENAI_COMPLETIONS_MAX_TOKENS)
                      for p in prompts]
        rid = f"cmpl-{uuid.uuid4().hex}"
        if req.stream:
            sp = self.sampling(req, max_tokens[0])
            outs = self._outputs(prompts[0], sp, rid, priority, delay, on_output)
            first = await anext_or_none(outs)
            return self._completion_stream(req, rid, prompts[0], first, outs)
        choices, completion = [], 0
        for k, prompt in enumerate(prompts):
            sp = self.sampling(req, max_tokens[k])
            texts, tokens, finish, logprobs = self._empty(req.n)
            async for out in self._outputs(prompt, sp, f"{rid}-{k}", priority, delay, on_output):
                self._accumulate(out, texts, tokens, finish, logprobs)
            echo = self.tokenizer.decode(prompt) if req.echo else ""
            for i in range(req.n):
                completion += len(tokens[i])
                choices.append({"index": k * req.n + i, "text": echo + texts[i], "finish_reason": finish[i],
                                "logprobs": self._completion_logprobs(logprobs[i], tokens[i], req.logprobs or 0)
                                if req.logprobs is not None else None})
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.name,
                "choices": choices, "usage": usage(sum(len(p) for p in prompts), completion)}

    async def _completion_stream(self, req: CompletionRequest, rid: str, prompt: list[int],
                                 first: RequestOutput | None, outs: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
        created, completion, echoed = int(time.time()), 0, set()

        def chunk(choices: list[dict], **extra: Any) -> str:
            return sse({"id": rid, "object": "text_completion", "created": created, "model": self.name,
                        "choices": choices, **extra})

        plain = ChunkTemplate({"id": rid, "object": "text_completion", "created": created, "model": self.name,
                               "choices": [{"index": 0, "text": ChunkTemplate.MARK, "finish_reason": None,
                                            "logprobs": None}]}) \
            if req.n == 1 and req.logprobs is None and not req.echo else None

        def render(out: RequestOutput) -> str | None:
            nonlocal completion
            if plain is not None and len(out.outputs) == 1 and out.outputs[0].finish_reason is None:
                o = out.outputs[0]  # the common case: one sample, text, not the end
                completion += len(o.token_ids)
                return plain(o.text) if o.text else None
            choices = []
            for o in out.outputs:
                completion += len(o.token_ids)
                text = o.text
                if req.echo and o.index not in echoed:
                    text, _ = self.tokenizer.decode(prompt) + text, echoed.add(o.index)
                if not text and o.finish_reason is None:
                    continue
                choices.append({"index": o.index, "text": text, "finish_reason": o.finish_reason,
                                "logprobs": self._completion_logprobs(o.logprobs or [], o.token_ids, req.logprobs or 0)
                                if req.logprobs is not None else None})
            return chunk(choices) if choices else None

        if first is not None and (text := render(first)) is not None:
            yield text
        if first is not None and not first.finished:
            async for out in outs:
                if (text := render(out)) is not None:
                    yield text
        if req.stream_options and req.stream_options.include_usage:
            yield chunk([], usage=usage(len(prompt), completion))
        yield sse("[DONE]")

    # ---- helpers -------------------------------------------------------------------------------------------------
    @staticmethod
    def _empty(n: int) -> tuple[list[str], list[list[int]], list[str | None], list[list]]:
        return [""] * n, [[] for _ in range(n)], [None] * n, [[] for _ in range(n)]

    @staticmethod
    def _accumulate(out: RequestOutput, texts: list[str], tokens: list[list[int]], finish: list, lps: list) -> None:
        for o in out.outputs:
            texts[o.index] += o.text
            tokens[o.index] += o.token_ids
            lps[o.index] += o.logprobs or []
            finish[o.index] = o.finish_reason

    @staticmethod
    def _chat_logprobs(entries: list[dict[int, Logprob]], token_ids: list[int], top_n: int) -> list[dict]:
        result = []
        for entry, tid in zip(entries, token_ids):
            chosen = entry[tid]
            top = sorted(entry.values(), key=lambda lp: -lp.logprob)[:top_n]
            result.append({"token": chosen.decoded_token or "", "logprob": chosen.logprob,
                           "bytes": list((chosen.decoded_token or "").encode()),
                           "top_logprobs": [{"token": lp.decoded_token or "", "logprob": lp.logprob,
                                             "bytes": list((lp.decoded_token or "").encode())} for lp in top]})
        return result

    @staticmethod
    def _completion_logprobs(entries: list[dict[int, Logprob]], token_ids: list[int], top_n: int,
                             offset: int = 0) -> dict:
        tokens, token_lps, tops, offsets, pos = [], [], [], [], offset
        for entry, tid in zip(entries, token_ids):
            tok = entry[tid].decoded_token or ""
            tokens.append(tok)
            token_lps.append(entry[tid].logprob)
            top = sorted(entry.values(), key=lambda lp: -lp.logprob)[:top_n]
            tops.append({lp.decoded_token or "": lp.logprob for lp in top})
            offsets.append(pos)
            pos += len(tok)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def anext_or_none(it: AsyncIterator[RequestOutput]) -> RequestOutput | None:
    try:
        return await it.__anext__()
    except StopAsyncIteration:
        return None
