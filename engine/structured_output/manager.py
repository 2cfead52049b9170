"""StructuredOutputManager: the engine's side of guided decoding (vLLM's name).

- Compilation runs on a worker thread (xgrammar releases the GIL while it compiles), never on the engine loop: a
  guided request waits, out of the scheduler's queues (vLLM's WAITING_FOR_FSM), until its grammar is ready, while
  every other request keeps stepping. The worker also builds the backend (xgrammar's TokenizerInfo) on first use and
  searches each new grammar's initial completion (grammar.py).
- Compiled grammars are cached by StructuredOutputsParams.key(), as are specs found invalid (so that a repeated bad
  spec fails at once); a request for a spec being compiled waits for that compilation.
- Each step that samples a guided sequence, `prepare_step` fills a bitmask (one row per sampled row, CPU; pinned on
  CUDA) and returns a GrammarStep, which the sampler uses to mask the logits on their device (one batched
  apply_token_bitmask_inplace) and to accept the sampled tokens into the matchers. The mask of tokens that are
  never valid UTF-8 is applied to every row there too, on the device: on the host that one `&=` of a [64, 4748]
  int32 mask took a quarter of an H100 host's step time (torch's threads woke after xgrammar's).
- With async scheduling the engine asks for the fill in the background: xgrammar's batch fill releases the GIL, so
  it runs on a thread of its own while the engine loop goes on (outputs, scheduling and building the next step),
  and the sampler waits for it only when it applies the masks.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Callable

import numpy as np
import torch

from kvgate.engine.sampler import to_device
from kvgate.engine.sequence import Request, Sequence, SequenceStatus
from kvgate.engine.structured_output.completion import MAX_COMPLETION_TOKENS, CompletionSearch, improve
from kvgate.engine.structured_output.grammar import SequenceGrammar
from kvgate.engine.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256  # compiled grammars (and refused specs) kept, least recently used dropped first
MAX_CACHED_BYTES = 512 << 20  # and at most this much of them (a 50-property schema: ~4 MB with a 150k vocabulary)
BATCH_FILL_MIN_ROWS = 16  # from this many rows a step, masks are filled by xgrammar's batch call
# ... on this many threads. xgrammar's "auto" (half the cores) costs more than it saves on rows this cheap: 64 rows of
# the structured benchmark took 1.24 ms with it on an H100 host's 16 cores, 0.53 ms on 1 thread, 0.40 on 4; on 2
# cores, 0.13 ms on 1 thread and 0.25 on 2.
BATCH_FILL_THREADS = max(1, min(4, (os.cpu_count() or 1) // 4))
INITIAL_IMPROVE_BUDGET = 20000  # tokens tried to shorten a grammar's initial completion (once, on the worker)


@dataclass
class GrammarStep:
    """One step's guided rows: what the sampler needs to mask their logits and to accept their tokens."""
    rows: list[int]  # rows of the step's logits that are guided
    grammars: list[SequenceGrammar]
    remaining: list[int]  # tokens each may still produce, this one included
    bitmask: torch.Tensor  # int32 [>= number of logits rows, ceil(vocab / 32)], CPU; only `rows` are filled
    vocab_size: int
    manager: "StructuredOutputManager" = field(repr=False)
    filling: concurrent.futures.Future | None = None  # the bitmask's fill on the manager's filler thread

    def wait_filled(self) -> None:
        """Wait until `bitmask` is filled (a fill in the background; raises what the fill raised)."""
        if self.filling is not None:
            self.filling.result()
            self.filling = None

    def on_device(self, n: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The bitmask's first n rows on `dev` (straight from the pinned buffer: the next fill waits for this copy,
        manager._copied) and the row of tokens that can be part of valid UTF-8 there (None: every token can)."""
        self.wait_filled()
        bitmask = self.bitmask[:n]
        if dev.type != "cpu":
            bitmask = bitmask.to(dev, non_blocking=True)
            self.manager.copied_out()
        return bitmask, self.manager.utf8_valid(dev)

    def mask_rows(self, n: int, dev: torch.device) -> torch.Tensor | None:
        """For the sampling kernel: each of the n logits rows' bitmask row (-1: not guided); None when all are."""
        if len(self.rows) == n:
            return None
        rows = [-1] * n
        for r in self.rows:
            rows[r] = r
        return to_device(rows, torch.int32, dev)

    def apply(self, logits: torch.Tensor) -> None:
        """Set every token the grammar forbids to -inf in the guided rows of `logits` ([rows, vocab_size]), on
        logits' device (with the tokens that are never valid UTF-8). (The sampling kernel masks as it reads instead,
        where it draws every row: Sampler.sample.)"""
        import xgrammar as xgr

        n, dev = logits.shape[0], logits.device
        bitmask, valid = self.on_device(n, dev)
        if valid is not None:  # every row: a forced token is valid UTF-8, and an unguided row is not masked
            bitmask &= valid
        indices: Any = None if len(self.rows) == n else self.rows  # (rows are distinct and sorted)
        if indices is not None and dev.type != "cpu":  # pinned: a list would be copied with a wait
            indices = to_device(indices, torch.int32, dev)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=indices)

    def accept(self, tokens: list[int]) -> list[int]:
        """Accept each guided row's sampled token into its matcher; returns `tokens` with any token the budget-aware
        finish replaced (grammar.py)."""
        for row, grammar, left in zip(self.rows, self.grammars, self.remaining):
            tokens[row] = grammar.accept(tokens[row], left)
        return tokens


