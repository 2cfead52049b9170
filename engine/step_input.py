"""StepInput: what one step asks of every rank's ModelRunner (vLLM's SchedulerOutput, as plain data).

The engine core schedules once; the runners (one per rank, some in other processes) never read the scheduler's live
Sequence objects. Each keeps its own copy of every sequence it is running (token ids and block table, RunnerState),
and a step's message only carries what changed since the last one:
- sequences scheduled for the first time (or again after a preemption dropped their blocks): all their token ids and
  their block table;
- for the others, the tokens sampled since (one per decode step) and the blocks added;
- the sequences whose blocks were dropped (finished, aborted, preempted), which the runners forget;
- per scheduled sequence (decodes first): how many tokens it computes, how many are already in the KV cache, and
  whether its logits are sampled (all decided once, by the scheduler);
- with async scheduling, the sequences whose last input token was sampled by the step before and is not on the host
  yet: the runner takes it from that step's sampled tokens, on the device.
So what crosses a process each step is a few integers per sequence, whatever the prompt lengths. The additions are
flat lists of ints (no object per sequence), which keeps a step's allocations, and the garbage collector's work,
small.

StepInputBuilder (engine side) remembers what the runners were sent; RunnerState (runner side) applies a message to
its persistent batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kvgate.engine.scheduler import SchedulerOutput


@dataclass
class NewSequence:
    seq_id: int
    token_ids: list[int]
    block_table: list[int]


@dataclass
class StepInput:
    seq_ids: list[int] = field(default_factory=list)  # the scheduled sequences, decodes first
    num_new_tokens: list[int] = field(default_factory=list)  # tokens each computes this step
    num_computed_tokens: list[int] = field(default_factory=list)  # its tokens already in the KV cache
    samples: list[bool] = field(default_factory=list)  # its logits are wanted (it computes all its tokens)
    num_decodes: int = 0  # the first num_decodes sequences compute one token each
    # async scheduling: scheduled sequence pending_rows[i]'s last input token is row pending_src[i] of the tokens the
    # previous step sampled (still on the device)
    pending_rows: list[int] = field(default_factory=list)
    pending_src: list[int] = field(default_factory=list)
    new_seqs: list[NewSequence] = field(default_factory=list)
    # what known sequences gained since their last step, flat: the i-th of added_seq_ids gained added_num_tokens[i]
    # tokens (in order in added_tokens) and added_num_blocks[i] blocks (in added_blocks)
    added_seq_ids: list[int] = field(default_factory=list)
    added_num_tokens: list[int] = field(default_factory=list)
    added_tokens: list[int] = field(default_factory=list)
    added_num_blocks: list[int] = field(default_factory=list)
    added_blocks: list[int] = field(default_factory=list)
    freed: list[int] = field(default_factory=list)  # sequences to forget (before new_seqs are read)
    # the offload tiers' ops, in order, before the step's forward: copies between the cache and CPU memory, and the
    # disk tier's spills, fetches and deletes (their forms: engine/kv_offload/tier.py)
    offload_ops: list[tuple] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)


class StepInputBuilder:
    """The engine's record of what the runners hold: per sequence, how many of its tokens and blocks were sent."""

    def __init__(self) -> None:
        self.sent: dict[int, list[int]] = {}  # seq id -> [tokens sent, blocks sent]

    def build(self, out: SchedulerOutput, freed: list[int], offload_ops: list[tuple] | None = None,
              sampled_rows: dict[int, int] | None = None) -> StepInput:
        """The message for a scheduler output; `freed`: ids of the sequences whose blocks were dropped since the last
        message (BlockManager.take_freed); `offload_ops`: OffloadTier.take_ops(); `sampled_rows`: seq id -> its row
        in the tokens the step before sampled, for the sequences whose last token is still pending (async)."""
        sent = self.sent
        scheduled = out.scheduled
        msg = StepInput([s.seq_id for s, _ in scheduled], [n for _, n in scheduled], out.num_computed, out.samples,
                        out.num_decodes, freed=[i for i in freed if sent.pop(i, None) is not None],
                        offload_ops=offload_ops or [])
        if sampled_rows:
            for i, ((seq, n), c) in enumerate(zip(scheduled, out.num_computed)):
                if seq.num_pending and c + n > len(seq.token_ids):  # (a prompt chunk may stop short of it)
                    msg.pending_rows.append(i)
                    msg.pending_src.append(sampled_rows[seq.seq_id])
        add_id, add_nt, add_nb = msg.added_seq_ids.append, msg.added_num_tokens.append, msg.added_num_blocks.append
        add_token, add_block = msg.added_tokens.append, msg.added_blocks.append
        for seq, _ in scheduled:
            sid, tokens, table = seq.seq_id, seq.token_ids, seq.block_table
            known = sent.get(sid)
            if known is None:
                msg.new_seqs.append(NewSequence(sid, list(tokens), list(table)))
                sent[sid] = [len(tokens), len(table)]
                continue
            nt, nb = len(tokens) - known[0], len(table) - known[1]
            if nt or nb:
                add_id(sid)
                add_nt(nt)
                add_nb(nb)
                if nt == 1:
                    add_token(tokens[-1])
                elif nt:
                    msg.added_tokens.extend(tokens[known[0]:])
                if nb == 1:
                    add_block(table[-1])
                elif nb:
                    msg.added_blocks.extend(table[known[1]:])
                known[0] += nt
                known[1] += nb
        return msg


