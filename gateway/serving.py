"""OpenAI chat and completions on top of an AsyncLLMEngine: prompt building, limits, JSON and SSE responses.

Every prompt of one /v1/completions request enters the engine at once (gateway/request_group.py), as vLLM does;
the first failure or the client going away aborts the rest. Streams are built by gateway/serving_stream.py for
both APIs, which differ only in how a choice looks.
"""
from __future__ import annotations

import copy
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterable, AsyncIterator, Awaitable, Callable

from kvgate.engine.async_engine import AsyncLLMEngine
from kvgate.engine.outputs import CompletionOutput, Logprob, RequestOutput
from kvgate.engine.sampling_params import SamplingParams
from kvgate.gateway.chat_output import ChatOutputParser, message_of, parser_settings
from kvgate.gateway.chat_tools import ToolPlan, plan_tools, template_messages
from kvgate.gateway.errors import APIError
from kvgate.gateway.prompt_tokenizer import PromptTokenizer
from kvgate.gateway.protocol import PROMPT_SHAPES, ChatCompletionRequest, CompletionRequest
from kvgate.gateway.request_group import RequestGroup
from kvgate.gateway.serving_stream import ChunkTemplate, StreamSpec, sse, stream_chunks, usage
from kvgate.gateway.structured_outputs import structured_outputs_of

__all__ = ["OpenAIServing", "ChunkTemplate", "sse", "usage", "MAX_PROMPTS"]
OnOutput = Callable[[RequestOutput], None]
OPENAI_COMPLETIONS_MAX_TOKENS = 16  # /v1/completions' default max_tokens in OpenAI's API (and vLLM's)
MAX_PROMPTS = 2048  # prompts of /v1/completions and inputs of /v1/embeddings per request (OpenAI's input limit)
# chat_template_kwargs a client may not set: they would change what the server does, not what the template says
RESERVED_TEMPLATE_KWARGS = ("chat_template", "tokenize", "return_dict", "return_tensors", "conversation",
                            "messages", "add_generation_prompt", "tokenizer_kwargs", "continue_final_message", "tools")


@dataclass
class Sample:
    """What one choice (a prompt's sample) generated, gathered from its DELTA outputs."""
    parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, o: CompletionOutput) -> None:
        self.parts.append(o.text)
        self.token_ids += o.token_ids
        self.logprobs += o.logprobs or []
        self.finish_reason = o.finish_reason

    @property
    def text(self) -> str:
        return "".join(self.parts)


@dataclass
class Running:
    """The engine requests of one API request, started: `first` holds the outputs read to start them, `outs` yields
    the rest, `close()` aborts whatever still runs (call it however the request ends), `prompt_index` maps engine
    request ids to prompt indices (None: one prompt, index 0)."""
    first: list[RequestOutput]
    outs: AsyncIterable[RequestOutput]
    close: Callable[[], Awaitable[None]]
    prompt_index: dict[str, int] | None
    cached: dict[str, int] = field(default_factory=dict)  # request id -> prompt tokens found in the prefix cache

    @property
    def cached_tokens(self) -> int:
        return sum(self.cached.values())

    def prompt_of(self, out: RequestOutput) -> int:
        return self.prompt_index[out.request_id] if self.prompt_index is not None else 0

    async def collect(self, n: int) -> dict[int, Sample]:
        """Every output until all requests finish, by choice index (prompt index * n + sample index)."""
        samples: dict[int, Sample] = {}

        def add(out: RequestOutput) -> None:
            self.cached[out.request_id] = out.num_cached_tokens
            base = self.prompt_of(out) * n
            for o in out.outputs:
                samples.setdefault(base + o.index, Sample()).add(o)

        try:
            for out in self.first:
                add(out)
            async for out in self.outs:
                add(out)
        finally:
            await self.close()
        return samples


