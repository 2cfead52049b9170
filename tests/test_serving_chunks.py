"""The streaming hot path renders SSE chunks from a template: byte for byte what json.dumps gives the whole chunk."""
from __future__ import annotations

import json

import pytest

from kvgate.gateway.serving import ChunkTemplate, sse

TEXTS = ["", " the", 'quote " and \\ backslash', "new\nline\ttab", "café 日本語 🙂", "\x00\x1f control", "\u2028"]


@pytest.mark.parametrize("text", TEXTS)
def test_template_equals_dumping_the_whole_chunk(text: str) -> None:
    def payload(t: str) -> dict:
        return {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m \"q\" ü",
                "choices": [{"index": 0, "text": t, "finish_reason": None, "logprobs": None}]}

    got = ChunkTemplate(payload(ChunkTemplate.MARK))(text)
    assert got == sse(payload(text))
    assert json.loads(got.removeprefix("data: "))["choices"][0]["text"] == text


def test_template_needs_the_mark() -> None:
    with pytest.raises(AssertionError, match="MARK"):
        ChunkTemplate({"text": "no mark here"})
