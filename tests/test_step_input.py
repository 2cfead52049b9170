"""StepInput: what the engine sends the runners each step, and the runners' copy of the sequences it keeps."""
from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from kvgate.engine.model_runner import ModelRunner
from kvgate.engine.scheduler import SchedulerOutput
from kvgate.engine.step_input import RunnerState, StepInputBuilder


def seq(seq_id: int, tokens: list[int], table: list[int], computed: int = 0) -> SimpleNamespace:
    return SimpleNamespace(seq_id=seq_id, token_ids=tokens, block_table=table, num_computed_tokens=computed,
                           num_pending=0)


def planned(pairs: list[tuple[SimpleNamespace, int]]) -> SchedulerOutput:
    """A scheduler output for (seq, new tokens) pairs, each seq's num_computed_tokens read as before the step."""
    return SchedulerOutput(pairs, [s.num_computed_tokens for s, _ in pairs],
                           [s.num_computed_tokens + n == len(s.token_ids) + s.num_pending for s, n in pairs],
                           sum(1 for s, n in pairs if n == 1))


def test_new_sequences_come_whole_then_only_what_they_gained() -> None:
    builder, state = StepInputBuilder(), RunnerState()
    a, b = seq(1, [5, 6, 7], [0]), seq(2, list(range(40)), [3, 4])
    msg = builder.build(planned([(a, 3), (b, 32)]), [])
    assert [n.seq_id for n in msg.new_seqs] == [1, 2] and not msg.added_seq_ids
    rows = state.apply(msg)
    assert rows.tolist() == [0, 1]  # the lowest free rows of the persistent batch
    assert [state.seqs[i].token_ids for i in (1, 2)] == [[5, 6, 7], list(range(40))]
    assert state.seqs[1].token_ids is not a.token_ids  # a copy: the engine's list keeps growing on its own
    assert state.num_tokens[rows].tolist() == [3, 40] and state.last_token[rows].tolist() == [7, 39]

    a.token_ids.append(8)
    a.num_computed_tokens = 3
    b.block_table += [9, 10, 11]  # a prompt chunk that needed three more blocks
    b.num_computed_tokens = 32
    msg = builder.build(planned([(a, 1), (b, 8)]), [])
    assert msg.seq_ids == [1, 2] and msg.num_new_tokens == [1, 8] and msg.num_computed_tokens == [3, 32]
    assert (msg.added_seq_ids, msg.added_num_tokens, msg.added_tokens) == ([1, 2], [1, 0], [8])
    assert (msg.added_num_blocks, msg.added_blocks) == ([0, 3], [9, 10, 11])
    assert state.apply(msg).tolist() == [0, 1]
    assert state.seqs[1].token_ids == [5, 6, 7, 8] and state.block_table(2) == [3, 4, 9, 10, 11]
    assert state.num_tokens[:2].tolist() == [4, 40] and state.last_token[:2].tolist() == [8, 39]

    msg = builder.build(planned([(b, 1)]), [])  # nothing new for b; a not scheduled
    assert not msg.added_seq_ids and not msg.new_seqs
    state.apply(msg)


def test_freed_sequences_are_forgotten_and_come_back_whole() -> None:
    builder, state = StepInputBuilder(), RunnerState()
    a = seq(1, [5, 6, 7], [0])
    state.apply(builder.build(planned([(a, 3)]), []))
    a.token_ids.append(9)
    a.block_table = [4]  # preempted (blocks dropped), then scheduled again with new blocks
    msg = builder.build(planned([(a, 4)]), [1, 77])  # 77: never sent, nothing to forget
    assert msg.freed == [1] and [n.token_ids for n in msg.new_seqs] == [[5, 6, 7, 9]]
    (row,) = state.apply(msg)
    assert state.seqs[1].token_ids == [5, 6, 7, 9] and state.block_table(1) == [4]
    assert state.block_tables[row].tolist()[:3] == [4, 0, 0]  # the row's old table is gone
    msg = builder.build(planned([]), [1])
    state.apply(msg)
    assert msg.freed == [1] and state.seqs == {} and builder.sent == {}
    assert not state.block_tables.any()  # a freed row is cleared for its next sequence


def test_the_persistent_batch_grows_and_reuses_rows() -> None:
    """More sequences than rows, and block tables wider than the arrays: both grow, the contents kept; a freed row
    goes to the next new sequence."""
    builder, state = StepInputBuilder(), RunnerState(rows=2, width=2)
    seqs = [seq(i, [i, i + 1], [10 * i + j for j in range(3 + i)]) for i in range(5)]
    rows = state.apply(builder.build(planned([(s, 2) for s in seqs]), []))
    assert sorted(rows.tolist()) == list(range(5)) and state.block_tables.shape[0] >= 5
    assert [state.block_table(s.seq_id) for s in seqs] == [s.block_table for s in seqs]
    seqs[1].token_ids.append(7)
    seqs[1].block_table.append(99)
    freed_row = state.seqs[3].row
    late = seq(9, [4], [5])
    rows = state.apply(builder.build(planned([(seqs[1], 1), (late, 1)]), [3]))
    assert rows.tolist() == [state.seqs[1].row, freed_row]
    assert state.block_table(1) == [10, 11, 12, 13, 99] and state.block_table(9) == [5]
    assert state.last_token[state.seqs[1].row] == 7 and state.num_tokens[freed_row] == 1


