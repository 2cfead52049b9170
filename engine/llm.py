"""LLM: offline batches as in vLLM: `LLM(model).generate(prompts, SamplingParams)`, and for an embedding model
(runner="pooling") `LLM(model, runner="pooling").embed(prompts)` / `.encode(prompts, PoolingParams)`."""
from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any, Sequence as Seq

from tqdm import tqdm

from kvgate.engine.config import EngineArgs
from kvgate.engine.llm_engine import LLMEngine, PromptType
from kvgate.engine.outputs import EngineOutput, PoolingRequestOutput, RequestOutput
from kvgate.engine.pooling_params import PoolingParams
from kvgate.engine.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() uses when given no SamplingParams: the model's generation config (temperature, top_p,
        top_k, min_p, repetition_penalty, max_new_tokens as max_tokens) over SamplingParams' own defaults."""
        return SamplingParams(**self.engine.config.default_sampling_params)

    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False, priority: Seq[int] | None = None) -> list[RequestOutput]:
        prompts, params = _batch(prompts, sampling_params, priority, "sampling params")
        final = []
        for sp in params:
            sp = sp or self.get_default_sampling_params()
            final.append(sp if sp.output_kind == RequestOutputKind.FINAL_ONLY
                         else replace(sp, output_kind=RequestOutputKind.FINAL_ONLY))
        return self._add_and_run(prompts, final, priority, use_tqdm, "generate")  # type: ignore[return-value]

    def encode(self, prompts: PromptType | Seq[PromptType],
               pooling_params: PoolingParams | Seq[PoolingParams] | None = None, use_tqdm: bool = False,
               priority: Seq[int] | None = None) -> list[PoolingRequestOutput]:
        """Pool each prompt (an embedding model: runner="pooling"); outputs in the prompts' order, each with
        `outputs.embedding` (a list of floats). A generate engine refuses with a ValueError."""
        prompts, params = _batch(prompts, pooling_params, priority, "pooling params")
        params = [p or PoolingParams() for p in params]
        return self._add_and_run(prompts, params, priority, use_tqdm, "embed")  # type: ignore[return-value]

    def embed(self, prompts: PromptType | Seq[PromptType],
              pooling_params: PoolingParams | Seq[PoolingParams] | None = None, use_tqdm: bool = False,
              priority: Seq[int] | None = None) -> list[PoolingRequestOutput]:
        """vLLM's name for encode() on an embedding model (the same outputs)."""
        return self.encode(prompts, pooling_params, use_tqdm, priority)

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        convs = messages if messages and isinstance(messages[0], list) else [messages]
        tok = self.engine.tokenizer
        prompts = [{"prompt_token_ids": tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                                                return_dict=False)} for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _add_and_run(self, prompts: list[PromptType], params: list[SamplingParams] | list[PoolingParams],
                     priority: Seq[int] | None, use_tqdm: bool, desc: str) -> list[EngineOutput]:
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                rid = str(next(self._ids))
                self.engine.add_request(rid, prompt, p, priority=priority[i] if priority else 50)
                ids.append(rid)
        except Exception:
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm, desc)

    def _run(self, ids: list[str], use_tqdm: bool, desc: str) -> list[EngineOutput]:
        done: dict[str, EngineOutput] = {}
        bar = tqdm(total=len(ids), desc=desc, disable=not use_tqdm)
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
            failed = self.engine.take_failed()  # an invalid grammar, found once compiled: the batch fails with it
            if failed:
                bar.close()
                self.engine.abort_request([i for i in ids if i not in done])
                raise failed[0][1]
        bar.close()
        return [done[i] for i in ids]


def _batch(prompts: PromptType | Seq[PromptType], params: Any, priority: Seq[int] | None,
           what: str) -> tuple[list[PromptType], list[Any]]:
    """(prompts as a list, one params per prompt): a single prompt (a string, a dict or a list of token ids) is
    a batch of one; one params object is used for every prompt."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    prompts = list(prompts)
    per_prompt = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    if len(per_prompt) != len(prompts):
        raise ValueError(f"got {len(per_prompt)} {what} for {len(prompts)} prompts")
    if priority is not None and len(priority) != len(prompts):
        raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
    return prompts, per_prompt
