"""PromptTokenizer: the byte bound (exact: a text that fits is never refused; normalizers widen it; tokenizers
that may drop input get none), measured once per tokenizer, and tokenization on a worker thread for long texts
only."""
from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from kvgate.gateway import prompt_tokenizer
from kvgate.gateway.errors import APIError
from kvgate.gateway.prompt_tokenizer import PromptTokenizer, text_bound


def test_the_byte_bound_is_exact_and_measured_once(tiny_llama: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    bound = text_bound(tok)
    assert text_bound(tok) is bound and bound.shrink == 1
    added = tok.get_added_vocab()
    regular = max(len(t) for t in tok.get_vocab() if t not in added)  # byte-level BPE: one character per byte
    assert bound.token_bytes == max(regular, *(len(t.encode()) for t in added)) == len("<|endoftext|>")
    text = "<|endoftext|>" * 512  # the longest token 512 times: it fits, so it must pass
    assert len(tok.encode(text, add_special_tokens=False)) == 512 and len(text) == 512 * bound.token_bytes
    PromptTokenizer(tok, 512).check_size(text, "prompt")
    with pytest.raises(APIError, match="the prompt is 6657 bytes"):
        PromptTokenizer(tok, 512).check_size("x" * 6657, "prompt")


def test_normalizers_widen_the_bound_and_lossy_tokenizers_have_none() -> None:
    def fast(normalizer: Any, pre: Any) -> PreTrainedTokenizerFast:
        t = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")]))
        t.normalizer, t.pre_tokenizer = normalizer, pre
        return PreTrainedTokenizerFast(tokenizer_object=t)

    nfc = text_bound(fast(normalizers.NFC(), pre_tokenizers.ByteLevel()))
    assert (nfc.token_bytes, nfc.shrink, nfc.max_bytes(10)) == (2, 3, 60)
    assert text_bound(fast(None, pre_tokenizers.Whitespace())).max_bytes(10) is None  # drops whitespace
    assert text_bound(fast(normalizers.Lowercase(), None)).max_bytes(10) is None  # may shrink: not modelled
    assert text_bound(fast(normalizers.Replace("  ", " "), None)).shrink == 2


def test_long_texts_are_tokenized_on_a_worker_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    class Recorder:
        threads: list[int] = []

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            self.threads.append(threading.get_ident())
            return [1] * len(text)

    monkeypatch.setattr(prompt_tokenizer, "TOKENIZE_IN_THREAD_CHARS", 100)
    pt = PromptTokenizer(Recorder(), 10_000)
    assert pt.max_text_bytes is None  # not a fast tokenizer: nothing is known, so no bound

    async def main() -> int:
        await pt.encode("x" * 100, "prompt")
        await pt.encode("x" * 101, "prompt")
        return threading.get_ident()

    loop_thread = asyncio.run(main())
    assert Recorder.threads[0] == loop_thread != Recorder.threads[1]
