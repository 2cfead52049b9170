"""Incremental detokenization that never emits a broken UTF-8 character, and stop-string matching.

Two ways, the same text:
- byte-level tokenizers (GPT-2's byte-level BPE: Llama 3, Qwen, SmolLM2, ...) decode a token sequence as the UTF-8
  decoding of its tokens' bytes joined, each token's bytes the same wherever it stands. `ByteTable` holds those
  bytes per token id, checked against the tokenizer's own decode when it is built; a sequence then keeps the bytes
  of a character still incomplete, and a new token costs a lookup and a short decode, with no call into the
  tokenizer (two calls before: 12-14% of the engine core's time at 200 streams on an H200).
- any other tokenizer: the newest tokens are decoded with a few tokens of context before them (spaces and merges
  that depend on their neighbours come out right), twice per token.

The engine detokenizes each sequence as its tokens come (the text its stop strings are matched on). With an engine
core shared by several API processes, a request without stop strings is detokenized in its API process instead
(vLLM's split): the core gets it with `detokenize=False` and sends token ids only, and `OutputDetokenizer` makes the
same text from them there, taking that work off the core's step.
"""
from __future__ import annotations

import json
import random
import weakref
from dataclasses import dataclass
from typing import Any

from kvgate.engine.outputs import RequestOutput
from kvgate.engine.sampling_params import RequestOutputKind, SamplingParams
from kvgate.engine.sequence import Sequence

_LOOKBACK = 5  # tokens of context decoded before the new ones, so that spaces and merges come out right
_REPLACEMENT = "\ufffd"


def init_offsets(seq: Sequence) -> None:
    seq.prefix_offset = max(seq.num_prompt_tokens - _LOOKBACK, 0)
    seq.read_offset = seq.num_prompt_tokens
    seq.pending_bytes = b""


def _decoder(tokenizer):
    """`decode(ids, skip_special_tokens=...)`: the Rust tokenizer's own when the transformers wrapper would
    return the same text (no clean-up of tokenization spaces), skipping ~10 us of Python per call."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return backend.decode
    return tokenizer.decode


def _byte_translation() -> dict[int, int]:
    """GPT-2's printable characters -> the bytes they stand for (a str.translate table to code points 0-255), the
    alphabet of byte-level BPE vocabularies."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = b
        else:
            table[256 + extra] = b
            extra += 1
    for c in range(256):  # a character below 256 outside the alphabet (a space, ...) is not a byte of it
        table.setdefault(c, 0x100)
    return table


@dataclass
class ByteTable:
    """A byte-level tokenizer's bytes per token id; `special`: the ids that skip_special_tokens drops."""
    pieces: list[bytes]
    special: frozenset[int]

    def piece(self, token: int, skip_special_tokens: bool) -> bytes:
        if token >= len(self.pieces) or (skip_special_tokens and token in self.special):
            return b""  # (an id past the vocabulary decodes to nothing: checked when the table was built)
        return self.pieces[token]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return b"".join(self.piece(t, skip_special_tokens) for t in ids).decode("utf-8", "replace")


_TABLES: "weakref.WeakKeyDictionary[Any, ByteTable | None]" = weakref.WeakKeyDictionary()


def byte_table(tokenizer) -> ByteTable | None:
    """The tokenizer's ByteTable (built once), or None when it is not byte-level or the table would decode anything
    differently from the tokenizer (checked on every single token and on random sequences)."""
    try:
        return _TABLES[tokenizer]
    except KeyError:
        pass
    except TypeError:  # not weakly referenceable: built each time (tests' stand-ins)
        return _build_table(tokenizer)
    table = _TABLES[tokenizer] = _build_table(tokenizer)
    return table


