"""Shared by the sampling tests (test_sampling*.py): fixtures, transformers references, small helpers."""
from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterator

import pytest
import torch
from tiny_models import load_hf_model, one_thread, random_prompts
from transformers import AutoTokenizer

from kvgate.engine import LLM, LLMEngine, RequestOutput, SamplingParams

KV_BYTES = 1 << 24
PROMPT = [100, 200, 300, 400, 500, 150, 250]  # a prompt whose greedy continuation has clear winners
PROMPTS = random_prompts(5, seed=21, min_len=3, max_len=40)


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with one_thread():
        yield


@pytest.fixture(scope="module")
def llm(tiny_llama: str) -> LLM:
    return LLM(tiny_llama, kv_cache_memory_bytes=KV_BYTES, dtype="float32")  # (bf16 by default on a GPU)


# ---- helpers -----------------------------------------------------------------------------------------------------
@torch.no_grad()
def hf_step_logits(model_dir: str, prompt: list[int], output: list[int]) -> torch.Tensor:
    """transformers' raw logits for each generated position: row j predicts output[j]. [len(output), vocab]."""
    model = load_hf_model(model_dir)
    ids = torch.tensor([prompt + output])
    return model(ids).logits[0, len(prompt) - 1: len(prompt) + len(output) - 1].float()


@functools.lru_cache(maxsize=None)
def hf_first_logits(model_dir: str, prompt: tuple[int, ...]) -> torch.Tensor:
    return hf_step_logits(model_dir, list(prompt), [0])[0]


@torch.no_grad()
def hf_penalized_greedy(model_dir: str, prompt: list[int], steps: int, rep: float = 1.0, freq: float = 0.0,
                        pres: float = 0.0) -> tuple[list[int], torch.Tensor]:
    """vLLM's penalties applied by hand to transformers' logits, greedy; returns ids and penalized logits."""
    model = load_hf_model(model_dir)
    out: list[int] = []
    rows = []
    for _ in range(steps):
        logits = model(torch.tensor([prompt + out])).logits[0, -1].float().clone()
        counts = torch.zeros_like(logits)
        for t in out:
            counts[t] += 1
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[torch.tensor(prompt + out)] = True
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        logits -= freq * counts + pres * (counts > 0).float()
        rows.append(logits)
        out.append(int(logits.argmax()))
    return out, torch.stack(rows)


@functools.lru_cache(maxsize=None)
def load_tokenizer(model_dir: str):
    return AutoTokenizer.from_pretrained(model_dir)


def greedy_sp(max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def token_ids(outs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


Requests = list[tuple[str, list[int], SamplingParams]]


def run_engine(engine: LLMEngine, requests: Requests) -> dict[str, list[RequestOutput]]:
    """Add the requests, step to completion; every output of each request, in order."""
    for rid, prompt, sp in requests:
        engine.add_request(rid, prompt, sp)
    got: dict[str, list[RequestOutput]] = {rid: [] for rid, _, _ in requests}
    steps = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            got[o.request_id].append(o)
        steps += 1
        assert steps < 10_000
    return got


def total_variation(counts: Counter, probs: torch.Tensor) -> float:
    n = sum(counts.values())
    emp = torch.zeros_like(probs)
    for t, c in counts.items():
        emp[t] = c / n
    return 0.5 * float((emp - probs).abs().sum())
