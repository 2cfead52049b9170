"""XgrammarBackend: what guided decoding knows about the model's vocabulary (xgrammar's TokenizerInfo, a compiler,
the single-character tokens that completions are spelled with) and the compilation of one StructuredOutputsParams
into a CompiledGrammar. Built once per engine, on the compile worker (building the TokenizerInfo of a 150k-token
vocabulary takes ~0.5 s)."""
from __future__ import annotations

import json
import os
import re
import string
from dataclasses import dataclass, field
from typing import Any

from kvgate.engine.structured_output.completion import Alphabet
from kvgate.engine.structured_output.params import StructuredOutputsParams
from kvgate.engine.structured_output.schema import normalize_json_schema

# The order in which the completion search tries single characters: closers first (they end what is open), the comma
# (the next required member; before the digits, which would otherwise lengthen a complete number forever), digits,
# high first (a lower bound is met in fewer digits: 99 rather than 100), then the rest of printable ASCII.
CLOSERS_FIRST = '"}],' + string.digits[::-1] + ':{[' + string.ascii_lowercase + "-." + string.ascii_uppercase + \
    "_" + "".join(c for c in string.punctuation if c not in '"}],:{[-._') + " \n\t"
CONTINUATION_BYTES = (0x80, 0xA0, 0x90)
# lead bytes whose first continuation byte has a narrower range than 80-BF (the rest is overlong, a surrogate or
# past U+10FFFF)
NARROW_LEADS = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}
COMPACT_SEPARATORS = (",", ":")
_XGR_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # "[15:58:33] /project/cpp/regex_converter.cc:94: "


@dataclass
class CompiledGuide:
    """A compiled grammar and what is derived from it once for every request that uses it."""
    grammar: Any  # xgrammar.CompiledGrammar
    initial_completion: list[int] | None = None  # shortest known completion from the start (None: not computed)
    initial_completion_known: bool = False
    memory_bytes: int = 0


