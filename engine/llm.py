"""LLM: offline batch generation, `LLM(model).generate(prompts, SamplingParams)` as in vLLM."""
from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any, Sequence as Seq

from tqdm import tqdm

from kvgate.engine.config import EngineArgs
from kvgate.engine.llm_engine import LLMEngine, PromptType
from kvgate.engine.outputs import RequestOutput
from kvgate.engine.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False, priority: Seq[int] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        ids = []
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, params)):
                sp = sp or SamplingParams()
                if sp.output_kind != RequestOutputKind.FINAL_ONLY:
                    sp = replace(sp, output_kind=RequestOutputKind.FINAL_ONLY)
                rid = str(next(self._ids))
                self.engine.add_request(rid, prompt, sp, priority=priority[i] if priority else 50)
                ids.append(rid)
        except Exception:
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        convs = messages if messages and isinstance(messages[0], list) else [messages]
        tok = self.engine.tokenizer
        prompts = [{"prompt_token_ids": tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                                                return_dict=False)} for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm)
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[i] for i in ids]
