"""Which sequences run this step: priorities with aging, a token budget, chunked prefill, preemption,
and a batching window (scheduler_delay, capped per request by its max batch delay)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvgate.engine.block_manager import BlockManager
from kvgate.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    """A step, decided once here: which sequences compute how many tokens from where, which of them decode, and
    which have their logits sampled. The sequences' num_computed_tokens already count this step."""
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, new tokens), decodes first
    num_computed: list[int] = field(default_factory=list)  # per scheduled seq: its tokens in the cache before
    samples: list[bool] = field(default_factory=list)  # per scheduled seq: this step computes all its tokens
    num_decodes: int = 0  # the first num_decodes scheduled seqs compute one token, their last
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, enable_chunked_prefill: bool = True, enable_preemption: bool = True,
                 scheduler_delay: float = 0.0, priority_aging_rate: float = 2.0, async_scheduling: bool = False
                 ) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.enable_preemption = enable_preemption
        self.scheduler_delay = scheduler_delay
        self.priority_aging_rate = priority_aging_rate
        self.async_scheduling = async_scheduling  # a running sequence may be planned while its token is pending
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.next_wakeup: float | None = None  # when held prefills become due (None: nothing held)
        self._exclude: set[Sequence] | frozenset = frozenset()
        self._max_seqs: int | None = None

    # ---- queue bookkeeping -------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A forked child that already holds (shared) blocks."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status == SequenceStatus.FINISHED:
            return
        queue = self.running if seq.status == SequenceStatus.RUNNING else self.waiting
        if seq in queue:  # an unforked sample (n > 1) is in no queue yet
            queue.remove(seq)
        self.bm.free(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def effective_priority(self, seq: Sequence, now: float) -> float:
        """Higher runs first; waiting time raises it so that no request starves."""
        return seq.priority + self.priority_aging_rate * (now - seq.arrival_time)

    def _order(self, seq: Sequence, now: float) -> tuple[float, float, int]:
        return (-self.effective_priority(seq, now), seq.arrival_time, seq.index)

    def batch_deadline(self, seq: Sequence) -> float:
        if seq.num_preemptions:  # preempted work is never held again
            return seq.arrival_time
        delay = self.scheduler_delay
        if seq.request.max_batch_delay is not None:
            delay = min(delay, seq.request.max_batch_delay)
        return seq.arrival_time + delay

    @staticmethod
    def seats_needed(seq: Sequence) -> int:
        """A request's first sample takes a seat for each of its n samples: the others fork from it."""
        n = seq.request.sampling_params.n
        return n if seq.index == 0 and not seq.request.forked else 1

    def _seats_used(self) -> int:
        return sum(self.seats_needed(s) for s in self.running)

    def _reserve(self, seq: Sequence) -> int:
        """Blocks seq may still need (preemption off: admission keeps room for every running sequence)."""
        extra = seq.request.max_output_tokens
        longest = min(seq.num_prompt_tokens + (self.max_model_len if extra is None else extra), self.max_model_len)
        return self.seats_needed(seq) * self.bm.blocks_needed(longest) - len(seq.block_table)

    # ---- the step ------------------------------------------------------------------------------------------
    def schedule(self, now: float | None = None, exclude: set[Sequence] | frozenset = frozenset(),
                 max_seqs: int | None = None) -> SchedulerOutput:
        """`exclude`: running sequences whose last step is still in flight (pipeline stages): neither scheduled nor
        preempted now; `max_seqs`: at most this many sequences this step (so that the stages' steps in flight share
        the running ones; vLLM's virtual engines each schedule max_num_seqs / stages)."""
        now = time.monotonic() if now is None else now
        self._now, self._out, self._exclude = now, SchedulerOutput(), exclude
        self._max_seqs = max_seqs
        self._planned: dict[Sequence, int] = {}
        self._budget = self.max_num_batched_tokens

        # 1. running sequences: decodes first, then prefill chunks, each in priority order
        aging = self.priority_aging_rate
        self.running.sort(key=lambda s: (-(s.request.priority + aging * (now - s.request.arrival_time)),
                                         s.request.arrival_time, s.index))  # = self._order, inlined (hot)
        decodes, chunks = [], []
        limit = self.max_model_len
        for s in self.running:
            if s.num_pending and (not self.async_scheduling or s.tokens_left(limit) <= s.num_pending):
                continue  # its next step needs its pending token on the host, or it ends with that token
            if s.loading is not None and not self.bm.loaded(s):
                continue  # its prefix blocks are still being loaded from the offload tier: others run
            (decodes if s.num_tokens - s.num_computed_tokens == 1 else chunks).append(s)
        for seq in decodes + chunks:
            if seq.status != SequenceStatus.RUNNING or self._budget <= 0 or seq in exclude:
                continue
            if self._max_seqs is not None and len(self._planned) >= self._max_seqs:
                break
            n = min(seq.num_tokens - seq.num_computed_tokens, self._budget)
            while not self.bm.allocate(seq, seq.num_computed_tokens + n):
                victim = self._lowest_running() if self.enable_preemption else None
                if victim is None:
                    break
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self._plan(seq, n)

        # 2. waiting sequences, unless this step had to preempt (the cache is full)
        self.next_wakeup = None
        if not self._out.preempted and self.waiting:
            self._admit()

        first, rest = [], []
        for seq, n in self._planned.items():
            (first if n == 1 and seq.num_tokens - seq.num_computed_tokens == 1 else rest).append((seq, n))
        out = self._out
        out.scheduled, out.num_decodes = first + rest, len(first)  # decodes first
        for seq, n in out.scheduled:
            c = seq.num_computed_tokens
            out.num_computed.append(c)
            out.samples.append(c + n == seq.num_tokens)
            seq.num_computed_tokens = c + n  # counted now: the next step may be planned before this one ran
        return out

    def _plan(self, seq: Sequence, n: int) -> None:
        self._planned[seq] = n
        self._budget -= n

    def _preempt(self, victim: Sequence) -> None:
        """Preemption by recompute: free the victim's blocks and send it back to the waiting queue."""
        self._budget += self._planned.pop(victim, 0)
        self.running.remove(victim)
        self.bm.free(victim)
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        victim.status = SequenceStatus.WAITING
        self.waiting.append(victim)
        self.num_preemptions += 1
        self._out.preempted.append(victim)

    def _lowest_running(self, below: float | None = None) -> Sequence | None:
        """The preemption victim: lowest (effective) priority, newest; only below `below` if given."""
        now = self._now
        cands = [s for s in self.running if (below is None or self.effective_priority(s, now) < below)
                 and s not in self._exclude]
        return max(cands, key=lambda s: self._order(s, now)) if cands else None

    def _admit(self) -> None:
        now, bs = self._now, self.bm.block_size
        self.waiting.sort(key=lambda s: self._order(s, now))
        used = self._seats_used()  # kept up to date below: summing over the running ones per admission is O(n^2)
        deadlines = [self.batch_deadline(s) for s in self.waiting]
        wanted = sum(self.seats_needed(s) for s in self.waiting)
        if min(deadlines) > now and wanted < self.max_num_seqs - used:  # hold: wait for more prefills to batch
            self.next_wakeup = min(deadlines)
            return
        for seq in list(self.waiting):
            if self._budget <= 0 or (self._max_seqs is not None and len(self._planned) >= self._max_seqs):
                return
            if seq.num_pending:
                continue  # preempted while its step was in flight: its token reaches the host first
            prio = self.effective_priority(seq, now)
            seats = self.seats_needed(seq)
            while used + seats > self.max_num_seqs:
                victim = self._lowest_running(below=prio) if self.enable_preemption else None
                if victim is None:
                    return
                used -= self.seats_needed(victim)
                self._preempt(victim)
            if not self.enable_preemption:
                reserved = sum(self._reserve(s) for s in self.running)
                if self.bm.num_free_blocks - reserved < self._reserve(seq):
                    return
            while True:
                computed = self.bm.get_computed_blocks(seq) if not seq.block_table else []
                if computed is None:
                    break  # its prefix is being read from disk: it waits, the requests behind it may run
                start = len(computed) * bs if computed else seq.num_computed_tokens
                remaining = seq.num_tokens - start
                n = min(remaining, self._budget)
                if not self.enable_chunked_prefill and n < remaining:
                    return
                if self.bm.allocate(seq, start + n, computed):
                    break
                victim = self._lowest_running(below=prio) if self.enable_preemption else None
                if victim is None:
                    return  # keep priority order: nothing behind this request jumps the queue
                used -= self.seats_needed(victim)
                self._preempt(victim)
            if computed is None:
                continue
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            used += seats
            if seq.request.first_scheduled_time is None:
                seq.request.first_scheduled_time = now
            if seq.loading is None:  # (else it runs once its blocks are loaded)
                self._plan(seq, n)