@dataclass
class SeqState:
    token_ids: list[int]
    row: int  # its row of the RunnerState's arrays


class RunnerState:
    """A runner's copy of the sequences it runs, kept up to date by each step's message, as a persistent batch (vLLM's
    InputBatch): every sequence holds a row of numpy arrays (its block table, its number of tokens and its last
    token) from its first step to its last, a message writes only what changed, and a step's tensors are gathered
    from the scheduled rows in a few array operations (ModelRunner.prepare). The token lists serve prompt chunks."""

    def __init__(self, rows: int = 64, width: int = 16) -> None:
        self.seqs: dict[int, SeqState] = {}
        self.block_tables = np.zeros((rows, width), dtype=np.int32)  # padded with 0 past a row's num_blocks
        self.num_blocks = np.zeros(rows, dtype=np.int64)
        self.num_tokens = np.zeros(rows, dtype=np.int64)
        self.last_token = np.zeros(rows, dtype=np.int64)
        self.free_rows = list(range(rows - 1, -1, -1))  # popped from the end: the lowest row first

    def block_table(self, seq_id: int) -> list[int]:
        row = self.seqs[seq_id].row
        return self.block_tables[row, :self.num_blocks[row]].tolist()

    def apply(self, msg: StepInput) -> np.ndarray:
        """Take the message's changes; returns the scheduled sequences' rows, in its order."""
        seqs = self.seqs
        for sid in msg.freed:
            gone = seqs.pop(sid, None)
            if gone is not None:
                self.block_tables[gone.row, :self.num_blocks[gone.row]] = 0
                self.free_rows.append(gone.row)
        for new in msg.new_seqs:
            if not self.free_rows:
                self._grow(rows=2 * len(self.num_blocks))
            row = self.free_rows.pop()
            seqs[new.seq_id] = SeqState(new.token_ids, row)
            self.num_blocks[row] = 0
            self._add_blocks(row, new.block_table)
            self.num_tokens[row] = len(new.token_ids)
            self.last_token[row] = new.token_ids[-1] if new.token_ids else 0
        if msg.added_seq_ids:
            t = b = 0
            rows = []
            tokens, blocks = msg.added_tokens, msg.added_blocks
            for sid, nt, nb in zip(msg.added_seq_ids, msg.added_num_tokens, msg.added_num_blocks):
                s = seqs[sid]
                rows.append(s.row)
                if nt == 1:
                    s.token_ids.append(tokens[t])
                elif nt:
                    s.token_ids.extend(tokens[t:t + nt])
                if nb:
                    self._add_blocks(s.row, blocks[b:b + nb])
                t += nt
                b += nb
            added = np.asarray(msg.added_num_tokens, dtype=np.int64)
            at = np.asarray(rows, dtype=np.int64)
            self.num_tokens[at] += added
            gained = added > 0
            self.last_token[at[gained]] = np.asarray(tokens, dtype=np.int64)[np.cumsum(added)[gained] - 1]
        return np.fromiter((seqs[sid].row for sid in msg.seq_ids), dtype=np.int64, count=len(msg.seq_ids))

    def _add_blocks(self, row: int, blocks: list[int]) -> None:
        start = int(self.num_blocks[row])
        end = start + len(blocks)
        if end > self.block_tables.shape[1]:
            self._grow(width=max(end, 2 * self.block_tables.shape[1]))
        self.block_tables[row, start:end] = blocks
        self.num_blocks[row] = end

    def _grow(self, rows: int | None = None, width: int | None = None) -> None:
        old_rows, old_width = self.block_tables.shape
        rows, width = rows or old_rows, width or old_width
        tables = np.zeros((rows, width), dtype=np.int32)
        tables[:old_rows, :old_width] = self.block_tables
        self.block_tables = tables
        for name in ("num_blocks", "num_tokens", "last_token"):
            grown = np.zeros(rows, dtype=np.int64)
            grown[:old_rows] = getattr(self, name)
            setattr(self, name, grown)
        self.free_rows[:0] = range(rows - 1, old_rows - 1, -1)  # below the free rows already there: taken last