@dataclass
class XgrammarBackend:
    """xgrammar over the engine's tokenizer. `vocab_size` is the MODEL's (the logits' width, which may exceed the
    tokenizer's: padded ids are never allowed); `stop_token_ids` are the engine's EOS ids, the only tokens that end
    a guided output where its grammar allows it."""
    tokenizer: Any
    vocab_size: int
    stop_token_ids: list[int]
    compile_threads: int = field(default_factory=lambda: min(8, os.cpu_count() or 1))  # vLLM's 8 at most
    info: Any = field(init=False)
    compiler: Any = field(init=False)
    alphabet: list[int] = field(init=False)  # single-character token ids in CLOSERS_FIRST order
    stop_set: frozenset[int] = field(init=False)
    decoded_vocab: list[bytes] = field(init=False)  # each token's bytes as the grammar sees them (b"": special)
    bitmask_width: int = field(init=False)
    utf8_masks: tuple[Any, dict[int, Any]] = field(init=False)  # see _utf8_masks
    narrow_utf8: bool = field(init=False)
    _scratch: Any = field(init=False, default=None)

    def __post_init__(self) -> None:
        import xgrammar as xgr

        self.info = build_tokenizer_info(self.tokenizer, self.vocab_size, self.stop_token_ids)
        # kvgate caches compiled grammars itself (StructuredOutputManager): xgrammar's own cache would hold a copy
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=self.compile_threads, cache_enabled=False)
        self.stop_token_ids = list(self.info.stop_token_ids)  # as xgrammar resolved them
        self.stop_set = frozenset(self.stop_token_ids)
        self.decoded_vocab = list(self.info.decoded_vocab)  # (the property converts the whole vocabulary each call)
        self.alphabet = single_char_tokens(self.decoded_vocab, set(self.info.special_token_ids)
                                           | set(self.stop_token_ids))
        self.bitmask_width = (self.vocab_size + 31) // 32
        self.byte_tokens = {self.decoded_vocab[t][0]: t for t in self.alphabet}  # byte -> its single-byte token
        closers = frozenset(self.byte_tokens[b] for b in b'"}]' if b in self.byte_tokens)
        self.search_alphabet = Alphabet(self.alphabet, closers)
        continuations = [self.byte_tokens[b] for b in CONTINUATION_BYTES if b in self.byte_tokens]
        ascii_part = [t for t in self.alphabet if t not in continuations]
        self._inside_char: dict[int | None, Alphabet] = {None: Alphabet(continuations + ascii_part, closers)}
        for lead, (lo, hi) in NARROW_LEADS.items():  # e.g. after E0 only A0-BF: the search must try 0xA0 first
            first = [t for t in continuations if lo <= self.decoded_vocab[t][0] <= hi][:1]
            self._inside_char[lead] = Alphabet(first + [t for t in continuations if t not in first] + ascii_part,
                                               closers)
        self.utf8_masks = self._utf8_masks()
        self.narrow_utf8 = not bool((self.utf8_masks[0] == -1).all())  # some token is never valid UTF-8

    def _utf8_masks(self) -> tuple[Any, dict[int, Any]]:
        """(tokens that can be part of valid UTF-8, {lead byte: tokens that may follow it}) as int32 bitmask rows.

        xgrammar decodes UTF-8 loosely: it accepts surrogates (ED A0 80), overlong forms (E0 80 80, C1 BF) and code
        points past U+10FFFF, which Python's decoder turns into U+FFFD characters, so that the text no longer has
        the lengths or the pattern the grammar checked. A guided row is masked with the first row (tokens holding
        C0, C1, F5-FF or a whole invalid sequence are never allowed), and, right after one of the four lead bytes
        whose next byte has a narrower range (E0, ED, F0, F4), with that lead's row."""
        import numpy as np

        valid = np.ones(self.bitmask_width * 32, dtype=bool)
        after = {lead: np.ones(self.bitmask_width * 32, dtype=bool) for lead in NARROW_LEADS}
        for i, text in enumerate(self.decoded_vocab):
            if text and not text.isascii() and not _utf8_fragment_ok(text):
                valid[i] = False
            if text and 0x80 <= text[0] < 0xC0:
                for lead, (lo, hi) in NARROW_LEADS.items():
                    if not lo <= text[0] <= hi:
                        after[lead][i] = False
        return _pack(valid), {lead: _pack(row) for lead, row in after.items()}

    def alphabet_after(self, lead: int | None, inside_char: bool = False) -> Alphabet:
        """The completion search's alphabet: CLOSERS_FIRST order, or, while the output's last character is cut
        (`inside_char`), continuation bytes first (no other byte may follow), the one allowed after `lead` (a byte of
        NARROW_LEADS that no continuation byte followed yet) first of them."""
        if not inside_char:
            return self.search_alphabet
        return self._inside_char.get(lead, self._inside_char[None])  # type: ignore[arg-type]

    def scratch_bitmask(self) -> Any:
        """A one-row bitmask (CPU, int32) for checks on the engine thread; overwritten by every user."""
        if self._scratch is None:
            import xgrammar as xgr

            self._scratch = xgr.allocate_token_bitmask(1, self.vocab_size)
        return self._scratch

    def compile(self, params: StructuredOutputsParams) -> CompiledGuide:
        """Compile `params`; a ValueError naming the field and what is wrong with it for an invalid spec."""
        kind = params.kind
        try:
            grammar = self._compile(params, kind)
        except ValueError:
            raise
        except Exception as e:  # xgrammar reports parse errors as RuntimeError (C++ exceptions)
            raise ValueError(f"invalid structured_outputs.{kind}: {_clean(e)}") from None
        return CompiledGuide(grammar, memory_bytes=_memory_bytes(grammar))

    def _compile(self, params: StructuredOutputsParams, kind: str) -> Any:
        compact = params.disable_any_whitespace
        ws: dict[str, Any] = {"any_whitespace": not compact}
        if compact:
            ws["separators"] = COMPACT_SEPARATORS
        if kind == "json":
            schema = params.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"invalid structured_outputs.json: the schema is not valid JSON ({e})") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("invalid structured_outputs.json: a JSON schema is an object (or true/false), got "
                                 f"{type(schema).__name__}")
            return self.compiler.compile_json_schema(json.dumps(normalize_json_schema(schema)), **ws)
        if kind == "json_object":  # any JSON object: strict_mode off lets it hold any members
            return self.compiler.compile_json_schema('{"type": "object"}', strict_mode=False, **ws)
        if kind == "regex":
            return self.compiler.compile_regex(params.regex)
        if kind == "choice":
            return self.compiler.compile_grammar(choice_grammar(params.choice or []))
        if kind == "grammar":
            return self.compiler.compile_grammar(params.grammar)
        raise ValueError(f"unknown structured_outputs kind {kind!r}")  # pragma: no cover - params checks it


