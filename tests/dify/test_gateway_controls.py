"""The model's max_batch_delay and priority reach kvgate's engine and scheduler; its timeout bounds the wait.

The main gateway runs with scheduler_delay 30 s: a request is held up to 30 s to be batched unless its
X-Max-Batch-Delay-Ms asks for less. So a request with max_batch_delay 30000 ms waits ~30 s for its first token,
which a 2 s timeout must cut at 2 s, not at the 300 s default (nor by waiting the 30 s out).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from dify_helpers import MODEL, credentials, joined, marker, prompt
from dify_plugin.errors.model import InvokeConnectionError


@pytest.mark.parametrize("stream", [True, False])
def test_max_batch_delay_and_priority_are_seen_by_the_scheduler(gateways: Any, llm: Callable[[], Any],
                                                                 stream: bool) -> None:
    tag = marker()
    creds = credentials(gateways["main"], max_batch_delay=250, priority=85)
    text, usage, _, _ = joined(llm().invoke(MODEL, creds, prompt(f"urgent {tag}"), {"max_tokens": 4},
                                            stream=stream))
    assert usage.completion_tokens == 4
    (record,) = gateways.engine_records(tag)
    assert record["priority"] == 85 and record["max_batch_delay"] == pytest.approx(0.25)
    assert record["batch_window"] == pytest.approx(0.25)  # the scheduler holds it 0.25 s, not its 30 s


def test_defaults_are_a_50_ms_window_and_priority_50(gateways: Any, llm: Callable[[], Any]) -> None:
    tag = marker()
    creds = {k: v for k, v in credentials(gateways["main"]).items() if k not in ("max_batch_delay", "priority")}
    joined(llm().invoke(MODEL, creds, prompt(f"plain {tag}"), {"max_tokens": 2}))
    (record,) = gateways.engine_records(tag)
    assert record["priority"] == 50 and record["batch_window"] == pytest.approx(0.05)
    low = credentials(gateways["main"], max_batch_delay=0, priority=20)
    joined(llm().invoke(MODEL, low, prompt(f"batch class {tag}"), {"max_tokens": 2}))
    assert [(r["priority"], r["batch_window"]) for r in gateways.engine_records(tag)] == [(50, pytest.approx(0.05)),
                                                                                        (20, 0.0)]


@pytest.mark.parametrize("stream", [True, False])
def test_timeout_cuts_a_slow_request_at_the_configured_seconds(gateways: Any, llm: Callable[[], Any],
                                                               stream: bool) -> None:
    tag = marker()
    creds = credentials(gateways["main"], timeout=2, max_batch_delay=30000)
    t0 = time.monotonic()
    with pytest.raises(InvokeConnectionError, match="timed out: no answer within the timeout of 2 s"):
        joined(llm().invoke(MODEL, creds, prompt(f"slow {tag}"), {"max_tokens": 2}, stream=stream))
    elapsed = time.monotonic() - t0
    assert 2 <= elapsed < 20, elapsed  # the configured 2 s: neither the 300 s default nor the engine's 30 s hold
    (record,) = gateways.engine_records(tag)
    assert record["batch_window"] == pytest.approx(30.0)  # the engine really was holding it
    # leave the engine idle for the next test: a request with no window releases a held one (if the gateway did
    # not abort it when the plugin hung up), and it needs more steps than that one's 2 tokens
    joined(llm().invoke(MODEL, credentials(gateways["main"], max_batch_delay=0), prompt("flush"), {"max_tokens": 4}))