def _build_table(tokenizer) -> ByteTable | None:
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    kind = type(backend.decoder).__name__
    if kind == "Sequence":  # as transformers converts a GGUF's tokenizer: ByteFallback, Fuse, Replace, ByteLevel
        inner = json.loads(backend.decoder.__getstate__()).get("decoders", [])
        if "ByteLevel" not in {d.get("type") for d in inner}:
            return None
    elif kind != "ByteLevel":
        return None
    translation = _byte_translation()
    size = backend.get_vocab_size(with_added_tokens=True)
    pieces = [b""] * size
    for tok, i in backend.get_vocab(with_added_tokens=True).items():
        try:  # ByteLevel's rule: a token's characters through the byte table, or its UTF-8 where one is not in it
            pieces[i] = tok.translate(translation).encode("latin-1")
        except UnicodeEncodeError:
            if kind == "Sequence":  # after Fuse that rule would hold for the whole text at once: not token by token
                return None
            pieces[i] = tok.encode()
    special = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
    table = ByteTable(pieces, special)
    rng = random.Random(0)
    for skip in (True, False):
        singles = backend.decode_batch([[i] for i in range(size + 2)], skip_special_tokens=skip)
        if singles != [table.piece(i, skip).decode("utf-8", "replace") for i in range(size + 2)]:
            return None
    runs = [[rng.randrange(size + 2) for _ in range(rng.randrange(2, 24))] for _ in range(256)]
    for skip in (True, False):
        if backend.decode_batch(runs, skip_special_tokens=skip) != [table.decode(r, skip) for r in runs]:
            return None
    return table


def detokenize_incrementally(tokenizer, seq: Sequence, skip_special_tokens: bool = True) -> str:
    """Append the text of seq's newest tokens to seq.text and return it ("" while a character is incomplete)."""
    table = byte_table(tokenizer)
    ids = seq.token_ids
    if table is not None:
        if len(ids) - seq.read_offset == 1:  # the usual case: one new token
            data = seq.pending_bytes + table.piece(ids[-1], skip_special_tokens)
        else:
            data = seq.pending_bytes + b"".join(table.piece(t, skip_special_tokens) for t in ids[seq.read_offset:])
        seq.read_offset = len(ids)
        if not data:
            return ""
        text = data.decode("utf-8", "replace")
        if text.endswith(_REPLACEMENT):  # an incomplete character (or an invalid one: waits, as below)
            seq.pending_bytes = data
            return ""
        seq.pending_bytes = b""
        seq.text += text
        return text
    decode = _decoder(tokenizer)
    prefix = decode(ids[seq.prefix_offset:seq.read_offset], skip_special_tokens=skip_special_tokens)
    full = decode(ids[seq.prefix_offset:], skip_special_tokens=skip_special_tokens)
    if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
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


class _Text:
    """One sample's detokenizer state on the API side: what detokenize_incrementally reads of a Sequence."""
    __slots__ = ("token_ids", "num_prompt_tokens", "prefix_offset", "read_offset", "pending_bytes", "text")

    def __init__(self, context: list[int]) -> None:
        self.token_ids, self.num_prompt_tokens, self.text = list(context), len(context), ""
        init_offsets(self)  # type: ignore[arg-type]


class OutputDetokenizer:
    """The text of a request whose engine core sends token ids only (SamplingParams.detokenize False, no stop
    strings): fills each output's text as the core would have, token by token, from the prompt's last tokens on.
    A sample that stopped on a stop token or EOS leaves that token's text out, as the core does, unless
    include_stop_str_in_output."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.context = prompt_token_ids[-_LOOKBACK:]
        self.skip_special_tokens = params.skip_special_tokens
        self.include_stop = params.include_stop_str_in_output
        self.eos_token_ids = eos_token_ids
        self.delta = params.output_kind is RequestOutputKind.DELTA
        self.samples: dict[int, _Text] = {}

    def fill(self, out: RequestOutput) -> None:
        tokenizer, skip = self.tokenizer, self.skip_special_tokens
        for c in out.outputs:
            s = self.samples.get(c.index)
            if s is None:
                s = self.samples[c.index] = _Text(self.context)
            new = c.token_ids if self.delta else c.token_ids[len(s.token_ids) - s.num_prompt_tokens:]
            start = len(s.text)
            last_without_text = c.finish_reason == "stop" and new and self._stopped_on_token(c.stop_reason, new[-1])
            for t in new[:-1] if last_without_text else new:
                s.token_ids.append(t)
                detokenize_incrementally(tokenizer, s, skip)  # type: ignore[arg-type]
            if last_without_text:
                s.token_ids.append(new[-1])  # (the core does not detokenize it)
            c.text = s.text[start:] if self.delta else s.text

    def _stopped_on_token(self, stop_reason: int | str | None, last: int) -> bool:
        """Whether a sample that stopped ("stop") did so on its last token's id (a stop token or EOS, which the core
        decides before the text, leaving that token's text out) unless include_stop_str_in_output."""
        return not self.include_stop and (isinstance(stop_reason, int) or last in self.eos_token_ids)
