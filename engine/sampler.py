"""Sampler: the grammar mask of guided rows, penalties, min_tokens, temperature/top-k/top-p/min-p, seeded sampling
and logprobs, as batched tensor code.

`sample` leaves the tokens on the device and starts their copy to the host without waiting for it (async
scheduling feeds them to the next step on the device); `result` waits for that copy only, and accepts the guided
rows' tokens into their grammars. Nothing in `sample` makes the host wait for the device: every small tensor it
builds from host values goes through pinned memory.
"""
from __future__ import annotations

import random
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
    drawn: list[int]  # the tokens drawn: token_ids differ where a guided row's grammar replaced one


@dataclass
class SampledTokens:
    """One step's sampled tokens on the device, and their copies to the host on their way."""
    token_ids: torch.Tensor  # [rows] int64, on the device
    host: list[torch.Tensor]  # the tokens, then (logprob rows) chosen logprob, rank, top values, top ids
    ready: torch.cuda.Event | None  # recorded after the copies (None on the CPU: they are done)
    rows: list[Sequence]
    logprob_rows: list[int]
    guide: GrammarStep | None
    raw_logprobs: torch.Tensor | None  # the logprob rows' log-softmax, kept for a token a guide replaces


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on the device without a wait: through pinned memory on CUDA."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != "cuda":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return out.copy_(t, non_blocking=True)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) of 2-D x, the same indices (the first of equal maxima; a NaN counts as the largest). On the
    CPU in two passes, a max per 128 columns then the argmax inside the winning chunk: torch's CPU argmax does not
    vectorize (1.0 ms for 16 x 49,152 float32 logits, against 0.15 ms)."""
    rows, cols = x.shape
    if x.device.type != "cpu" or cols % 128 or cols < 1024:
        return x.argmax(dim=-1)
    chunks = x.reshape(rows, cols // 128, 128)
    best = chunks.amax(dim=-1).argmax(dim=-1)  # the first chunk holding the row's max
    return best * 128 + chunks[torch.arange(rows), best].argmax(dim=-1)


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: list[int], seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._seeds = random.Random(seed)  # the fused kernel's noise, a seed per step (unseeded rows)
        self.fused: bool | None = None  # the fused kernel for plain rows: None = on CUDA (tests: its interpreter)

    def sample(self, logits: torch.Tensor, rows: list[Sequence], guide: GrammarStep | None = None,
               counted: bool = False) -> SampledTokens:
        """logits: [len(rows), vocab] float32, one row per sequence to extend by one token. `guide` (guided rows):
        their grammar's mask is applied first, so that penalties, temperature, top-k/p and min-p act on the allowed
        tokens only. Logprobs are the model's own, from the logits before any of this. `counted`: the rows'
        num_pending count this token already (min_tokens)."""
        logits = logits[:, : self.vocab_size]
        dev = logits.device
        params = [s.request.sampling_params for s in rows]
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw = None
        if lp_rows:
            lp_index = to_device(lp_rows, torch.long, dev)
            raw = torch.log_softmax(logits[lp_index] if len(lp_rows) < len(rows) else logits, dim=-1)
        penalized = [i for i, p in enumerate(params) if p.has_penalties]
        ahead = 1 if counted else 0
        banned = [i for i, (s, p) in enumerate(zip(rows, params))
                  if s.num_output_tokens + s.num_pending - ahead < p.min_tokens]
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        vocab = logits.shape[1]
        plain = [i for i in sampled if not 0 < params[i].top_k < vocab and params[i].top_p >= 1.0
                 and params[i].min_p <= 0]
        kernel = dev.type == "cuda" if self.fused is None else self.fused  # the fused kernel (kernels/triton_sample)
        # the kernel draws every row and masks the guided ones as it reads them (min_tokens' guided check needs
        # the masked logits first); the mask commutes with the penalties (a forbidden token stays -inf)
        mask_in_kernel = guide is not None and kernel and len(plain) == len(sampled) and not banned
        if (guide is not None and not mask_in_kernel) or penalized or banned:
            logits = logits.clone()
        if guide is not None and not mask_in_kernel:
            guide.apply(logits)
        if penalized:
            self._apply_penalties(logits, rows, penalized)
        if banned:
            self._apply_min_tokens(logits, rows, banned)
        if not sampled and not mask_in_kernel:
            tokens = argmax(logits)
        elif kernel and (plain or mask_in_kernel):  # one kernel for the plain rows and the greedy ones
            from kvgate.kernels.triton_sample import STEP_SEED_STRIDE, row_seed
            from kvgate.kernels.triton_sample import sample as fused_sample

            inv_t = to_device([0.0 if p.greedy else 1.0 / p.temperature for p in params], torch.float32, dev)
            noise: torch.Tensor | int = self._seeds.getrandbits(32)
            own = [i for i in plain if rows[i].generator is not None]
            if own:  # a seeded row's noise: its seed, sample and position (the same in any batch)
                seeds = [(noise + i * STEP_SEED_STRIDE) & 0xFFFFFFFF for i in range(len(rows))]
                for i in own:
                    seq = rows[i]
                    seeds[i] = row_seed(params[i].seed, seq.index, seq.num_output_tokens + seq.num_pending - ahead)
                noise = to_device(seeds, torch.int64, dev)
            if mask_in_kernel:
                bitmask, valid = guide.on_device(len(rows), dev)  # type: ignore[union-attr]
                tokens = fused_sample(logits, inv_t, noise, bitmask, guide.mask_rows(len(rows), dev),  # type: ignore
                                      valid)
            else:
                tokens = fused_sample(logits, inv_t, noise)
            rest = sorted(set(sampled) - set(plain))
            if rest:
                s = to_device(rest, torch.long, dev)
                tokens[s] = self._sample(logits[s], [rows[i] for i in rest])
        elif len(sampled) == len(rows):
            tokens = self._sample(logits, rows)
        else:
            tokens = argmax(logits)
            s = to_device(sampled, torch.long, dev)
            tokens[s] = self._sample(logits[s], [rows[i] for i in sampled])
        host = [_to_host(tokens)]
        if raw is not None:
            chosen = raw.gather(1, tokens[lp_index][:, None])  # type: ignore[possibly-undefined]
            host += [_to_host(chosen[:, 0]), _to_host((raw > chosen).sum(dim=1) + 1)]
            top = max(params[i].logprobs for i in lp_rows)  # type: ignore[type-var]
            if top:
                vals, ids = raw.topk(top)
                host += [_to_host(vals), _to_host(ids)]
        ready = None
        if dev.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        return SampledTokens(tokens, host, ready, rows, lp_rows, guide, raw if guide is not None else None)

    def result(self, s: SampledTokens) -> SamplerOutput:
        """The sampled tokens and logprobs on the host (waiting for their copies only, not for later work on the
        device); the guided rows' tokens accepted into their matchers, which may replace one (the budget-aware
        finish)."""
        if s.ready is not None:
            s.ready.synchronize()
        token_list = s.host[0].tolist()
        drawn = list(token_list) if s.guide is not None else token_list
        if s.guide is not None:
            token_list = s.guide.accept(token_list)
        out: list[tuple[float, int, list[tuple[int, float]]] | None] = [None] * len(s.rows)
        if s.logprob_rows:
            chosen, ranks = s.host[1].tolist(), s.host[2].tolist()
            vals, ids = (s.host[3].tolist(), s.host[4].tolist()) if len(s.host) > 3 else (None, None)
            for j, i in enumerate(s.logprob_rows):
                k = s.rows[i].request.sampling_params.logprobs
                top = list(zip(ids[j][:k], vals[j][:k])) if k else []  # type: ignore[index]
                lp, rank = chosen[j], ranks[j]
                if token_list[i] != drawn[i]:  # a guide replaced it: its own logprob and rank
                    row = s.raw_logprobs[j]  # type: ignore[index]
                    lp = float(row[token_list[i]])
                    rank = int((row > lp).sum()) + 1
                out[i] = (lp, rank, top)
        return SamplerOutput(token_list, out, drawn)

    def _apply_penalties(self, logits: torch.Tensor, rows: list[Sequence], which: list[int]) -> None:
        """Repetition (prompt and output tokens), frequency and presence penalties (output tokens), for the rows
        `which`, batched: token counts by one scatter over the rows' padded token ids."""
        dev, vocab = logits.device, logits.shape[1]
        params = [rows[i].request.sampling_params for i in which]

        def counts_of(lists: list[list[int]]) -> torch.Tensor:
            width = max(1, max(len(x) for x in lists))
            padded = [[min(t, vocab - 1) for t in x] + [vocab] * (width - len(x)) for x in lists]  # vocab: padding
            ids = to_device(padded, torch.long, dev)
            c = torch.zeros((len(lists), vocab + 1), device=dev).scatter_add_(1, ids, torch.ones(ids.shape, device=dev))
            return c[:, :vocab]

        counts = counts_of([rows[i].output_token_ids for i in which])
        index = to_device(which, torch.long, dev)
        sub = logits[index]
        rep = to_device([p.repetition_penalty for p in params], torch.float32, dev)[:, None]
        if any(p.repetition_penalty != 1.0 for p in params):
            seen = (counts > 0) | (counts_of([rows[i].token_ids[: rows[i].num_prompt_tokens] for i in which]) > 0)
            sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        freq = to_device([p.frequency_penalty for p in params], torch.float32, dev)[:, None]
        pres = to_device([p.presence_penalty for p in params], torch.float32, dev)[:, None]
        logits[index] = sub - freq * counts - pres * (counts > 0).float()

    def _apply_min_tokens(self, logits: torch.Tensor, rows: list[Sequence], which: list[int]) -> None:
        """Ban stop tokens below min_tokens; in a guided row, never all of what its grammar allows (the grammar
        wins: a document that may only end here ends here)."""
        r_idx, t_idx = [], []
        for i in which:
            seq, p = rows[i], rows[i].request.sampling_params
            ids = [t for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
                   if t < logits.shape[1]]
            if not ids:
                continue
            if seq.grammar is not None:  # rare: guided and min_tokens; this row's check waits for the device
                kept = logits[i, ids].clone()
                logits[i, ids] = float("-inf")
                if not bool(torch.isfinite(logits[i]).any()):
                    logits[i, ids] = kept
                continue
            r_idx += [i] * len(ids)
            t_idx += ids
        if r_idx:
            dev = logits.device
            logits[to_device(r_idx, torch.long, dev), to_device(t_idx, torch.long, dev)] = float("-inf")

    def _sample(self, logits: torch.Tensor, rows: list[Sequence]) -> torch.Tensor:
        params = [s.request.sampling_params for s in rows]
        dev = logits.device
        logits = logits / to_device([p.temperature for p in params], torch.float32, dev)[:, None]
        top_k = [p.top_k for p in params]
        if any(top_k):
            vocab = logits.shape[1]  # k >= vocab (any int, however large) keeps every token
            k = to_device([k if 0 < k < vocab else vocab for k in top_k], torch.long, dev)
            kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if any(p.top_p < 1.0 for p in params):
            top_p = to_device([p.top_p for p in params], torch.float32, dev)
            sorted_logits, idx = logits.sort(dim=-1, descending=True)
            cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            drop = cum - sorted_logits.softmax(dim=-1) >= top_p[:, None]  # keep the smallest set reaching top_p
            drop[:, 0] = False
            logits = logits.masked_fill(torch.zeros_like(drop).scatter(1, idx, drop), float("-inf"))
        probs = logits.softmax(dim=-1)
        if any(p.min_p > 0 for p in params):
            min_p = to_device([p.min_p for p in params], torch.float32, dev)
            probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
        # inverse-CDF sampling: one uniform draw per row, looked up in the row's cumulative probabilities (float64);
        # a draw per token (an exponential race) took 4.3 ms of a CPU decode step for 16 x 49,152. Seeded rows draw
        # from their own generator
        seeded = [i for i, seq in enumerate(rows) if seq.generator is not None]
        shape = (len(rows), 1)
        u = torch.empty(shape, dtype=torch.float64, device=dev) if len(seeded) == len(rows) else \
            torch.rand(shape, dtype=torch.float64, device=dev)  # (no row's draw taken twice)
        for i in seeded:
            u[i] = torch.rand(1, dtype=torch.float64, generator=rows[i].generator, device=dev)
        cdf = probs.to(torch.float64).cumsum_(dim=-1)
        total = cdf[:, -1:]
        # below the total, strictly: the first entry above the draw then belongs to a token of non-zero probability
        x = torch.minimum(u * total, total * (1 - 2 ** -52))
        return torch.searchsorted(cdf, x, right=True)[:, 0].clamp_(max=probs.shape[1] - 1)
