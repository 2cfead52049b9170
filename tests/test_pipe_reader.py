"""engine/pipe_reader.py: messages written by Connection.send on a real pipe come out whole, in order, several per
read when several wait; the end of the pipe is EOFError, and a message cut by the writer's end is never returned."""
from __future__ import annotations

import multiprocessing
import os
import pickle
import struct

import pytest

from kvgate.engine.engine_core import CoreOutputs, merge_core_outputs
from kvgate.engine.outputs import CompletionOutput, RequestOutput
from kvgate.engine.pipe_reader import READ_SIZE, PipeReader
from kvgate.engine.sampling_params import SamplingParams


def _send_all(conn, messages: list) -> None:
    for m in messages:
        conn.send(m)
    conn.close()


def read_until_eof(reader: PipeReader) -> tuple[list, list[int]]:
    """Every message until EOF, and how many each read() returned."""
    got, per_read = [], []
    while True:
        try:
            batch = reader.read()
        except EOFError:
            return got, per_read
        got += batch
        per_read.append(len(batch))


def test_messages_of_every_size_from_another_process_arrive_whole_and_in_order() -> None:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    messages = [("add", "r1", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=4)),
                "x" * 16_000, b"\x00" * 16_385,  # either side of Connection's one-write limit
                list(range(600_000)),  # several reads of READ_SIZE
                *[("abort", f"r{i}") for i in range(500)], None]
    assert len(pickle.dumps(messages[3])) > 2 * READ_SIZE
    p = ctx.Process(target=_send_all, args=(child, messages))
    p.start()
    child.close()
    got, per_read = read_until_eof(PipeReader(parent))
    p.join(30)
    assert got == messages and sum(per_read) == len(messages)


def test_one_read_returns_every_message_waiting() -> None:
    a, b = multiprocessing.Pipe()
    for i in range(50):
        a.send(("abort", f"r{i}"))
    reader = PipeReader(b)
    assert reader.read() == [("abort", f"r{i}") for i in range(50)]
    a.send("next")
    assert reader.read() == ["next"]


def test_a_message_cut_by_the_writer_is_dropped_and_the_end_is_eof() -> None:
    a, b = multiprocessing.Pipe()
    a.send("whole")
    payload = pickle.dumps("never whole")
    os.write(a.fileno(), struct.pack("!i", len(payload)) + payload[:-3])  # a writer killed mid-message
    a.close()
    got, _ = read_until_eof(PipeReader(b))
    assert got == ["whole"]


def test_the_long_length_header_is_read() -> None:
    """Connection frames messages of 2 GiB or more with -1 and an 8-byte length: the same framing, smaller."""
    a, b = multiprocessing.Pipe()
    payload = pickle.dumps({"big": "enough"})
    os.write(a.fileno(), struct.pack("!i", -1) + struct.pack("!Q", len(payload)) + payload)
    a.send("after")
    a.close()
    assert read_until_eof(PipeReader(b))[0] == [{"big": "enough"}, "after"]


def test_a_message_that_does_not_unpickle_raises() -> None:
    """As Connection.recv() does: a bug on the writer's side, never skipped silently."""
    a, b = multiprocessing.Pipe()
    bad = b"not a pickle"
    os.write(a.fileno(), struct.pack("!i", len(bad)) + bad)
    with pytest.raises(pickle.UnpicklingError):
        PipeReader(b).read()


def test_merged_core_outputs_keep_turn_order_and_the_latest_stats() -> None:
    def out(rid: str, token: int, done: bool = False) -> RequestOutput:
        return RequestOutput(rid, None, [], [CompletionOutput(0, "t", [token], finish_reason="length" if done else None)],
                             done)
    turns = [CoreOutputs([out("a", 1), out("b", 1)], stats="s1"),  # type: ignore[arg-type]
             CoreOutputs([out("a", 2, done=True)], failed=[("b", RuntimeError("x"))], results=[(7, None, 1)]),
             CoreOutputs([out("c", 1)], stats="s3")]  # type: ignore[arg-type]
    merged = merge_core_outputs(turns)
    assert [(o.request_id, o.outputs[0].token_ids) for o in merged.outputs] == [("a", [1]), ("b", [1]), ("a", [2]),
                                                                                 ("c", [1])]
    assert [rid for rid, _ in merged.failed] == ["b"] and merged.results == [(7, None, 1)]
    assert merged.stats == "s3"
