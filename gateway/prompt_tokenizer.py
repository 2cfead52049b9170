"""Prompt texts to token ids without stalling the event loop: a byte bound checked before any tokenization work, and
tokenization (chat templates too) on a worker thread for texts above TOKENIZE_IN_THREAD_CHARS.

The bound: a text of more than max_model_len x L x S bytes cannot fit in the context, where L is the longest
token's byte length in the vocabulary and S how much the tokenizer's normalizer can shrink a text (1 without one,
3 for NFC: a Hangul L+V+T jamo sequence of 9 bytes composes into one 3-byte syllable, U+212A KELVIN SIGN into "K").
It is exact (it never refuses a text that could fit) for tokenizers that keep every byte of their input: byte-level
BPE (GPT-2, Llama 3, Qwen, SmolLM) and SentencePiece with byte fallback (Llama 2, Mistral), the tokenizers of the
models kvgate serves. L is measured on the vocabulary's own strings, which never represent fewer bytes than they
hold: byte-level BPE maps each byte to one character (so L counts characters there), SentencePiece writes a
space as the 3-byte "▁" and a fallback byte as "<0xAB>". A tokenizer that may drop input (a normalizer or
pre-tokenizer outside the known ones, e.g. BERT's whitespace splitting) gets no bound: its texts are still
tokenized off the loop and then refused by their token count.
"""
from __future__ import annotations

import asyncio
import json
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar

from kvgate.gateway.errors import APIError

TOKENIZE_IN_THREAD_CHARS = 1 << 16  # texts longer than this (in total) are tokenized on a worker thread
TEMPLATE_CHARS_PER_MESSAGE = 64  # what a message costs a chat template, in characters of text, for that decision
# how far each normalizer can shrink a text's UTF-8 bytes (composition, singleton decompositions such as U+212A);
# Replace is measured on its own strings; any other normalizer (Lowercase, NFKC, Strip, ...) gives no bound
NORMALIZER_SHRINK = {"NFC": 3, "NFD": 3, "Prepend": 1, "Replace": 1}
# pre-tokenizers that keep every character of their input, and the models that turn every character into tokens
KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "UnicodeScripts"}
KEEPING_MODELS = {"BPE", "Unigram"}
T = TypeVar("T")


@dataclass(frozen=True)
class TextBound:
    """What a tokenizer lets the gateway know before tokenizing: `token_bytes` (L), `shrink` (S), or None for
    both where no exact bound exists."""
    token_bytes: int | None
    shrink: int | None

    def max_bytes(self, max_model_len: int) -> int | None:
        """The most UTF-8 bytes a text that fits in `max_model_len` tokens can have (None: no bound)."""
        if self.token_bytes is None or self.shrink is None:
            return None
        return max_model_len * self.token_bytes * self.shrink


_BOUNDS: "weakref.WeakKeyDictionary[Any, TextBound]" = weakref.WeakKeyDictionary()


def text_bound(tokenizer: Any) -> TextBound:
    """The tokenizer's TextBound, computed once per tokenizer (one pass over the vocabulary)."""
    bound = _BOUNDS.get(tokenizer)
    if bound is None:
        bound = _BOUNDS[tokenizer] = _measure(tokenizer)
    return bound


def _measure(tokenizer: Any) -> TextBound:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # not a fast (Rust) tokenizer: nothing is known about its pipeline
        return TextBound(None, None)
    spec = json.loads(backend.to_str())
    shrink = _shrink(spec.get("normalizer"))
    if shrink is None or not _keeps_input(spec.get("pre_tokenizer")) or \
            (spec.get("model") or {}).get("type") not in KEEPING_MODELS:
        return TextBound(None, None)
    byte_level = _has_type(spec.get("pre_tokenizer"), "ByteLevel")
    added = set(tokenizer.get_added_vocab())
    longest = 1
    for token in tokenizer.get_vocab():
        # byte-level BPE: one character per byte (the added tokens are plain text)
        n = len(token) if byte_level and token not in added else len(token.encode("utf-8", "surrogatepass"))
        longest = max(longest, n)
    return TextBound(longest, shrink)


def _steps(node: dict | None, key: str) -> list[dict]:
    if node is None:
        return []
    if node.get("type") == "Sequence":
        return [s for child in node.get(key, []) for s in _steps(child, key)]
    return [node]