def test_pending_tokens_point_at_the_rows_the_step_before_sampled() -> None:
    """Async scheduling: a sequence whose last token is still on the device is told where to find it."""
    builder = StepInputBuilder()
    a, b = seq(1, [5, 6, 7], [0], computed=3), seq(2, [1, 2], [1], computed=1)
    a.num_pending = 1  # its 4th token was sampled by the step in flight, as that step's row 2
    msg = builder.build(planned([(a, 1), (b, 1)]), [], sampled_rows={1: 2, 2: 0})
    assert (msg.pending_rows, msg.pending_src) == ([0], [2]) and msg.samples == [True, True]
    assert msg.new_seqs[0].token_ids == [5, 6, 7]  # what the host has: the pending token comes on the device


def test_runner_step_tensors_from_the_persistent_batch() -> None:
    """ModelRunner.prepare over random steps (prompt chunks, decodes, tokens pending on the device, sequences
    finished, preempted and sent again, more sequences than rows, tables wider than the arrays) gives the tensors
    that follow from the engine's own sequences."""
    rng, bs = random.Random(7), 4
    runner = SimpleNamespace(block_size=bs, state=RunnerState(rows=2, width=2), device=torch.device("cpu"))
    builder, next_block, next_id = StepInputBuilder(), [1], [0]
    live: list[SimpleNamespace] = []

    def blocks_for(s: SimpleNamespace, tokens: int) -> None:
        while len(s.block_table) * bs < tokens:
            s.block_table.append(next_block[0])
            next_block[0] += 1

    sampled_rows: dict[int, int] = {}
    sampled = torch.zeros(0, dtype=torch.long)
    seen = dict.fromkeys(["pending decodes", "pending chunk ends", "sent again"], 0)
    for _ in range(60):
        freed = []
        for s in list(live):
            if rng.random() < 0.08 and not s.num_pending:  # finished, or preempted: blocks dropped
                freed.append(s.seq_id)
                live.remove(s)
                if rng.random() < 0.5:
                    s.block_table, s.num_computed_tokens = [], 0
                    live.append(s)
        while len(live) < 6 or rng.random() < 0.2:
            live.append(seq(next_id[0], [rng.randrange(1000) for _ in range(rng.randint(1, 11))], []))
            next_id[0] += 1
        decodes, chunks = [], []
        for s in rng.sample(live, rng.randint(1, len(live))):
            if s.num_pending and s.num_computed_tokens and rng.random() < 0.2:
                s.num_computed_tokens -= 1  # a rewind: the position before the pending token is computed again
            left = len(s.token_ids) + s.num_pending - s.num_computed_tokens
            if left == 1:
                decodes.append((s, 1))
            elif left > 1:
                chunks.append((s, rng.randint(1, left)))
        pairs = decodes + chunks
        for s, n in pairs:
            blocks_for(s, s.num_computed_tokens + n)
        out = planned(pairs)
        out.num_decodes = len(decodes)  # (a one-token prompt chunk is no decode)
        msg = builder.build(out, freed, None, sampled_rows)
        ids, positions, md, logits_rows = ModelRunner.prepare(runner, msg, sampled)  # type: ignore[arg-type]
        seen["pending decodes"] += sum(1 for i in msg.pending_rows if i < len(decodes))
        seen["pending chunk ends"] += sum(1 for i in msg.pending_rows if i >= len(decodes))
        seen["sent again"] += sum(1 for new in msg.new_seqs if new.seq_id in freed)

        want_ids, want_pos, want_slots, starts, lens, tables, want_rows = [], [], [], [0], [], [], []
        for s, n in pairs:
            c = s.num_computed_tokens
            for p in range(c, c + n):
                want_ids.append(s.token_ids[p] if p < len(s.token_ids) else int(sampled[sampled_rows[s.seq_id]]))
                want_pos.append(p)
                want_slots.append(s.block_table[p // bs] * bs + p % bs)
            starts.append(starts[-1] + n)
            lens.append(c + n)
            if c + n == len(s.token_ids) + s.num_pending:
                want_rows.append(starts[-1] - 1)
        width = max(len(s.block_table) for s, _ in pairs)
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s, _ in pairs]
        assert ids.tolist() == want_ids and positions.tolist() == want_pos
        assert md.slot_mapping.tolist() == want_slots and md.query_start_loc.tolist() == starts == md.query_start_loc_cpu
        assert md.seq_lens.tolist() == lens == md.seq_lens_cpu and md.block_tables.tolist() == tables
        assert logits_rows == want_rows and md.num_decodes == len(decodes)
        assert md.max_query_len == max(n for _, n in pairs) and md.max_seq_len == max(lens)

        # the step before completes: its tokens reach the host; this step's sampled rows draw a token, some of them
        # left on the device for the next step (async scheduling)
        for s in live:
            if s.num_pending:
                s.token_ids.append(int(sampled[sampled_rows[s.seq_id]]))
                s.num_pending = 0
        sampled_rows = {}
        drawn = []
        for s, n in pairs:
            s.num_computed_tokens += n
        for s, n in pairs:
            if s.num_computed_tokens == len(s.token_ids):
                token = rng.randrange(1000)
                if rng.random() < 0.5:  # async: stays on the device for the next step
                    s.num_pending = 1
                    sampled_rows[s.seq_id] = len(drawn)
                    drawn.append(token)
                else:
                    s.token_ids.append(token)
        sampled = torch.tensor(drawn, dtype=torch.long)
    assert runner.state.block_tables.shape[0] > 2 and runner.state.block_tables.shape[1] > 2  # both grew
    assert min(seen.values()) > 0, seen
