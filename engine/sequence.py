"""Request and Sequence: the engine's bookkeeping for one request and each of its n samples."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import TYPE_CHECKING

import torch

from kvgate.engine.pooling_params import PoolingParams
from kvgate.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvgate.engine.structured_output.grammar import SequenceGrammar

DEFAULT_PRIORITY = 50
_seq_ids = itertools.count()


class SequenceStatus(Enum):
    WAITING = auto()
    WAITING_FOR_FSM = auto()  # a guided request whose grammar is still compiling: in no scheduler queue yet
    RUNNING = auto()
    FINISHED = auto()


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = DEFAULT_PRIORITY
    max_batch_delay: float | None = None  # seconds; caps scheduler_delay for this request
    arrival_time: float = field(default_factory=time.monotonic)
    seqs: list["Sequence"] = field(default_factory=list)
    forked: bool = False  # n > 1: the other samples were forked from seqs[0]
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # a pooling (embedding) request: its prompt is prefilled, pooled, and it finishes (sampling_params then holds
    # the defaults, n=1, and is not used for output)
    pooling_params: PoolingParams | None = None
    skip_reading_prefix_cache: bool = False  # vLLM's name: its pooling needs every prompt token's hidden state
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache (or its offload tier) when first
    # scheduled (vLLM's RequestOutput.num_cached_tokens)

    @property
    def max_output_tokens(self) -> int | None:
        """Tokens this request may add to its prompt: 0 for a pooling request, else max_tokens (None: until
        max_model_len)."""
        return 0 if self.pooling_params is not None else self.sampling_params.max_tokens

    @property
    def finished(self) -> bool:
        if len(self.seqs) == 1:  # hot: read for every request in every step
            return self.seqs[0].status is SequenceStatus.FINISHED
        return all(s.status is SequenceStatus.FINISHED for s in self.seqs)


class Sequence:
    """One token stream: the prompt plus what has been sampled for it. The scheduler's unit of work."""

    def __init__(self, request: Request, index: int, token_ids: list[int]) -> None:
        self.seq_id = next(_seq_ids)
        self.request = request
        self.index = index  # which of the request's n samples this is
        self.token_ids = token_ids
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache, or will be once the steps in flight ran
        # tokens sampled on the device and not yet on the host (async scheduling: up to 2, the inputs of a step in
        # flight; else up to 1 while this sequence's step is in flight)
        self.num_pending = 0
        self.block_table: list[int] = []
        self.num_hashed_blocks = 0  # leading blocks already registered in the prefix cache
        self.loading: int | None = None  # the offload tier's load batch its blocks wait for (loads aside)
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict[int, float]] = []
        self.generator: torch.Generator | None = None
        self.num_preemptions = 0
        self.pooled: torch.Tensor | None = None  # pooling requests: state across prefill chunks (engine/pooler.py)
        self.grammar: SequenceGrammar | None = None  # guided decoding: this sample's matcher (structured_output/)
        # detokenizer state (engine/detokenizer.py)
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0
        self.pending_bytes = b""  # byte-level tokenizers: the bytes of a character not complete yet
        self.sent_text_len = 0
        self.sent_token_len = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (f"Sequence({self.request.request_id}#{self.index}, len={len(self)}, "
                f"computed={self.num_computed_tokens}, {self.status.name})")

    @property
    def num_tokens(self) -> int:
        """Its tokens, the pending ones included: what the scheduler plans with."""
        return len(self.token_ids) + self.num_pending

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def tokens_left(self, max_model_len: int) -> int:
        """Tokens this sequence may still produce, counting those on the host: the fewer of what max_tokens leaves
        and the room left in max_model_len (0: it is done, "length")."""
        room = max_model_len - len(self.token_ids)
        max_tokens = self.request.sampling_params.max_tokens
        return room if max_tokens is None else min(room, max_tokens - self.num_output_tokens)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def priority(self) -> int:
        return self.request.priority

    @property
    def arrival_time(self) -> float:
        return self.request.arrival_time
