"""SequenceGrammar: one guided sequence's matcher (every sample of n > 1 has its own) and its budget-aware finish.

Each step the sequence samples, `prepare` says whether its next token is forced, the step's bitmask row is filled
from the matcher (or holds only the forced token), and `accept` takes the sampled token into the matcher.

The budget-aware finish keeps a plan: a completion from the current state (completion.py), `verified` when it is
known to complete the grammar from exactly this state. With `remaining` tokens left (max_tokens, and the room left in
max_model_len), the invariant is len(plan) <= remaining, so the document can always be closed in time:
- when len(plan) == remaining, the plan's next token is forced (the mask allows it alone);
- with little slack (remaining - len(plan) <= ZONE_MARGIN) every sampled token is checked: the old plan (or its
  rest) still completing from the new state (one accept_string, a few us) keeps it; else a new plan is searched; if
  none fits, the sampled token is rolled back and the plan's next token taken instead (or the stop token, where the
  output was complete already), so the sequence never leaves the invariant;
- with more slack, the plan is checked every (slack - ZONE_MARGIN) / CHECK_DIVISOR tokens, so that a plan gone
  stale (the model opened new arrays) is caught while there is still room: the check interval shrinks as the end
  nears, and a request far from its budget costs next to nothing.
Limits: a token that lengthens the shortest completion by more than the slack left above ZONE_MARGIN (between two
checks), or a completion longer than MAX_COMPLETION_TOKENS or not found within the search's budget, leaves the
sequence unguarded (`budget_lost`): it then ends with "length" as an unguided one does when its budget runs out.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch

from kvgate.engine.structured_output.backend import NARROW_LEADS
from kvgate.engine.structured_output.completion import MAX_COMPLETION_TOKENS, CompletionSearch, accepts_all

ZONE_MARGIN = 32  # tokens of slack below which every token is checked
CHECK_DIVISOR = 4  # above it, the next check comes after (slack - ZONE_MARGIN) / this tokens
STEP_IMPROVE_BUDGET = 48  # extra nodes a search during decoding visits for a shorter completion


class SequenceGrammar:
    """The matcher of one guided sequence. Not thread-safe: used on the engine thread only."""

    def __init__(self, guide: Any, backend: Any) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(guide.grammar)
        self.backend = backend
        self.plan: list[int] | None = guide.initial_completion  # None: the search from the start found nothing
        self.plan_text = b"" if self.plan is None else self._text(self.plan)
        self.verified = self.plan is not None  # the initial completion completes from the initial state
        self.budget_lost = self.plan is None  # no completion known to fit: the finish is not guarded
        self.countdown = 0  # tokens until the next check (with slack above ZONE_MARGIN)
        self.forced = False  # this step's token is the plan's next one
        self.finished = False  # the grammar ended the output (a stop token, nothing else allowed, the plan done)
        self.last_token: int | None = None  # the last token the matcher accepted
        self.utf8_need = 0  # continuation bytes the output's last character still needs
        self.utf8_lead: int | None = None  # its lead byte, while no continuation byte followed it yet

    # ---- one sampling step ---------------------------------------------------------------------------------------
    def prepare(self, remaining: int) -> int | None:
        """Before sampling, with `remaining` (>= 1) tokens left including this one: the token this step must take
        (the plan's next: the budget leaves no room for anything else), or None (fill the mask from the matcher)."""
        if not self.budget_lost and not self.verified and self._slack(remaining) <= ZONE_MARGIN:
            if not self._verify(remaining):  # the end came near while the plan was stale, and nothing fits
                self.budget_lost = True
        if self.verified and self.plan is not None and len(self.plan) > remaining:
            self.budget_lost = True  # even the shortest way to finish does not fit (from the start)
        self.forced = not self.budget_lost and self.verified and 0 < len(self.plan or ()) == remaining
        return self.plan[0] if self.forced else None  # type: ignore[index]

    def accept(self, token: int, remaining: int) -> int:
        """Take the sampled token (`remaining` as given to prepare); returns the token kept: the sampled one, or the
        plan's next (or a stop token) where the sampled one would leave no completion within the budget. (The common
        cases, the plan's own token and a token far from the budget's end, cost a few attribute reads: this runs for
        every guided row of every step, on the engine thread.)"""
        m, prev, prev_text = self.matcher, self.plan, self.plan_text
        utf8 = self.utf8_need, self.utf8_lead
        if not m.accept_token(token):
            raise RuntimeError(f"guided decoding: the grammar refused token {token}, which its mask allowed")
        text = self._track(token)
        if token in self.backend.stop_set and m.is_terminated():  # where the grammar may end
            self.finished = True
            return token
        if prev and token == prev[0]:
            self.plan, self.plan_text = prev[1:], prev_text[len(text):]
        elif prev and text and prev_text.startswith(text) and self._follow(prev, prev_text, len(text), remaining - 1):
            pass  # the plan's own text, in other tokens: the rest of it still completes the document, in time
        elif not self.budget_lost:
            prev_ok, self.verified = self.verified, False
            self.countdown -= 1
            left = remaining - 1
            zone = self._slack(left) <= ZONE_MARGIN
            if zone or self.countdown <= 0:
                if self._verify(left):
                    self.countdown = max(1, (self._slack(left) - ZONE_MARGIN) // CHECK_DIVISOR)
                elif zone and prev_ok:  # the sampled token leaves no way to finish in time: take the plan's
                    self.utf8_need, self.utf8_lead = utf8
                    token = self._take_plan_instead(prev, prev_text)  # type: ignore[arg-type]
                elif zone:
                    self.budget_lost = True
        if (self.forced and not self.plan) or (m.is_completed() and not self._can_continue()):
            self.finished = True
        return token

    # ---- the plan ------------------------------------------------------------------------------------------------
    def _slack(self, left: int) -> int:
        return left - (len(self.plan) if self.plan is not None else 0)

    def _text(self, tokens: list[int]) -> bytes:
        vocab = self.backend.decoded_vocab
        return b"".join(vocab[t] for t in tokens)

    def _follow(self, prev: list[int], prev_text: bytes, cut: int, left: int) -> bool:
        """The plan's rest after its first `cut` bytes (what the sampled token wrote): a token cut in two goes on
        as single-byte tokens. False (nothing changed) when the vocabulary lacks one of them, or when those make
        the plan longer than the `left` tokens the budget leaves (`active` cut after its `a` is five tokens more)."""
        vocab, done = self.backend.decoded_vocab, 0
        for i, t in enumerate(prev):
            done += len(vocab[t])
            if done >= cut:
                rest = [self.backend.byte_tokens.get(b) for b in prev_text[cut:cut + done - cut]]
                if None in rest or len(rest) + len(prev) - i - 1 > left:
                    return False
                self.plan, self.plan_text = rest + prev[i + 1:], prev_text[cut:]  # type: ignore[operator]
                return True
        return False

    def _verify(self, max_len: int) -> bool:
        """Make the plan a verified completion of at most max_len tokens from the current state. First the old plan
        (after what finishes a cut character): whole, without its first token, then its shortest rest that starts at
        a token boundary before punctuation (after `"age":25`, the old `,"email":...` goes on; inside an e-mail
        address, its `@...`) - one accept_string each, the common case. Else a new search, which tries the first
        two again at every node. False (plan unchanged, unverified) when none is found."""
        m = self.matcher
        if self.plan is not None and not self.utf8_need and len(self.plan) <= max_len and self.plan_text \
                and m.accept_string(self.plan_text):  # the common case, written out: the old plan still completes
            done = m.is_completed()
            m.rollback(1)
            if done:
                self.verified = True
                return True
        fix = self._utf8_fix()
        tails: list[tuple[list[int], bytes]] = []
        if self.plan is not None and fix is not None:
            for tokens, text in self._rests():
                if fix[0]:
                    tokens, text = fix[0] + tokens, fix[1] + text
                if len(tokens) <= max_len and accepts_all(self.matcher, text):
                    self.plan, self.plan_text, self.verified = tokens, text, True
                    return True
                if len(tails) < 2:
                    tails.append((tokens, text))
        b = self.backend
        found = CompletionSearch(self.matcher, b.alphabet_after(self.utf8_lead, bool(self.utf8_need)),
                                 min(max_len, MAX_COMPLETION_TOKENS), b.vocab_size, improve_budget=STEP_IMPROVE_BUDGET,
                                 tails=tails, last_token=self.last_token).run()
        if found is None:
            return False
        self.plan, self.plan_text, self.verified = found, self._text(found), True
        return True

    def _rests(self) -> Iterator[tuple[list[int], bytes]]:
        """The plan, the plan without its first token, then its rests from each token boundary before a punctuation
        byte, shortest first."""
        plan, text, vocab = self.plan or [], self.plan_text, self.backend.decoded_vocab
        yield plan, text
        if not plan:
            return
        first = len(vocab[plan[0]])
        yield plan[1:], text[first:]
        ends = list(itertools.accumulate(len(vocab[t]) for t in plan))
        for i in range(len(plan) - 1, 1, -1):
            c = text[ends[i - 1]]
            if c < 0x80 and not chr(c).isalnum():
                yield plan[i:], text[ends[i - 1]:]

    def _take_plan_instead(self, prev: list[int], prev_text: bytes) -> int:
        """Undo the sampled token and take the previous plan's next one (a stop token where the output was complete
        already): the budget still closes the document."""
        self.matcher.rollback(1)
        if not prev:
            stop = self.backend.stop_token_ids[0]
            self.matcher.accept_token(stop)
            self.finished = True
            return stop
        self.matcher.accept_token(prev[0])
        self._track(prev[0])
        self.plan, self.plan_text, self.verified = prev[1:], prev_text[len(self.backend.decoded_vocab[prev[0]]):], True
        return prev[0]

    def _can_continue(self) -> bool:
        """Whether a token other than a stop token may follow (the grammar is complete here: maybe it may grow)."""
        scratch = self.backend.scratch_bitmask()
        self.matcher.fill_next_token_bitmask(scratch, 0)
        row = scratch[0]
        for stop in self.backend.stop_token_ids:
            row[stop >> 5] &= ~(1 << (stop & 31)) if (stop & 31) != 31 else 0x7FFFFFFF
        return bool(torch.any(row != 0))

    # ---- UTF-8: a character cut between tokens ---------------------------------------------------------------------
    def _track(self, token: int) -> bytes:
        """Note the token just accepted, and whether the output now ends inside a multi-byte character; returns the
        token's text."""
        self.last_token = token
        text = self.backend.decoded_vocab[token]
        if text.isascii():
            self.utf8_need = 0
            self.utf8_lead = None
            return text
        for b in text:
            if self.utf8_need and 0x80 <= b < 0xC0:
                self.utf8_need, self.utf8_lead = self.utf8_need - 1, None
            elif b >= 0xC0:
                self.utf8_need, self.utf8_lead = (1 if b < 0xE0 else 2 if b < 0xF0 else 3), b
            else:
                self.utf8_need, self.utf8_lead = 0, None
        return text

    @property
    def pending_lead(self) -> int | None:
        """The output ends with this lead byte of NARROW_LEADS (its next byte has a narrower range), if it does."""
        return self.utf8_lead if self.utf8_lead in NARROW_LEADS else None

    def _utf8_fix(self) -> tuple[list[int], bytes] | None:
        """Single-byte tokens that finish the output's last character validly ([] when it is complete; None when
        the vocabulary lacks them)."""
        if not self.utf8_need:
            return [], b""
        first = NARROW_LEADS.get(self.utf8_lead, (0x80, 0xBF))[0] if self.utf8_lead is not None else 0x80
        fix = bytes([first] + [0x80] * (self.utf8_need - 1))
        tokens = [self.backend.byte_tokens.get(b) for b in fix]
        return None if None in tokens else (tokens, fix)  # type: ignore[return-value]
