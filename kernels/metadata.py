"""AttentionMetadata: what an attention backend needs to know about one model step.

The batch is flat: the new tokens of every scheduled sequence, concatenated, decodes first
(`num_decodes` sequences with exactly one new token), then prefills/chunks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of every new token (-1: do not store)
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: where each sequence's new tokens start
    seq_lens: torch.Tensor  # [num_seqs] int32: context length after this step (cached + new)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32: physical block ids, padded with 0
    num_decodes: int  # the first num_decodes sequences have exactly one new token each
    max_query_len: int
    max_seq_len: int
    block_size: int
    # host copies, so that CPU-side loops need no device sync
    query_start_loc_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None
    # decode split-K partition size fixed by the caller (CUDA graphs: no host lengths); None: chosen per step
    decode_partition_size: int | None = None
    # what a backend derives from the above once per step and reuses in every layer (the torch backend's gather plan)
    scratch: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes
