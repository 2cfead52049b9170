"""StepInput: what the engine sends the runners each step, and the runners' copy of the sequences it keeps."""
from __future__ import annotations

from types import SimpleNamespace

from kvgate.engine.step_input import RunnerState, StepInputBuilder


def seq(seq_id: int, tokens: list[int], table: list[int], computed: int = 0) -> SimpleNamespace:
    return SimpleNamespace(seq_id=seq_id, token_ids=tokens, block_table=table, num_computed_tokens=computed)


def test_new_sequences_come_whole_then_only_what_they_gained() -> None:
    builder, state = StepInputBuilder(), RunnerState()
    a, b = seq(1, [5, 6, 7], [0]), seq(2, list(range(40)), [3, 4])
    msg = builder.build([(a, 3), (b, 32)], [])
    assert [n.seq_id for n in msg.new_seqs] == [1, 2] and not msg.added_seq_ids
    states = state.apply(msg)
    assert [s.token_ids for s in states] == [[5, 6, 7], list(range(40))]
    assert states[0].token_ids is not a.token_ids  # a copy: the engine's list keeps growing on its own

    a.token_ids.append(8)
    a.num_computed_tokens = 3
    b.block_table += [9, 10, 11]  # a prompt chunk that needed three more blocks
    b.num_computed_tokens = 32
    msg = builder.build([(a, 1), (b, 8)], [])
    assert msg.seq_ids == [1, 2] and msg.num_new_tokens == [1, 8] and msg.num_computed_tokens == [3, 32]
    assert (msg.added_seq_ids, msg.added_num_tokens, msg.added_tokens) == ([1, 2], [1, 0], [8])
    assert (msg.added_num_blocks, msg.added_blocks) == ([0, 3], [9, 10, 11])
    states = state.apply(msg)
    assert states[0].token_ids == [5, 6, 7, 8] and states[1].block_table == [3, 4, 9, 10, 11]

    msg = builder.build([(b, 1)], [])  # nothing new for b; a not scheduled
    assert not msg.added_seq_ids and not msg.new_seqs
    state.apply(msg)


def test_freed_sequences_are_forgotten_and_come_back_whole() -> None:
    builder, state = StepInputBuilder(), RunnerState()
    a = seq(1, [5, 6, 7], [0])
    state.apply(builder.build([(a, 3)], []))
    a.token_ids.append(9)
    a.block_table = [4]  # preempted (blocks dropped), then scheduled again with new blocks
    msg = builder.build([(a, 4)], [1, 77])  # 77: never sent, nothing to forget
    assert msg.freed == [1] and [n.token_ids for n in msg.new_seqs] == [[5, 6, 7, 9]]
    (s,) = state.apply(msg)
    assert s.token_ids == [5, 6, 7, 9] and s.block_table == [4]
    msg = builder.build([], [1])
    state.apply(msg)
    assert msg.freed == [1] and state.seqs == {} and builder.sent == {}