@dataclass
class _Waiting:
    request: Request
    future: concurrent.futures.Future


@dataclass
class StructuredOutputManager:
    """Owned by LLMEngine; every method runs on the engine thread, except the compilations on its worker."""
    tokenizer: Any
    vocab_size: int  # the model's (the logits' width)
    eos_token_ids: list[int]
    device: torch.device
    max_num_seqs: int
    on_ready: Callable[[], None] | None = None  # called on the worker when a compilation ends (wakes the loop)
    waiting: dict[str, _Waiting] = field(default_factory=dict)  # request id -> its compilation
    active: set[str] = field(default_factory=set)  # ids of released guided requests (their sequences have matchers)
    num_compiles: int = 0  # compilations run (cache hits excluded)
    num_cache_hits: int = 0
    _cache: "OrderedDict[tuple, concurrent.futures.Future]" = field(default_factory=OrderedDict)
    _executor: concurrent.futures.ThreadPoolExecutor | None = None
    _backend: Any = None  # XgrammarBackend, built by the worker
    _bitmask: torch.Tensor | None = None
    _copied: Any = None  # a CUDA event: the last copy of _bitmask to the device has run
    _filling: concurrent.futures.Future | None = None  # the last fill of _bitmask in the background
    _filler: concurrent.futures.ThreadPoolExecutor | None = None
    _valid: dict[torch.device, torch.Tensor | None] = field(default_factory=dict)
    _batch_matcher: Any = None

    # ---- requests --------------------------------------------------------------------------------------------------
    def add_request(self, req: Request) -> bool:
        """Start (or reuse) the compilation of req's grammar. True: it is ready, req's sequences have their matchers
        and req may be scheduled now; False: req waits (WAITING_FOR_FSM) until take_ready() hands it back. A spec
        already known to be invalid raises its ValueError here, leaving nothing behind."""
        params = req.sampling_params.structured_outputs
        future = self._compilation(params)
        if future.done():
            self._attach(req, self._result(params, future))  # raises the compile error
            return True
        for seq in req.seqs:
            seq.status = SequenceStatus.WAITING_FOR_FSM
        self.waiting[req.request_id] = _Waiting(req, future)
        return False

    def take_ready(self) -> tuple[list[Request], list[tuple[Request, BaseException]]]:
        """Requests whose compilation ended since the last call: (ready to schedule, with their matchers), and
        (failed, with why: a ValueError naming what is wrong with the spec)."""
        ready: list[Request] = []
        failed: list[tuple[Request, BaseException]] = []
        for rid, w in list(self.waiting.items()):
            if not w.future.done():
                continue
            del self.waiting[rid]
            try:
                self._attach(w.request, self._result(w.request.sampling_params.structured_outputs, w.future))
            except Exception as e:  # noqa: BLE001 - reported to that request's caller
                failed.append((w.request, e))
                continue
            ready.append(w.request)
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Block up to `timeout` seconds until some waiting request's compilation ends (offline use: nothing else
        to run meanwhile)."""
        futures = [w.future for w in self.waiting.values()]
        if futures:
            concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def finish(self, req: Request) -> None:
        """req finished or was aborted: drop its matchers (and its wait: the compilation goes on into the cache)."""
        self.waiting.pop(req.request_id, None)
        self.active.discard(req.request_id)
        for seq in req.seqs:
            seq.grammar = None

    def _result(self, params: StructuredOutputsParams, future: concurrent.futures.Future) -> Any:
        """The compiled grammar of a finished compilation; raises its ValueError (the spec is invalid: kept in the
        cache) or a RuntimeError (an internal failure: dropped from the cache, so that a later request retries)."""
        try:
            return future.result()
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001
            self._cache.pop(params.key(), None)
            raise RuntimeError(f"compiling the grammar failed: {type(e).__name__}: {e}") from e

    def _attach(self, req: Request, guide: Any) -> None:
        for seq in req.seqs:
            seq.grammar = SequenceGrammar(guide, self._backend)
            seq.status = SequenceStatus.WAITING
        self.active.add(req.request_id)

    # ---- compilation (the worker) ------------------------------------------------------------------------------
    def _compilation(self, params: StructuredOutputsParams) -> concurrent.futures.Future:
        key = params.key()
        future = self._cache.get(key)
        if future is not None:
            self._cache.move_to_end(key)
            self.num_cache_hits += 1
            return future
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvgate-grammar")
        future = self._executor.submit(self._compile, params)
        self._cache[key] = future
        self._evict()
        if self.on_ready is not None:
            future.add_done_callback(lambda _: self._wake())
        return future

    def _evict(self) -> None:
        """Drop the least recently used finished compilations beyond MAX_CACHED_GRAMMARS or MAX_CACHED_BYTES (a
        request holding one keeps it alive)."""
        size = sum(_size(f) for f in self._cache.values())
        while len(self._cache) > MAX_CACHED_GRAMMARS or size > MAX_CACHED_BYTES:
            oldest = next(iter(self._cache))
            if not self._cache[oldest].done():
                return
            size -= _size(self._cache.pop(oldest))

    def _wake(self) -> None:
        try:
            if self.on_ready is not None:
                self.on_ready()
        except Exception:  # pragma: no cover - a wake-up must never break the worker
            logger.exception("waking the engine loop failed")

    def _compile(self, params: StructuredOutputsParams) -> Any:
        """On the worker: the backend on first use, the compiled grammar and its initial completion."""
        backend = self._get_backend()
        self.num_compiles += 1
        guide = backend.compile(params)
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(guide.grammar)
        alphabet = backend.search_alphabet
        plan = CompletionSearch(matcher, alphabet, MAX_COMPLETION_TOKENS, backend.vocab_size).run()
        if plan is not None:
            plan = improve(matcher, alphabet, plan, backend.vocab_size, INITIAL_IMPROVE_BUDGET)
        guide.initial_completion = plan
        return guide

    def _get_backend(self) -> Any:
        if self._backend is None:
            from kvgate.engine.structured_output.backend import XgrammarBackend

            self._backend = XgrammarBackend(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._backend

    # ---- a step ----------------------------------------------------------------------------------------------------
    def prepare_step(self, rows: list[Sequence], remaining: list[int | None],
                     unguided: AbstractSet[Sequence] = frozenset(), background: bool = False) -> GrammarStep | None:
        """The step's GrammarStep for the sampled `rows` (remaining[i]: tokens rows[i] may still produce, None for
        an unguided row), its bitmask filled (`background`: being filled on the filler thread, see
        GrammarStep.wait_filled); None when no row is guided. Rows in `unguided` are left out (their tokens will
        not be used)."""
        guided = [i for i, seq in enumerate(rows) if seq.grammar is not None and seq not in unguided]
        if not guided:
            return None
        bitmask = self._bitmask_rows(len(rows))
        grammars = [rows[i].grammar for i in guided]
        left = [remaining[i] for i in guided]
        free: list[int] = []
        matchers: list[Any] = []
        leads: list[tuple[int, int]] = []
        forced_rows: list[int] = []
        forced_tokens: list[int] = []
        for i, g, r in zip(guided, grammars, left):
            forced = g.prepare(r)
            if forced is None:
                free.append(i)
                matchers.append(g.matcher)
                if g.pending_lead is not None:
                    leads.append((i, g.pending_lead))
            else:
                forced_rows.append(i)
                forced_tokens.append(forced)
        if forced_rows:  # each such row allows its token alone (numpy: two torch index ops a row cost ~5 us)
            view, tokens = bitmask.numpy(), np.asarray(forced_tokens, dtype=np.int64)
            view[forced_rows] = 0
            view[forced_rows, tokens >> 5] = (np.int64(1) << (tokens & 31)).astype(np.uint32).view(np.int32)
        step = GrammarStep(guided, grammars, left, bitmask, self.vocab_size, self)  # type: ignore[arg-type]
        if free and background:
            step.filling = self._filling = self._fill_in_background(matchers, free, bitmask, leads)
        elif free:
            self._fill(matchers, free, bitmask, leads)
        return step

    def _fill(self, matchers: list[Any], free: list[int], bitmask: torch.Tensor, leads: list[tuple[int, int]],
              batch: bool = False) -> None:
        """The grammar's mask of matchers[j] in row free[j], narrowed in each row of `leads` (row, lead byte) where
        the output ends with a lead byte whose next byte has a narrower range (XgrammarBackend.utf8_masks; the tokens
        never valid go in GrammarStep.apply)."""
        if batch or len(free) >= BATCH_FILL_MIN_ROWS:
            if self._batch_matcher is None:
                import xgrammar as xgr

                self._batch_matcher = xgr.BatchGrammarMatcher(BATCH_FILL_THREADS)
            self._batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, free)
        else:
            for i, m in zip(free, matchers):
                m.fill_next_token_bitmask(bitmask, i)
        after_lead = self._backend.utf8_masks[1]
        for i, lead in leads:
            bitmask[i] &= after_lead[lead]

    def _fill_in_background(self, *args: Any) -> concurrent.futures.Future:
        """_fill on the filler thread, in one batch call: xgrammar releases the GIL while it fills, a loop of row
        calls would wait for the GIL between rows."""
        if self._filler is None:
            self._filler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvgate-fill")
        started = threading.Event()

        def fill() -> None:
            started.set()
            self._fill(*args, batch=True)

        future = self._filler.submit(fill)
        started.wait()  # handed over: the thread holds the GIL only until the fill starts (else it might wait for
        # the engine loop's GIL for a whole switch interval, 5 ms)
        return future

    def copied_out(self) -> None:
        """GrammarStep.apply queued the copy of the bitmask to the device: the next fill waits until it ran."""
        self._copied = torch.cuda.Event()
        self._copied.record()

    def utf8_valid(self, device: torch.device) -> torch.Tensor | None:
        """The row of tokens that can be part of valid UTF-8 on `device`; None when every token can."""
        if device not in self._valid:
            self._valid[device] = self._backend.utf8_masks[0].to(device) if self._backend.narrow_utf8 else None
        return self._valid[device]

    def _bitmask_rows(self, n: int) -> torch.Tensor:
        if self._filling is not None:  # (its step was applied, or dropped)
            concurrent.futures.wait([self._filling])
            self._filling = None
        if self._copied is not None:  # (the step's sampled tokens reached the host already, after that copy)
            self._copied.synchronize()
            self._copied = None
        if self._bitmask is None or self._bitmask.shape[0] < n:
            width = self._backend.bitmask_width
            rows = max(n, self.max_num_seqs)
            self._bitmask = torch.empty((rows, width), dtype=torch.int32, pin_memory=self.device.type == "cuda")
        return self._bitmask


def _size(future: concurrent.futures.Future) -> int:
    """Bytes a cached compilation holds (0 while it runs, or when it failed)."""
    if not future.done() or future.exception() is not None:
        return 0
    return future.result().memory_bytes
