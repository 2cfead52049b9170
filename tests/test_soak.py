"""A short soak (benchmarks/soak.py): mixed traffic on two replicas, client disconnects, one engine core SIGKILLed
and restarted; nothing may be left running or holding KV blocks, and no request may fail but those the kill cut."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import soak  # noqa: E402


def test_short_soak_leaves_nothing_behind(tiny_llama: str) -> None:
    result = soak.run(soak.SoakArgs(model=tiny_llama, duration=10.0, clients=4, kills=1, disconnect=0.3, seed=1))
    assert result.problems() == [], result.row()
    t = result.tally
    assert result.kills == result.restarts == 1
    assert t.served > 0 and t.streamed > 0 and t.disconnected > 0
    assert t.requests == t.served + t.disconnected + t.failed_by_kill  # every request accounted for
    assert set(result.end_state) == {"tiny", "tiny#1"}  # both replicas report, the restarted one included
