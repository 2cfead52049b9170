"""What the engine returns: RequestOutput with one CompletionOutput per sample, or PoolingRequestOutput with the
embedding of a pooling request (vLLM's shapes)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __reduce__(self) -> tuple:  # pickled as a constructor call: 3x faster to load than a dataclass's __dict__
        return CompletionOutput, (self.index, self.text, self.token_ids, self.cumulative_logprob, self.logprobs,
                                  self.finish_reason, self.stop_reason)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)

    def __reduce__(self) -> tuple:  # the engine core's process sends one per request and step
        return RequestOutput, (self.request_id, self.prompt, self.prompt_token_ids, self.outputs, self.finished,
                               self.num_cached_tokens, self.metrics)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)


@dataclass
class PoolingOutput:
    """A pooling request's result: the embedding as a list of floats (float32 values; its length is the model's
    hidden size, or the request's `dimensions`). Empty only in the final output of an aborted request."""
    embedding: list[float]

    @property
    def data(self) -> "torch.Tensor":
        """The embedding as a float32 tensor (vLLM's PoolingOutput.data)."""
        import torch

        return torch.tensor(self.embedding, dtype=torch.float32)


@dataclass
class PoolingRequestOutput:
    """What a pooling (embedding) request returns: one output, finished, when its prompt has been prefilled and
    pooled (vLLM's shape; `LLM.embed` / `LLM.encode` / `AsyncLLMEngine.encode`). Plain data: it pickles across
    the engine core's pipe."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True
    num_cached_tokens: int = 0  # as RequestOutput's
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


EngineOutput = RequestOutput | PoolingRequestOutput  # what LLMEngine.step() returns per request

# The common streamed output (DELTA, one sample, no logprobs) as the engine core's process sends it, a plain tuple:
# (request_id, sample index, text, token_ids, finish_reason, stop_reason, finished, num_cached_tokens,
# arrival_time, first_token_time). A core step streams one output per running request; building and pickling the
# tuple costs ~0.5 us a request, the RequestOutput and CompletionOutput it stands for ~3 us. The API process makes
# the RequestOutput (`from_delta_tuple`).
DeltaTuple = tuple
DELTA_FINISHED = 6  # the index of `finished` in a DeltaTuple


def from_delta_tuple(t: DeltaTuple) -> RequestOutput:
    rid, index, text, token_ids, finish_reason, stop_reason, finished, cached, arrival, first_token = t
    metrics = {"arrival_time": arrival} if first_token is None else {"arrival_time": arrival,
                                                                      "first_token_time": first_token}
    return RequestOutput(rid, None, None, [CompletionOutput(index, text, token_ids, None, None, finish_reason,
                                                            stop_reason)], finished, cached, metrics)