def _has_type(node: dict | None, name: str) -> bool:
    return any(s.get("type") == name for s in _steps(node, "pretokenizers"))


def _shrink(normalizer: dict | None) -> int | None:
    factor = 1
    for step in _steps(normalizer, "normalizers"):
        kind = step.get("type")
        if kind not in NORMALIZER_SHRINK:
            return None
        if kind == "Replace":  # shrinks by |pattern| / |content|; a regex pattern: unknown
            pattern, content = (step.get("pattern") or {}).get("String"), str(step.get("content", "")).encode()
            if pattern is None or not content:
                return None
            factor *= -(-len(pattern.encode()) // len(content))
            continue
        factor *= NORMALIZER_SHRINK[kind]
    return factor


def _keeps_input(pre_tokenizer: dict | None) -> bool:
    steps = _steps(pre_tokenizer, "pretokenizers")
    return all(s.get("type") in KEEPING_PRE_TOKENIZERS and s.get("behavior") != "Removed" for s in steps)


class PromptTokenizer:
    """One model's tokenizer and context length, for the gateway: `check_size` refuses texts that cannot fit
    (before tokenizing), `encode` / `encode_batch` / `apply_chat_template` tokenize on a worker thread when the
    text is long (transformers' encode releases the GIL while the Rust tokenizer runs, so the loop keeps serving)
    and inline when short (no thread hop on the hot path)."""

    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        self.tokenizer, self.max_model_len = tokenizer, max_model_len
        self.bound = text_bound(tokenizer)
        self.max_text_bytes = self.bound.max_bytes(max_model_len)

    def check_size(self, text: str, what: str) -> None:
        """An APIError 400 (context_length_exceeded) when `text` has more UTF-8 bytes than any text that fits in
        max_model_len tokens; `what` names it ("prompt", "messages", "input[3]")."""
        limit = self.max_text_bytes
        if limit is None or len(text) * 4 <= limit:  # 4: the most UTF-8 bytes a character takes
            return
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > limit:
            shrink = self.bound.shrink or 1
            norm = f" x {shrink} for Unicode normalization" if shrink > 1 else ""
            raise APIError(400, f"the {what} is {size} bytes: more than this model can take in its context, "
                                f"{limit} bytes (max_model_len {self.max_model_len} tokens x at most "
                                f"{self.bound.token_bytes} bytes per token{norm}). Please shorten the {what}.",
                           what.split("[", 1)[0], "context_length_exceeded")

    async def encode(self, text: str, what: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, after check_size."""
        self.check_size(text, what)
        return await self._run(len(text), lambda: self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def encode_batch(self, texts: Sequence[str], names: Sequence[str]) -> list[list[int]]:
        """Token ids of each text (each checked with check_size under its name in `names`)."""
        for text, name in zip(texts, names):
            self.check_size(text, name)
        if len(texts) == 1:
            return [await self._run(len(texts[0]), lambda: self.tokenizer.encode(texts[0]))]
        return await self._run(sum(len(t) for t in texts), lambda: list(self.tokenizer(list(texts))["input_ids"]))

    async def apply_chat_template(self, messages: list[dict[str, Any]], what: str = "messages",
                                  **kwargs: Any) -> list[int]:
        """The chat template's token ids for `messages` (role, content strings, and tool calls); the contents
        together are checked with check_size first (a template adds text around them; it does not drop them)."""
        chars = sum(len(m["content"]) for m in messages)
        if self.max_text_bytes is not None and chars * 4 > self.max_text_bytes:
            self.check_size("".join(m["content"] for m in messages), what)
        # tools and tool calls are re-serialized by templates (not counted above), but their rendering is work too
        extra = sum(len(json.dumps(m["tool_calls"])) for m in messages if m.get("tool_calls"))
        if kwargs.get("tools"):
            extra += len(json.dumps(kwargs["tools"]))

        def render() -> list[int]:
            return list(self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs))

        # the template's own work grows with the number of messages too: many empty ones also go to the thread
        return await self._run(chars + extra + TEMPLATE_CHARS_PER_MESSAGE * len(messages), render)

    @staticmethod
    async def _run(chars: int, fn: Callable[[], T]) -> T:
        if chars > TOKENIZE_IN_THREAD_CHARS:
            return await asyncio.to_thread(fn)
        return fn()