class OpenAIServing:
    """One served model: its engine, tokenizer and limits, and its tool-call and reasoning parsers (from the engine's
    args: enable_auto_tool_choice, tool_call_parser, reasoning_parser; ValueError for a name not registered)."""

    def __init__(self, name: str, engine: AsyncLLMEngine) -> None:
        self.name = name
        self.engine = engine
        self.created = int(time.time())
        self._prompt_tokenizer: PromptTokenizer | None = None
        self.parsers = parser_settings(getattr(engine, "args", None))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.config.max_model_len

    @property
    def prompt_tokenizer(self) -> PromptTokenizer:
        """The tokenizer with the byte bound and off-loop tokenization (built once the engine is loaded)."""
        pt = self._prompt_tokenizer
        if pt is None or pt.tokenizer is not self.tokenizer or pt.max_model_len != self.max_model_len:
            pt = self._prompt_tokenizer = PromptTokenizer(self.tokenizer, self.max_model_len)
        return pt

    # ---- prompts and limits ------------------------------------------------------------------------------------
    @property
    def default_sampling_params(self) -> dict[str, Any]:
        """What the model's generation config sets (temperature, top_p, top_k, min_p, repetition_penalty,
        max_tokens): the defaults for what a request leaves out."""
        return self.engine.config.default_sampling_params

    def _need_tokenizer(self, what: str) -> None:
        if self.tokenizer is None:
            raise APIError(400, f"this model is served without a tokenizer (skip_tokenizer_init): send token ids as "
                                f"{what}", what)

    async def chat_prompt(self, req: ChatCompletionRequest, tools: list[dict] | None = None) -> list[int]:
        """The conversation's token ids through the chat template, with `tools` (the template's `tools=`; None:
        none) (checked against the byte bound first, rendered off the event loop when long); a 400 for a template
        that refuses the conversation."""
        messages = template_messages(req.messages)
        self._need_tokenizer("prompt (use /v1/completions)")
        kwargs = dict(req.chat_template_kwargs or {})
        if reserved := [k for k in RESERVED_TEMPLATE_KWARGS if k in kwargs]:
            raise APIError(400, f"chat_template_kwargs may not set {', '.join(reserved)}: only variables the "
                                f"template reads", "chat_template_kwargs")
        if tools is not None:
            kwargs["tools"] = tools
        try:
            return await self.prompt_tokenizer.apply_chat_template(
                messages, "messages", add_generation_prompt=req.add_generation_prompt, **kwargs)
        except APIError:
            raise
        except Exception as e:  # a template that rejects this conversation
            raise APIError(400, f"cannot apply the chat template: {e}", "messages") from e

    async def input_ids(self, inputs: list[str | list[int]], what: str) -> list[list[int]]:
        """Token ids of each prompt of a request (`what`: "prompt" or "input", as the API calls it), each checked:
        one to MAX_PROMPTS of them, none empty, texts within the byte bound, ids in the vocabulary, at least one
        token after tokenization. Messages name the item ("input[3]") when there are several."""
        if not inputs:
            raise APIError(400, f"{what} must not be empty: give {PROMPT_SHAPES}", what)
        if len(inputs) > MAX_PROMPTS:
            raise APIError(400, f"{what} has {len(inputs)} items, more than the limit of {MAX_PROMPTS} per request",
                           what)

        def name(k: int) -> str:
            return what if len(inputs) == 1 else f"{what}[{k}]"

        for k, x in enumerate(inputs):
            if not x:
                raise APIError(400, f"{name(k)} is empty: every {what} needs at least one token", what)
        texts = [k for k, x in enumerate(inputs) if isinstance(x, str)]
        if texts:
            self._need_tokenizer(what)
        encoded = iter(await self.prompt_tokenizer.encode_batch([inputs[k] for k in texts],  # type: ignore[misc]
                                                                [name(k) for k in texts]) if texts else [])
        prompts = [next(encoded) if isinstance(x, str) else x for x in inputs]
        vocab = self.engine.config.model_config.vocab_size
        for k, (x, ids) in enumerate(zip(inputs, prompts)):
            if not isinstance(x, str) and (bad := next((t for t in ids if not 0 <= t < vocab), None)) is not None:
                raise APIError(400, f"{name(k)} has token id {bad}, out of range: ids must be in [0, {vocab})", what)
            if not ids:
                raise APIError(400, f"{name(k)} has no tokens after tokenization: at least one is needed", what)
        return prompts

    def check_length(self, prompt_len: int, max_tokens: int | None, what: str, fallback: int | None = None) -> int:
        """The request's max_tokens, checked against the context (a 400 that says the limit). When it gives none:
        the generation config's max_new_tokens, else the server's max_tokens_default, else `fallback` (None: up to
        the context), never more than the room the prompt leaves. `what` names the prompt ("prompt[2]")."""
        limit = self.max_model_len
        param = what.split("[", 1)[0]
        if prompt_len == 0:
            raise APIError(400, f"the {what} is empty: at least one token is needed", param)
        if max_tokens is not None and max_tokens < 1:
            raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
        room = limit - prompt_len
        if room < 1 or (max_tokens is not None and max_tokens > room):
            asked = prompt_len + (max_tokens or 1)
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{asked} tokens ({prompt_len} in the {what}, {max_tokens or 1} in the completion). "
                                f"Please reduce the length of the {what} or completion.", "max_tokens"
                           if room >= 1 else param, "context_length_exceeded")
        if max_tokens is not None:
            return max_tokens
        default = self.default_sampling_params.get("max_tokens") or self.engine.config.args.max_tokens_default \
            or fallback
        return room if default is None else min(default, room)

    def sampling(self, req: Any, max_tokens: int, **decided: Any) -> SamplingParams:
        """The request's SamplingParams; `decided`: the serving's structured_outputs and skip_special_tokens."""
        try:
            return req.to_sampling_params(max_tokens, self.default_sampling_params, **decided)
        except ValueError as e:
            msg = str(e)
            raise APIError(400, msg, msg.split(" ", 1)[0]) from e

    # ---- engine requests -----------------------------------------------------------------------------------------
    async def _outputs(self, prompt: list[int], sp: SamplingParams, rid: str, priority: int,
                       delay: float | None, on_output: OnOutput | None) -> AsyncIterator[RequestOutput]:
        try:
            async for out in self.engine.generate({"prompt_token_ids": prompt}, sp, rid, priority, delay):
                if on_output is not None:
                    on_output(out)
                yield out
        except ValueError as e:
            raise APIError(400, str(e)) from e

    async def _start(self, prompts: list[list[int]], params: list[SamplingParams], rid: str, priority: int,
                     delay: float | None, on_output: OnOutput | None) -> Running:
        """Submit every prompt at once and wait for each one's first output, so that invalid input surfaces as an
        HTTP error before a stream starts; on a failure, whatever was started is aborted."""
        if len(prompts) == 1:  # the common case: the engine's stream itself, no task in between
            outs = self._outputs(prompts[0], params[0], rid, priority, delay, on_output)
            try:
                first = await outs.__anext__()
            except StopAsyncIteration:
                return Running([], outs, outs.aclose, None)
            except BaseException:
                await outs.aclose()
                raise
            return Running([first], outs, outs.aclose, None)
        ids = [f"{rid}-{k}" for k in range(len(prompts))]
        group: RequestGroup[RequestOutput] = RequestGroup([
            self._outputs(p, sp, i, priority, delay, on_output) for p, sp, i in zip(prompts, params, ids)])
        try:
            await group.started()
        except BaseException:
            await group.aclose()
            raise
        return Running([], group, group.aclose, {i: k for k, i in enumerate(ids)})

    # ---- the two APIs ----------------------------------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, priority: int, delay: float | None,
                   on_output: OnOutput | None = None) -> dict | AsyncIterator[str]:
        """`on_output` sees every engine output (the router learns TTFT and token rates from them)."""
        tools = plan_tools(req, self.parsers.tool_parser, self.parsers.enable_auto_tool_choice)
        guided = structured_outputs_of(req)
        if guided is not None and tools.structured_outputs is not None:
            raise APIError(400, f"tool_choice {tools.mode} and the request's output constraint (response_format, "
                                "guided_*, structured_outputs) cannot both apply: give one", "tool_choice")
        prompt = await self.chat_prompt(req, tools.template_tools)
        max_tokens = self.check_length(len(prompt), req.requested_max_tokens, "messages")
        keep_special = tools.parser is not None and tools.parser.keep_special_tokens
        sp = self.sampling(req, max_tokens, structured_outputs=guided or tools.structured_outputs,
                           skip_special_tokens=False if keep_special else None)
        reader = self._output_reader(tools, sp.structured_outputs is None)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        run = await self._start([prompt], [sp], rid, priority, delay, on_output)
        top = req.top_logprobs or 0
        if req.stream:
            readers: dict[int, ChatOutputParser] = {}

            def choice(index: int, _: int, o: CompletionOutput) -> dict | None:
                finish = o.finish_reason
                if reader is None:
                    if not o.text and finish is None:  # tokens whose text is held back: nothing to send yet
                        return None
                    delta = {"content": o.text} if o.text else {}
                else:
                    r = readers.get(index) or readers.setdefault(index, reader())
                    parsed = r.feed(o.text)
                    if finish is not None:
                        parsed.add(r.finish())
                        finish = r.finish_reason(finish)
                    if not parsed and finish is None and not (req.logprobs and o.token_ids):
                        return None
                    delta = parsed.to_openai()
                lp = {"content": self._chat_logprobs(o.logprobs or [], o.token_ids, top)} if req.logprobs else None
                return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}

            plain = {"index": 0, "delta": {"content": ChunkTemplate.MARK}, "logprobs": None, "finish_reason": None}
            spec = StreamSpec(rid, "chat.completion.chunk", self.name, req.n, len(prompt), self._include_usage(req),
                              choice, plain if req.n == 1 and not req.logprobs and reader is None else None,
                              [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None} for i in range(req.n)])
            return stream_chunks(spec, run.first, run.outs, run.close)
        samples = await run.collect(req.n)
        choices = []
        for i in range(req.n):
            s = samples.get(i, Sample())
            message, finish = {"role": "assistant", "content": s.text}, s.finish_reason
            if reader is not None:
                r = reader()
                message = message_of(r.parse(s.text), self.parsers.reasoning_parser is not None)
                finish = r.finish_reason(finish)
            choices.append({"index": i, "message": message,
                            "logprobs": {"content": self._chat_logprobs(s.logprobs, s.token_ids, top)}
                            if req.logprobs else None, "finish_reason": finish})
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": self.name,
                "choices": choices, "usage": usage(len(prompt), sum(len(s.token_ids) for s in samples.values()),
                                                   run.cached_tokens)}

    def _output_reader(self, tools: ToolPlan, free: bool) -> Callable[[], ChatOutputParser] | None:
        """A factory of per-choice output parsers, or None when the output is content as it is. The reasoning
        parser reads only `free` output: a guided one is constrained from its first token, so it holds no thinking."""
        reasoning = self.parsers.reasoning_parser if free else None
        if reasoning is None and tools.mode == "none":
            return None
        tokenizer = self.tokenizer
        return lambda: ChatOutputParser(reasoning(tokenizer) if reasoning is not None else None,
                                        tools.output_parser(tokenizer))

    async def completions(self, req: CompletionRequest, priority: int, delay: float | None,
                          on_output: OnOutput | None = None) -> dict | AsyncIterator[str]:
        """Every prompt of the request runs at once; choices are numbered prompt index * n + sample index."""
        if req.best_of not in (None, req.n):
            raise APIError(400, "best_of is not supported (only best_of == n)", "best_of")
        guided = structured_outputs_of(req)
        prompts = await self.input_ids(req.prompts(), "prompt")
        if req.echo:
            self._need_tokenizer("prompt (echo needs one to show the prompt's text)")
        sps = []  # one each: the engine owns a request's params
        for k, p in enumerate(prompts):
            what = "prompt" if len(prompts) == 1 else f"prompt[{k}]"
            max_tokens = self.check_length(len(p), req.max_tokens, what, OPENAI_COMPLETIONS_MAX_TOKENS)
            sps.append(self.sampling(req, max_tokens, structured_outputs=copy.copy(guided)))
        rid = f"cmpl-{uuid.uuid4().hex}"
        run = await self._start(prompts, sps, rid, priority, delay, on_output)
        n, top = req.n, req.logprobs or 0
        echoes: dict[int, str] = {}

        def echo(k: int) -> str:  # the prompt's text, decoded once
            if k not in echoes:
                echoes[k] = self.tokenizer.decode(prompts[k])
            return echoes[k]

        if req.stream:
            echoed: set[int] = set()

            def choice(index: int, k: int, o: CompletionOutput) -> dict | None:
                text = o.text
                if req.echo and index not in echoed:
                    text = echo(k) + text
                    echoed.add(index)
                if not text and o.finish_reason is None:
                    return None
                return {"index": index, "text": text, "finish_reason": o.finish_reason,
                        "logprobs": self._completion_logprobs(o.logprobs or [], o.token_ids, top)
                        if req.logprobs is not None else None}

            plain = {"index": 0, "text": ChunkTemplate.MARK, "finish_reason": None, "logprobs": None}
            one = len(prompts) == 1 and n == 1 and req.logprobs is None and not req.echo
            spec = StreamSpec(rid, "text_completion", self.name, n, sum(len(p) for p in prompts),
                              self._include_usage(req), choice, plain if one else None,
                              prompt_index=run.prompt_index)
            return stream_chunks(spec, run.first, run.outs, run.close)
        samples = await run.collect(n)
        choices = []
        for index in range(len(prompts) * n):
            s = samples.get(index, Sample())
            choices.append({"index": index, "text": (echo(index // n) if req.echo else "") + s.text,
                            "finish_reason": s.finish_reason,
                            "logprobs": self._completion_logprobs(s.logprobs, s.token_ids, top)
                            if req.logprobs is not None else None})
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.name,
                "choices": choices, "usage": usage(sum(len(p) for p in prompts),
                                                   sum(len(s.token_ids) for s in samples.values()),
                                                   run.cached_tokens)}

    # ---- helpers -------------------------------------------------------------------------------------------------
    @staticmethod
    def _include_usage(req: ChatCompletionRequest | CompletionRequest) -> bool:
        return bool(req.stream_options and req.stream_options.include_usage)

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
