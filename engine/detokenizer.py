"""Incremental detokenization that never emits a broken UTF-8 character, and stop-string matching."""
from __future__ import annotations

from kvgate.engine.sequence import Sequence

_LOOKBACK = 5  # tokens of context decoded before the new ones, so that spaces and merges come out right


def init_offsets(seq: Sequence) -> None:
    seq.prefix_offset = max(seq.num_prompt_tokens - _LOOKBACK, 0)
    seq.read_offset = seq.num_prompt_tokens


def _decoder(tokenizer):
    """`decode(ids, skip_special_tokens=...)`: the Rust tokenizer's own when the transformers wrapper would
    return the same text (no clean-up of tokenization spaces), skipping ~10 us of Python per call, which the
    engine thread pays twice per generated token."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return backend.decode
    return tokenizer.decode


def detokenize_incrementally(tokenizer, seq: Sequence, skip_special_tokens: bool = True) -> str:
    """Append the text of seq's newest tokens to seq.text and return it ("" while a character is incomplete)."""
    ids = seq.token_ids
    decode = _decoder(tokenizer)
    prefix = decode(ids[seq.prefix_offset:seq.read_offset], skip_special_tokens=skip_special_tokens)
    full = decode(ids[seq.prefix_offset:], skip_special_tokens=skip_special_tokens)
    if len(full) <= len(prefix) or full.endswith("\ufffd"):
        return ""
    delta = full[len(prefix):]
    seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
    seq.text += delta
    return delta


def check_stop_strings(seq: Sequence, delta_len: int, stop: list[str], include: bool) -> str | None:
    """If a stop string appeared in the newest text, cut seq.text there and return the stop string."""
    if not stop or not delta_len:
        return None
    longest = max(len(s) for s in stop)
    search_from = max(0, len(seq.text) - delta_len - longest + 1)
    best: tuple[int, str] | None = None
    for s in stop:
        i = seq.text.find(s, search_from)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    if best is None:
        return None
    i, s = best
    seq.text = seq.text[: i + len(s)] if include else seq.text[:i]
    return s