def build_tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> Any:
    """xgrammar's TokenizerInfo for a transformers tokenizer, `vocab_size` wide (the model's), with the special
    tokens (BOS, chat markers, ...) emptied: xgrammar never allows an empty token inside the grammar, whereas the
    text of a special token ("<|im_start|>") would otherwise count as characters of a JSON string although the
    detokenizer drops it."""
    import xgrammar as xgr

    stops = [t for t in stop_token_ids if 0 <= t < vocab_size] or None
    detected = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops)
    special = {i for i in getattr(tokenizer, "all_special_ids", []) if 0 <= i < vocab_size}
    special |= {i for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items()
                if getattr(tok, "special", False) and 0 <= i < vocab_size}
    if not special:
        return detected
    encoded = [""] * vocab_size
    for piece, i in tokenizer.get_vocab().items():
        if 0 <= i < vocab_size and i not in special:
            encoded[i] = piece
    return xgr.TokenizerInfo(encoded, detected.vocab_type, vocab_size=vocab_size, stop_token_ids=stops,
                             add_prefix_space=detected.add_prefix_space)


def single_char_tokens(decoded_vocab: list[bytes], excluded: set[int]) -> list[int]:
    """One token id per character of CLOSERS_FIRST that has a token of its own, in that order, then single
    UTF-8 continuation bytes (for a state inside a multi-byte character: 0x80, 0xA0 and 0x90 between them follow
    every lead byte)."""
    by_text: dict[bytes, int] = {}
    for i, text in enumerate(decoded_vocab):
        if len(text) == 1 and i not in excluded:
            by_text.setdefault(text, i)
    wanted = [c.encode() for c in CLOSERS_FIRST] + [bytes([b]) for b in CONTINUATION_BYTES]
    return [by_text[b] for b in wanted if b in by_text]


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose root is exactly one of `choices` (string literals with JSON's escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _clean(e: BaseException) -> str:
    """xgrammar's message without its C++ source location and trailing blank lines."""
    text = str(e).strip()
    return _XGR_LOCATION.sub("", text.splitlines()[0] if text else type(e).__name__)


def _memory_bytes(grammar: Any) -> int:
    try:
        return int(grammar.memory_size_bytes)
    except Exception:  # pragma: no cover - older xgrammar
        return 0


def _utf8_fragment_ok(text: bytes) -> bool:
    """Whether `text` (one token's bytes) can occur in valid UTF-8: no C0, C1, F5-FF byte, and every sequence that
    starts inside it is valid as far as it goes (a sequence cut by the token's end is checked up to the cut; leading
    continuation bytes belong to a character begun before it)."""
    n, i = len(text), 0
    while i < n and 0x80 <= text[i] < 0xC0:
        i += 1
    while i < n:
        b = text[i]
        if b < 0x80:
            i += 1
            continue
        if b < 0xC2 or b > 0xF4:
            return False
        size = 2 if b < 0xE0 else 3 if b < 0xF0 else 4
        lo, hi = NARROW_LEADS.get(b, (0x80, 0xBF))
        for k in range(1, size):
            if i + k >= n:
                return True  # cut by the token's end
            c = text[i + k]
            if not (lo <= c <= hi if k == 1 else 0x80 <= c < 0xC0):
                return False
        i += size
    return True


def _pack(allowed: Any) -> Any:
    """A boolean array (one per token, a multiple of 32 long) as an int32 bitmask row (bit j of word w: token
    32 * w + j), xgrammar's layout."""
    import numpy as np
    import torch

    words = np.packbits(allowed.astype(np.uint8), bitorder="little").view("<i4")
    return torch.from_numpy(words.copy())
