"""Pooler: an embedding from the final hidden states of a pooling request's prompt (vLLM's pooling runner).

A pooling request runs its prompt through prefill only (in chunks when the step's token budget is smaller than
the prompt) and finishes in the step that computes its last prompt token. Each step `Pooler.step` reads, from the
step's flat hidden states, what the model's pooling type needs of every scheduled sequence:

  LAST  the row of the last prompt token, in the final chunk (decoder embedding models: Qwen3-Embedding, ...);
  MEAN  the float32 sum of the rows of every chunk, divided by the prompt length at the end;
  CLS   the row of position 0, in the first chunk.

What a sequence has gathered so far lives on it (`Sequence.pooled`) and starts over whenever a chunk starts at
position 0: a preempted sequence is recomputed from its first token, so its old sum is dropped there. MEAN and CLS
need every token's hidden state, so their requests never read the prefix cache (Request.skip_reading_prefix_cache,
set at admission from PoolerConfig.needs_every_token); LAST is safe with prefix hits because the prefix cache
never holds a sequence's last token.

Then, per request (`finish`): the first `dimensions` values (matryoshka), L2-normalized if asked. The vector is
float32 whatever the model's dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvgate.engine.pooling_params import PoolerConfig, PoolingParams
from kvgate.engine.sequence import Sequence


class Pooler:
    def __init__(self, config: PoolerConfig) -> None:
        self.config = config

    def step(self, hidden: torch.Tensor, scheduled: list[tuple[Sequence, int]], computed: list[int]
             ) -> list[tuple[Sequence, torch.Tensor]]:
        """Take this step's share of every scheduled sequence from `hidden` ([num_tokens, hidden_size], rows in the
        scheduled order; `computed`: each one's tokens computed before this step). Returns (seq, pooled float32 vector) for each
        sequence whose prompt this step completes, in scheduled order: the one place that decides which sequences
        pool this step. Their partial state is cleared."""
        kind = self.config.pooling_type
        sums = None
        if kind == "MEAN":  # one segment sum for the whole step, in float32
            counts = torch.tensor([n for _, n in scheduled], device=hidden.device)
            segment = torch.repeat_interleave(torch.arange(len(scheduled), device=hidden.device), counts)
            sums = torch.zeros((len(scheduled), hidden.shape[1]), dtype=torch.float32, device=hidden.device)
            sums.index_add_(0, segment, hidden.float())
        done: list[tuple[Sequence, torch.Tensor]] = []
        row = 0
        for i, ((seq, n), start) in enumerate(zip(scheduled, computed)):
            if sums is not None:
                seq.pooled = sums[i] if start == 0 else _partial(seq) + sums[i]
            elif kind == "CLS" and start == 0:
                seq.pooled = hidden[row].to(torch.float32, copy=True)  # copied: hidden may be a reused buffer
            if start + n == len(seq):
                if kind == "LAST":
                    vec = hidden[row + n - 1].float()
                elif kind == "MEAN":
                    vec = _partial(seq) / len(seq)
                else:
                    vec = _partial(seq)
                seq.pooled = None
                done.append((seq, vec))
            row += n
        return done

    def finish(self, pooled: list[tuple[Sequence, torch.Tensor]]) -> list[list[float]]:
        """The embedding of each pooled sequence, as a list of floats: truncated to its request's `dimensions`,
        then normalized if its PoolingParams (else the model's PoolerConfig) say so. One copy to the host."""
        if not pooled:
            return []
        vectors = torch.stack([v for _, v in pooled]).cpu()
        out = []
        for (seq, _), vec in zip(pooled, vectors):
            params = seq.request.pooling_params or PoolingParams()
            if params.dimensions is not None:
                vec = vec[:params.dimensions]
            if params.should_normalize(self.config):
                vec = F.normalize(vec, p=2, dim=-1)
            out.append(vec.tolist())
        return out


def _partial(seq: Sequence) -> torch.Tensor:
    if seq.pooled is None:  # admission keeps MEAN/CLS requests off prefix hits, so their first chunk is at 0
        raise RuntimeError(f"pooling state of {seq} is missing: its first prompt chunk did not start at position 0")
    return seq.pooled
