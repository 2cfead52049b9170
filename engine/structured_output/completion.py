"""The shortest way to finish a guided output: a bounded depth-first search over single-character tokens from a
matcher's current state, with the matcher's own accept/rollback (xgrammar keeps the state; nothing is copied).

Order of the children of a node: of the characters the grammar allows there (read from its token mask, so no
refused character is tried), the closers `"`, `}`, `]` first, then those its parent node did not allow, then the
rest; within each group CLOSERS_FIRST order (backend.py: `,` for a missing required member, digits, then the rest).
A child that allows exactly what its node allowed went once more round a repetition (a digit after a digit in
`[a-z0-9.]+@...`): it is searched only after its siblings, so the `@` that leads on is found before the search
writes digits forever; a repetition that must go on (`[0-9]{5}`) is searched that way too, in its turn. Closers
first ends what is open in few characters. Where the grammar forces a string (a required key, the rest of `true`),
xgrammar's jump-forward tokens take it in as few tokens as the vocabulary allows. Once a completion is found, a small
extra budget looks for a shorter one (branch and bound: deeper paths are cut).

Tails: during decoding the state moves one token at a time, and the completion from the new state is nearly always
a short bridge followed by the previous completion (or its rest): after `,` in an array of strings, `"` then the old
`"],...}`. Each node first tries the given tails whole (one accept_string each), so such a search ends within a few
nodes.

Bounds: `max_len` tokens and `budget` nodes (masks read, tokens accepted, tails tried; deterministic: never wall time,
so two runs of the same request force the same tokens). A completion longer than MAX_COMPLETION_TOKENS is not
searched.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

MAX_COMPLETION_TOKENS = 512  # longer completions are not searched (the finish is then not guaranteed)
IMPROVE_BUDGET = 400  # nodes visited after the first completion, looking for a shorter one (by default)


def node_budget(max_len: int) -> int:
    """Nodes the search may visit: ~8 per token of the longest completion it may return, plus slack."""
    return 8 * max_len + 200


@dataclass
class Alphabet:
    """Single-character token ids in the order a search tries them (XgrammarBackend builds them once), with what
    reading them from a token mask needs."""
    tokens: list[int]
    closers: frozenset[int] = frozenset()  # the tokens of `"`, `}`, `]`
    ids: np.ndarray = field(init=False)
    words: np.ndarray = field(init=False)  # each token's int32 word in a mask row
    bits: np.ndarray = field(init=False)  # and its bit there
    is_closer: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.ids = np.asarray(self.tokens, dtype=np.int64)
        self.words, self.bits = self.ids >> 5, self.ids & 31
        self.is_closer = np.isin(self.ids, list(self.closers))


class CompletionSearch:
    """One search from `matcher`'s current state, which it leaves as it found it; `vocab_size` is the width of the
    matcher's token mask, `last_token` the token the matcher accepted last (if known: the root's parent state)."""

    def __init__(self, matcher: Any, alphabet: Alphabet, max_len: int, vocab_size: int, budget: int | None = None,
                 improve_budget: int = IMPROVE_BUDGET, tails: list[tuple[list[int], bytes]] | None = None,
                 last_token: int | None = None) -> None:
        self.matcher = matcher
        self.alphabet = alphabet.ids
        self.words, self.bits, self.closers = alphabet.words, alphabet.bits, alphabet.is_closer
        self.vocab_size = vocab_size
        self.tails = tails or []  # (tokens, their bytes): tried whole at every node
        self.limit = min(max_len, MAX_COMPLETION_TOKENS)
        self.budget = node_budget(self.limit) if budget is None else budget
        self.improve_budget = improve_budget
        self.nodes = 0
        self.best: list[int] | None = None
        self._mask: Any = None  # a one-row token mask of its own (searches run on two threads at once)
        self.last_token = last_token  # the matcher's last accepted token: what it allowed before is the root's parent

    def run(self) -> list[int] | None:
        """The shortest completion found (token ids; [] when the output may end here), or None when none of at
        most max_len tokens was found within the budget."""
        if self.limit < 0:
            return None
        self._visit([], None, False)
        return self.best

    def _found(self, path: list[int]) -> None:
        if self.best is None:  # the first one: from now on only a shorter one is looked for
            self.budget = min(self.budget, self.nodes + self.improve_budget)
        if self.best is None or len(path) < len(self.best):
            self.best = list(path)

    def _bound(self) -> int:
        """The longest path still worth extending: below the best found, within the limit."""
        return self.limit if self.best is None else len(self.best) - 1

    def _allowed(self) -> np.ndarray:
        """Which alphabet tokens the grammar allows in the matcher's current state."""
        if self._mask is None:
            import xgrammar as xgr

            self._mask = xgr.allocate_token_bitmask(1, self.vocab_size)
        self.matcher.fill_next_token_bitmask(self._mask, 0)
        words = self._mask.numpy()[0]
        return ((words[self.words] >> self.bits) & 1).astype(bool)

    def _root_parent(self) -> np.ndarray:
        """What the state before the matcher's last token allowed (none known: nothing)."""
        if self.last_token is None:
            return np.zeros(len(self.alphabet), dtype=bool)
        self.matcher.rollback(1)
        try:
            return self._allowed()
        finally:
            self.matcher.accept_token(self.last_token)

    def _order(self, allowed: np.ndarray, parent: np.ndarray) -> list[int]:
        """The allowed alphabet tokens: closers first, then those the parent did not allow, then the rest."""
        closing = allowed & self.closers
        new = allowed & ~parent & ~closing
        return np.concatenate((self.alphabet[closing], self.alphabet[new],
                               self.alphabet[allowed & ~closing & ~new])).tolist()

    def _visit(self, path: list[int], parent: np.ndarray | None, stall_check: bool) -> bool:
        """Search below the matcher's current state (path: the tokens that led here). Returns False, having
        searched nothing, when `stall_check` is set and this state allows exactly what its parent allowed: a
        repetition that went round once more (a digit after a digit in `[0-9.]+@`), tried only after the siblings
        that lead somewhere new."""
        m = self.matcher
        if m.is_completed():
            self._found(path)
            return True
        for tokens, text in self.tails:
            if len(path) + len(tokens) <= self._bound() and self.nodes < self.budget:
                self.nodes += 1
                if accepts_all(m, text):
                    self._found(path + tokens)
                    return True
        if parent is None:  # the root: before the jump-forward tokens move the state
            parent = self._root_parent()
        forced = 0  # tokens taken from the jump-forward string at this node
        if m.find_jump_forward_string():
            for token in m.find_jump_forward_tokens():
                if len(path) >= self._bound() or not m.accept_token(token):
                    break
                path.append(token)
                forced += 1
        try:
            if forced and m.is_completed():
                self._found(path)
                return True
            if len(path) >= self._bound() or self.nodes >= self.budget:
                return True
            self.nodes += 1
            allowed = self._allowed()
            if stall_check and not forced and np.array_equal(allowed, parent):
                return False
            stalled = []
            for token in self._order(allowed, parent):
                if len(path) >= self._bound() or self.nodes >= self.budget:
                    return True
                self.nodes += 1
                if m.accept_token(token):
                    path.append(token)
                    if not self._visit(path, allowed, True):
                        stalled.append(token)
                    path.pop()
                    m.rollback(1)
            for token in stalled:  # a repetition that must go on (`[0-9]{5}`), or nothing new was found
                if len(path) >= self._bound() or self.nodes >= self.budget:
                    return True
                m.accept_token(token)
                path.append(token)
                self._visit(path, allowed, False)
                path.pop()
                m.rollback(1)
            return True
        finally:
            if forced:
                m.rollback(forced)
                del path[-forced:]


