"""Sampler: the grammar mask of guided rows, penalties, min_tokens, temperature/top-k/top-p/min-p, seeded sampling
and logprobs, per row."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvgate.engine.sequence import Sequence

if TYPE_CHECKING:
    from kvgate.engine.structured_output.manager import GrammarStep


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # per row: None, or (logprob of the sampled token, rank of it, top-N [(token id, logprob)])
    logprobs: list[tuple[float, int, list[tuple[int, float]]] | None]


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids

    def __call__(self, logits: torch.Tensor, rows: list[Sequence], guide: GrammarStep | None = None
                 ) -> SamplerOutput:
        """logits: [len(rows), vocab] float32, one row per sequence to extend by one token. `guide` (guided rows):
        their grammar's mask is applied first, so that penalties, temperature, top-k/p and min-p act on the allowed
        tokens only, and the sampled tokens are accepted into their matchers (which may replace one: the
        budget-aware finish). Logprobs are the model's own, from the logits before any of this."""
        logits = logits[:, : self.vocab_size]
        params = [s.request.sampling_params for s in rows]
        want_lp = [p.logprobs is not None for p in params]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_lp) else None
        logits = logits.clone()
        if guide is not None:
            guide.apply(logits)
        self._apply_penalties(logits, rows)
        self._apply_min_tokens(logits, rows)
        tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        if greedy:
            g = torch.tensor(greedy, device=logits.device)
            tokens[g] = logits[g].argmax(dim=-1)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            s = torch.tensor(sampled, device=logits.device)
            tokens[s] = self._sample(logits[s], [rows[i] for i in sampled])
        token_list = tokens.tolist()
        if guide is not None:
            token_list = guide.accept(token_list)
        out: list[tuple[float, int, list[tuple[int, float]]] | None] = [None] * len(rows)
        if raw_logprobs is not None:
            for i, p in enumerate(params):
                if not want_lp[i]:
                    continue
                row = raw_logprobs[i]
                chosen = float(row[token_list[i]])
                rank = int((row > chosen).sum()) + 1
                top: list[tuple[int, float]] = []
                if p.logprobs:
                    vals, ids = row.topk(p.logprobs)
                    top = list(zip(ids.tolist(), vals.tolist()))
                out[i] = (chosen, rank, top)
        return SamplerOutput(token_list, out)

    def _apply_penalties(self, logits: torch.Tensor, rows: list[Sequence]) -> None:
        for i, seq in enumerate(rows):
            p = seq.request.sampling_params
            if not p.has_penalties:
                continue
            dev = logits.device
            out_ids = torch.tensor(seq.output_token_ids, dtype=torch.long, device=dev)
            counts = torch.zeros(logits.shape[1], device=dev).index_add_(
                0, out_ids.clamp(max=logits.shape[1] - 1), torch.ones(len(out_ids), device=dev))
            if p.repetition_penalty != 1.0:
                seen = counts > 0
                prompt_ids = torch.tensor(seq.token_ids[: seq.num_prompt_tokens], dtype=torch.long, device=dev)
                seen[prompt_ids.clamp(max=logits.shape[1] - 1)] = True
                row = logits[i]
                penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
                logits[i] = torch.where(seen, penalized, row)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()

    def _apply_min_tokens(self, logits: torch.Tensor, rows: list[Sequence]) -> None:
        """Ban stop tokens below min_tokens; in a guided row, never all of what its grammar allows (the grammar
        wins: a document that may only end here ends here)."""
        for i, seq in enumerate(rows):
            p = seq.request.sampling_params
            if seq.num_output_tokens < p.min_tokens:
                banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
                ids = [t for t in banned if t < logits.shape[1]]
                if ids:
                    kept = logits[i, ids].clone() if seq.grammar is not None else None
                    logits[i, ids] = float("-inf")
                    if kept is not None and not bool(torch.isfinite(logits[i]).any()):
                        logits[i, ids] = kept

    def _sample(self, logits: torch.Tensor, rows: list[Sequence]) -> torch.Tensor:
        params = [s.request.sampling_params for s in rows]
        dev = logits.device
        temp = torch.tensor([p.temperature for p in params], device=dev)
        logits = logits / temp[:, None]
        top_k = [p.top_k for p in params]
        if any(top_k):
            vocab = logits.shape[1]  # k >= vocab (any int, however large) keeps every token
            k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=dev)
            kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], device=dev)
            sorted_logits, idx = logits.sort(dim=-1, descending=True)
            cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            drop = cum - sorted_logits.softmax(dim=-1) >= top_p[:, None]  # keep the smallest set reaching top_p
            drop[:, 0] = False
            logits = logits.masked_fill(torch.zeros_like(drop).scatter(1, idx, drop), float("-inf"))
        probs = logits.softmax(dim=-1)
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=dev)
            probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
        # exponential-race sampling: argmax(p / q) with q = -log(u) ~ Exp(1); seeded rows use their own generator
        u = torch.rand_like(probs)
        for i, seq in enumerate(rows):
            if seq.generator is not None:
                u[i] = torch.rand(probs.shape[1], generator=seq.generator, device=probs.device)
        q = u.clamp_(min=1e-20).log_().neg_()
        return (probs / q).argmax(dim=-1)