def accepts_all(matcher: Any, text: bytes) -> bool:
    """Whether `text`, accepted from the matcher's current state, completes its grammar (the state is kept)."""
    if not text:
        return matcher.is_completed()
    if not matcher.accept_string(text):
        return False
    done = matcher.is_completed()
    matcher.rollback(1)
    return done


def improve(matcher: Any, alphabet: Alphabet, plan: list[int], vocab_size: int, budget: int) -> list[int]:
    """A completion no longer than `plan` (one from the matcher's current state), shortened where one other token at
    some position, followed by the first completion found from there, is shorter: positions from the first on, so
    that the choices made early (an enum's value, a number's digits) are revisited first, within `budget` tried
    tokens. An alternative after which the plan's own token is still accepted (one more character of a free string)
    is skipped: it only adds to what the plan writes. The matcher is left as it was found."""
    spent, k, depth = 0, 0, 0
    try:
        while k < len(plan) and spent < budget:
            for token in alphabet.tokens:
                if token == plan[k] or spent >= budget:
                    continue
                spent += 1
                if not matcher.accept_token(token):
                    continue
                spent += 1
                if matcher.accept_token(plan[k]):  # more of the same: never shorter
                    matcher.rollback(1)
                else:
                    left = len(plan) - k - 2
                    search = CompletionSearch(matcher, alphabet, left, vocab_size, 2 * max(left, 0) + 16,
                                              improve_budget=0)
                    rest = search.run() if left >= 0 else None
                    spent += search.nodes
                    if rest is not None:
                        plan = plan[:k] + [token] + rest
                matcher.rollback(1)
            if k < len(plan):
                if not matcher.accept_token(plan[k]):  # pragma: no cover - the plan completes from here
                    break
                depth += 1
            k += 1
    finally:
        if depth:
            matcher.rollback(depth)
    return plan
