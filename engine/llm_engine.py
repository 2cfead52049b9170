"""LLMEngine: add_request / abort_request / step over the scheduler, block manager, model runner and sampler (the
generate runner) or pooler (the pooling runner: embedding models; one runner per engine, EngineConfig.runner).
Guided requests (SamplingParams.structured_outputs) wait for their grammar in the StructuredOutputManager
(engine/structured_output/) before they are scheduled; their sampled rows are masked by it."""
from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from kvgate.engine.block_manager import BlockManager
from kvgate.engine.config import EngineArgs, EngineConfig
from kvgate.engine.detokenizer import byte_table, check_stop_strings, detokenize_incrementally, init_offsets
from kvgate.engine.executor import Executor
from kvgate.engine.kv_offload import OffloadTier
from kvgate.engine.outputs import CompletionOutput, DeltaTuple, EngineOutput, Logprob, PoolingOutput, \
    PoolingRequestOutput, RequestOutput
from kvgate.engine.pooler import Pooler
from kvgate.engine.pooling_params import PoolerConfig, PoolingParams, check_runner
from kvgate.engine.sampler import SampledTokens, Sampler, to_device
from kvgate.engine.sampling_params import RequestOutputKind, SamplingParams
from kvgate.engine.scheduler import Scheduler, SchedulerOutput
from kvgate.engine.sequence import DEFAULT_PRIORITY, Request, Sequence, SequenceStatus
from kvgate.engine.stats import LatencyStats, LoopTimes
from kvgate.engine.step_input import StepInputBuilder
from kvgate.engine.structured_output import StructuredOutputsParams
from kvgate.engine.structured_output.manager import GrammarStep, StructuredOutputManager
from kvgate.engine.tokenizer import eos_token_ids, load_tokenizer

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict[str, Any]


@dataclass
class StepInFlight:
    """A started step: what was scheduled, the rows it samples (a request's n samples share its logits row: `index`
    is each row's logits row), the executor's handle, and (async scheduling) its tokens, sampled already."""
    out: SchedulerOutput
    rows: list[Sequence]
    index: list[int]
    started: Any
    sampled: SampledTokens | None = None
    logits: torch.Tensor | None = None  # async: logits whose drawing waits for the step before to complete
    guide: GrammarStep | None = None  # async: its guided rows' masks, being filled while the drawing is deferred
    # async: rows whose input token the step before replaced (a guided row's budget-aware finish) after this step
    # started with the token drawn: their results are dropped, and the position is computed again
    dropped: set[Sequence] = field(default_factory=set)


def encode_prompt(tokenizer: Any, prompt: PromptType) -> tuple[str | None, list[int]]:
    """(prompt text or None, prompt token ids) for a string, a list of token ids or a dict with either."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        prompt = prompt.get("prompt", "")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this engine has no tokenizer (skip_tokenizer_init): pass prompt token ids")
        return prompt, (tokenizer.encode(prompt) if prompt else [])
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return None, list(prompt)
    raise ValueError("prompt must be a string, a list of token ids, or a dict with 'prompt'/'prompt_token_ids'")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        a = config.args
        self.tokenizer = None if a.skip_tokenizer_init else load_tokenizer(config)
        if self.tokenizer is not None:
            byte_table(self.tokenizer)  # built now (a byte-level tokenizer's bytes per token), not at the first token
        self.executor = Executor(config)  # every tensor-parallel rank's runner (one, in this process, at size 1)
        self.runner = self.executor.runner  # rank 0's: its logits are sampled here
        capacity = self.runner.num_blocks * a.block_size
        if capacity < config.max_model_len:
            logger.warning("KV cache holds %d tokens, fewer than max_model_len %d: lowering max_model_len",
                           capacity, config.max_model_len)
            config.max_model_len = capacity
        self.max_model_len = config.max_model_len
        offload = None
        store = self.runner.offload
        if store is not None:
            disk = store.disk  # rank 0's: the files it holds already, how its fetches go, whether it still works
            ranks = a.tensor_parallel_size * a.pipeline_parallel_size  # > 1: every rank's fetches are confirmed
            offload = OffloadTier(
                store.num_slots, a.kv_offloading_eviction, self.runner.block_bytes_all_ranks,
                disk_blocks=int(a.kv_offloading_disk_size * (1 << 30)) // self.runner.block_bytes_all_ranks
                if disk is not None else 0,
                on_disk=self.runner.on_disk if disk is not None else None,
                fetch_result=disk.poll if disk is not None else None,
                disk_broken=lambda: disk is not None and disk.broken,
                confirm_result=store.take_confirmed if disk is not None and ranks > 1 else None,
                load_done=store.loaded if store.aside else None)  # CUDA: loads beside the steps
        self.block_manager = BlockManager(self.runner.num_blocks, a.block_size, a.enable_prefix_caching, offload)
        self.step_inputs = StepInputBuilder()  # what the runners were told of each sequence
        # async scheduling (one rank): step N+1 is scheduled and started while the device runs step N, its pending
        # tokens taken from N's sampled tokens on the device; the host reads N's tokens one step late
        self.async_scheduling = config.async_scheduling
        # steps started and not completed: up to one per pipeline stage, or two with async scheduling
        self.depth = 2 if self.async_scheduling else self.executor.pipeline_depth
        self.in_flight: collections.deque[StepInFlight] = collections.deque()
        self.in_flight_seqs: set[Sequence] = set()  # pipeline stages: the sequences of the steps in flight
        self.last_sampled: SampledTokens | None = None  # async: the latest started step's tokens
        self.last_rows: dict[int, int] = {}  # async: seq id -> its row in last_sampled
        self.drawing: StepInFlight | None = None  # async: a step whose sampling waits for its masks' fill (_draw)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_model_len, a.enable_chunked_prefill, a.enable_preemption,
                                   a.scheduler_delay, a.priority_aging_rate, self.async_scheduling)
        self.eos_token_ids = eos = eos_token_ids(config, self.tokenizer)
        self.sampler = Sampler(config.model_config.vocab_size, eos, a.seed)
        self.structured_output_manager = StructuredOutputManager(self.tokenizer, config.model_config.vocab_size, eos,
                                                                 config.device, config.max_num_seqs)
        self.failed: list[tuple[str, BaseException]] = []  # requests that failed after add_request: take_failed()
        self.pooler = Pooler(config.pooler_config or PoolerConfig()) if config.runner == "pooling" else None
        self.requests: dict[str, Request] = {}
        self.num_prompt_tokens = 0  # totals, for metrics
        self.num_generation_tokens = 0
        self.num_steps = 0
        self.num_rewinds = 0  # async: run-ahead positions computed again (their input token was replaced)
        self.latency_stats = LatencyStats()  # time to first token, inter-token latency, e2e and queue time
        self.loop_times = LoopTimes()  # filled by the EngineCore that runs this engine
        self.sleep_when_held = True  # step() sleeps while prefills are held for batching (the async loop waits)
        self.output_prompts = True  # False: outputs leave prompt and prompt_token_ids None (the caller has them)
        self.delta_tuples = False  # True (the core's process): one-sample DELTA outputs as DeltaTuples (outputs.py)
        self.stream_interval = a.stream_interval

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args.create_engine_config())

    # ---- requests ---------------------------------------------------------------------------------------------
    def encode_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return encode_prompt(self.tokenizer, prompt)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams | None = None,
                    priority: int = DEFAULT_PRIORITY, max_batch_delay: float | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue a request: a generate request (SamplingParams, None: the defaults) or a pooling request
        (PoolingParams), each refused by an engine of the other runner. Invalid input raises a ValueError and
        leaves nothing behind."""
        pooling = isinstance(params, PoolingParams)
        check_runner(self.config.runner, pooling)
        sp = SamplingParams() if pooling or params is None else params
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.encode_prompt(prompt)
        self.validate_prompt(ids, pooling)
        if pooling:
            params.verify(self.pooler.config, self.config.model_config.hidden_size)
        if not isinstance(priority, int) or isinstance(priority, bool) or not 0 <= priority <= 100:
            raise ValueError(f"priority must be an integer in [0, 100] (higher is more urgent), got {priority!r}")
        if max_batch_delay is not None and max_batch_delay < 0:
            raise ValueError(f"max_batch_delay must be >= 0 seconds, got {max_batch_delay}")
        if sp.n > self.config.max_num_seqs:
            raise ValueError(f"n={sp.n} samples cannot run together: max_num_seqs is {self.config.max_num_seqs}")
        req = Request(request_id, text, ids, sp, priority, max_batch_delay, pooling_params=params if pooling else None,
                      skip_reading_prefix_cache=pooling and self.pooler.config.needs_every_token)
        if not self.config.args.enable_preemption:
            extra = req.max_output_tokens
            longest = min(len(ids) + (self.max_model_len if extra is None else extra), self.max_model_len)
            need = sp.n * self.block_manager.blocks_needed(longest)
            if need > self.block_manager.num_blocks:
                raise ValueError(f"this request may need {need} KV blocks ({sp.n} x {longest} tokens) but the cache "
                                 f"has {self.block_manager.num_blocks} and preemption is off: lower max_tokens or n")
        if sp.logprobs is not None and sp.logprobs > self.config.args.max_logprobs:
            raise ValueError(f"logprobs must be <= {self.config.args.max_logprobs}, got {sp.logprobs}")
        guided = not pooling and sp.structured_outputs is not None
        if guided:
            self._check_guided(sp)
        if arrival_time is not None:
            req.arrival_time = arrival_time
        for i in range(sp.n):
            seq = Sequence(req, i, list(ids))
            if not pooling:
                init_offsets(seq)
            if sp.seed is not None:
                seq.generator = torch.Generator(device=self.config.device).manual_seed((sp.seed * 1000003 + i) % 2**63)
            req.seqs.append(seq)
        # a guided request whose grammar is not compiled yet waits (WAITING_FOR_FSM) until step() finds it ready;
        # a spec known to be invalid raises here, before anything is registered
        ready = not guided or self.structured_output_manager.add_request(req)
        self.requests[request_id] = req
        self.num_prompt_tokens += len(ids)
        if ready:
            self.scheduler.add(req.seqs[0])  # the others fork from it once the prompt is computed

    def _check_guided(self, sp: SamplingParams) -> None:
        if not isinstance(sp.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(sp.structured_outputs).__name__}")
        if self.tokenizer is None:
            raise ValueError("guided decoding (structured_outputs) needs the model's tokenizer, and this engine runs "
                             "without one (skip_tokenizer_init)")

    def validate_prompt(self, ids: list[int], pooling: bool = False) -> None:
        """A pooling prompt may fill max_model_len; a generate prompt must leave room for one output token."""
        if not ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        vocab = self.config.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of range: ids must be in [0, {vocab})")
        if pooling and len(ids) > self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, but this model's maximum context length is "
                             f"{self.max_model_len} tokens")
        if not pooling and len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, but this model's maximum context length is "
                             f"{self.max_model_len} tokens (at most {self.max_model_len - 1} prompt tokens, "
                             f"leaving room for one output token)")

    def abort_request(self, request_id: str | Iterable[str]) -> list[EngineOutput | DeltaTuple]:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        outs = []
        for rid in ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            for seq in req.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq, "abort")
            if req.sampling_params.structured_outputs is not None:
                self.structured_output_manager.finish(req)
            self.latency_stats.on_finished(req, time.monotonic(), "abort")
            outs.append(self._make_output(req, force=True))
        return outs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def only_waiting_for_grammars(self) -> bool:
        """Every unfinished request waits for its grammar to compile: a step has nothing to run."""
        return bool(self.requests) and len(self.structured_output_manager.waiting) == len(self.requests)

    def take_failed(self) -> list[tuple[str, BaseException]]:
        """Requests that failed since the last call after add_request had taken them (an invalid grammar found by
        its compilation): (request id, the error, a ValueError naming what is wrong). They are gone from the
        engine, nothing of them left behind."""
        failed, self.failed = self.failed, []
        return failed

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def shutdown(self) -> None:
        """End the parallel workers, if any (the engine cannot step afterwards); steps in flight are completed
        first, their results dropped."""
        self.drawing = None
        while self.in_flight and self.executor.dead is None:
            f = self.in_flight.popleft()
            if f.sampled is not None or f.logits is not None:
                continue
            try:
                self.executor.finish(f.started)
            except RuntimeError:
                break
        self.executor.shutdown()

    # ---- the step -----------------------------------------------------------------------------------------------
    def step(self) -> list[EngineOutput | DeltaTuple]:
        """Schedule and start a step, complete the oldest started one (its sampled tokens appended, stop checks,
        outputs) and return its outputs. Up to `depth` steps are in flight: with pipeline stages one per stage over
        sequences not already in flight (vLLM's virtual engines); with async scheduling two, the newer one started
        before the older one's tokens reached the host. A call that started a step while there was room for another
        returns []. With `delta_tuples` (the engine core's process), one-sample DELTA outputs come as DeltaTuples."""
        so = self.structured_output_manager
        if so.waiting:
            self._release_guided()
        tier = self.block_manager.offload
        if tier is not None and (tier.fetching or tier.fetched):
            tier.poll()  # blocks read back from disk: their requests may run now
        depth = self.depth
        if len(self.in_flight) < depth:
            cap = None
            if depth > 1 and not self.async_scheduling:  # pipeline stages: the steps in flight share the sequences
                sched = self.scheduler
                cap = max(1, -(-min(len(sched.running) + len(sched.waiting), self.config.max_num_seqs) // depth))
            out = self.scheduler.schedule(exclude=self.in_flight_seqs, max_seqs=cap)
            if not out.is_empty:
                if self.pooler is not None:
                    return self._pooling_step(out)
                self.in_flight.append(self._start(out))
                if len(self.in_flight) < depth:
                    return []  # room for one more step before this one's tokens are needed
            else:
                if tier is not None and tier.ops:  # loads or reads from disk for requests that wait on them: now
                    self.executor.apply_offload(tier.take_ops())
                if not self.in_flight:
                    wake = self.scheduler.next_wakeup
                    if wake is not None and self.sleep_when_held:  # prefills held to batch them: sleep until due
                        time.sleep(max(0.0, min(wake - time.monotonic(), 0.05)))
                    elif so.waiting and self.sleep_when_held:  # only grammars compiling: wait for one
                        so.wait(0.05)
                    elif tier is not None and tier.loading:  # only loads from the tier: wait for them
                        tier.loaded(tier.ticket - 1, wait=True)
                    elif tier is not None and tier.fetching:  # only reads from disk: a short nap, not a busy loop
                        time.sleep(0.001)
                    return []
        outputs = self._complete(self.in_flight.popleft())
        if self.in_flight and self.in_flight[0].logits is not None:
            # its guided rows' masks / penalties now see the tokens just completed; the masks are filled while the
            # caller takes the outputs and the next step is scheduled
            self._draw(self.in_flight[0], defer=True)
        return outputs

    def _start(self, out: SchedulerOutput) -> StepInFlight:
        """Start a scheduled step: fork the n > 1 samples of a prompt it completes, send the step to the ranks and,
        with async scheduling, sample its logits on the device (after the step in flight completed, when a row's
        grammar mask or penalties need that step's tokens). Each sampled row has one more pending token."""
        rows: list[Sequence] = []
        index: list[int] = []
        row = 0
        for (seq, _), wanted in zip(out.scheduled, out.samples):
            if not wanted:
                continue
            req = seq.request
            targets = [seq]
            if seq.index == 0 and req.sampling_params.n > 1 and not req.forked:
                req.forked = True  # parallel sampling: the other samples share the computed prompt blocks
                for child in req.seqs[1:]:
                    self.block_manager.fork(seq, child)
                    self.scheduler.add_running(child)
                targets = req.seqs
            rows.extend(targets)
            index.extend([row] * len(targets))
            row += 1
        bm = self.block_manager
        step = self.step_inputs.build(out, bm.take_freed(), bm.offload.take_ops() if bm.offload else None,
                                      self.last_rows if self.async_scheduling else None)
        self._finish_draw()
        last = self.last_sampled.token_ids if self.last_sampled is not None and step.pending_rows else None
        started = self.executor.start(step, last)
        f = StepInFlight(out, rows, index, started)
        if not self.async_scheduling:  # drawn when the step completes
            if self.depth > 1:
                self.in_flight_seqs.update(seq for seq, _ in out.scheduled)
            for s in rows:
                s.num_pending += 1
        elif rows:
            f.logits = self.executor.finish(started)
            if not (self.in_flight and any(s.grammar is not None or s.request.sampling_params.has_penalties
                                           for s in rows)):
                self._draw(f)
            # else a grammar's mask or the penalties need the tokens of the step in flight: drawn once it completed
        return f

    def _draw(self, f: StepInFlight, defer: bool = False) -> None:
        """Async scheduling: sample a started step on the device; its tokens are the next step's pending inputs.
        `defer`: where guided rows' masks must be filled, the sampling waits for _finish_draw (before the next step
        starts, or this one completes) while they are filled on the structured-output manager's thread."""
        f.guide = self._guide(f.rows, f.dropped, background=defer)
        for s in f.rows:
            if s not in f.dropped:
                s.num_pending += 1
        self.last_rows = {s.seq_id: i for i, s in enumerate(f.rows)}
        self.drawing = f
        if not defer or f.guide is None:
            self._finish_draw()

    def _finish_draw(self) -> None:
        """Sample the step _draw prepared, if any (its rows' num_pending count the token already)."""
        f, self.drawing = self.drawing, None
        if f is not None:
            f.sampled = self._sample(f.logits, f.rows, f.index, f.guide, counted=True)  # type: ignore[arg-type]
            f.logits = f.guide = None
            self.last_sampled = f.sampled

    def _guide(self, rows: list[Sequence], dropped: set[Sequence] | frozenset = frozenset(),
               background: bool = False) -> GrammarStep | None:
        """The guided rows' masks (StructuredOutputManager.prepare_step), or None; a dropped row is drawn unguided,
        its token never used."""
        so = self.structured_output_manager
        if not so.active:
            return None
        return so.prepare_step(rows, [s.tokens_left(self.max_model_len) if s.grammar is not None else None
                                      for s in rows], dropped, background)

    def _sample(self, logits: torch.Tensor, rows: list[Sequence], index: list[int], guide: GrammarStep | None,
                counted: bool = False) -> SampledTokens:
        """Sample the rows, guided ones masked by `guide`."""
        if len(index) != logits.shape[0] or index[-1] != len(index) - 1:  # n > 1: rows share a logits row
            logits = logits[to_device(index, torch.long, logits.device)]
        return self.sampler.sample(logits, rows, guide, counted)

    def _complete(self, f: StepInFlight) -> list[EngineOutput]:
        """A started step's results: its sampled tokens on the host, prefix-cache blocks, outputs. A sequence that
        finished while the step was in flight (aborted, or stopped by the step before: async scheduling) is
        skipped."""
        self._finish_draw()
        self.num_steps += 1
        self.latency_stats.on_step(f.out.num_batched_tokens)
        if self.depth > 1 and not self.async_scheduling:
            self.in_flight_seqs.difference_update(seq for seq, _ in f.out.scheduled)
        rows = f.rows
        sampled = f.sampled
        if sampled is None:  # sampled now: the rows' tokens are no longer pending while they are drawn
            for seq in rows:
                seq.num_pending -= 1
            logits = self.executor.finish(f.started)
            sampled = self._sample(logits, rows, f.index, self._guide(rows)) if rows else None
        for seq, _ in f.out.scheduled:
            if seq.status is not SequenceStatus.FINISHED:
                self.block_manager.cache_full_blocks(seq)
        if sampled is None:
            return []
        result = self.sampler.result(sampled)
        touched: dict[str, Request] = {}
        for seq, token, lp, drawn in zip(rows, result.token_ids, result.logprobs, result.drawn):
            if seq in f.dropped:
                continue
            if f.sampled is not None:
                seq.num_pending -= 1
            if seq.is_finished:
                continue
            self._append_token(seq, token, lp)
            touched[seq.request.request_id] = seq.request
            if token != drawn and not seq.is_finished and self.in_flight:
                self._rewind(seq, self.in_flight[0])
        so = self.structured_output_manager
        outputs, now = [], time.monotonic()
        for req in touched.values():
            self.latency_stats.on_tokens(req, now)
            o = self._make_output(req)
            if o is not None:
                outputs.append(o)
            if req.finished:
                self.requests.pop(req.request_id, None)
                if req.request_id in so.active:
                    so.finish(req)
                self.latency_stats.on_finished(req, now, req.seqs[0].finish_reason)
        return outputs

    def _rewind(self, seq: Sequence, next_step: StepInFlight) -> None:
        """seq's grammar replaced the token it drew (the budget-aware finish), and the step in flight after this one
        computes seq's next position from the token drawn: that position is computed again, from the token kept, by
        a later step, and this step's result for seq is dropped."""
        if not any(s is seq for s, _ in next_step.out.scheduled):
            return
        seq.num_computed_tokens -= 1
        self.num_rewinds += 1
        if any(s is seq for s in next_step.rows):
            next_step.dropped.add(seq)
            if next_step.sampled is not None:  # drawn already: its token is no longer pending
                seq.num_pending -= 1

    def _release_guided(self) -> None:
        """Schedule the guided requests whose grammar is now compiled; fail those whose spec was invalid."""
        ready, failed = self.structured_output_manager.take_ready()
        for req in ready:
            if req.request_id in self.requests:
                self.scheduler.add(req.seqs[0])
        for req, error in failed:
            if self.requests.pop(req.request_id, None) is None:
                continue
            for seq in req.seqs:
                self.scheduler.finish(seq, "abort")  # in no queue and holding no block: only marked finished
            self.num_prompt_tokens -= len(req.prompt_token_ids)
            self.failed.append((req.request_id, error))

    def _pooling_step(self, out: SchedulerOutput) -> list[EngineOutput]:
        """Prefill chunks only: every sequence whose prompt is now computed is pooled and finishes ("stop")."""
        bm = self.block_manager
        step = self.step_inputs.build(out, bm.take_freed(), bm.offload.take_ops() if bm.offload else None)
        pooled = self.pooler.step(self.executor.execute_hidden(step), out.scheduled, out.num_computed)
        self.num_steps += 1
        self.latency_stats.on_step(out.num_batched_tokens)
        for seq, _ in out.scheduled:
            bm.cache_full_blocks(seq)
        outputs: list[EngineOutput] = []
        now = time.monotonic()
        for (seq, _), embedding in zip(pooled, self.pooler.finish(pooled)):
            req = seq.request
            self.scheduler.finish(seq, "stop")  # frees its blocks (full ones stay in the prefix cache)
            self.requests.pop(req.request_id, None)
            self.latency_stats.on_finished(req, now, "stop")
            outputs.append(self._pooling_output(req, embedding))
        return outputs

    def _pooling_output(self, req: Request, embedding: list[float]) -> PoolingRequestOutput:
        prompt, ids = (req.prompt, req.prompt_token_ids) if self.output_prompts else (None, None)
        return PoolingRequestOutput(req.request_id, prompt, ids,  # type: ignore[arg-type]
                                    PoolingOutput(embedding), True, metrics={"arrival_time": req.arrival_time})

    def _append_token(self, seq: Sequence, token: int, lp: tuple | None) -> None:
        req, sp = seq.request, seq.request.sampling_params
        seq.token_ids.append(token)
        self.num_generation_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        if lp is not None:
            chosen, rank, top = lp
            seq.cumulative_logprob += chosen
            entry = {tid: Logprob(v, r + 1, self._decode_one(tid)) for r, (tid, v) in enumerate(top)}
            entry[token] = Logprob(chosen, rank, self._decode_one(token))
            seq.logprobs.append(entry)
        reason, stop_reason = None, None
        num_output = len(seq.token_ids) - seq.num_prompt_tokens
        past_min = num_output >= sp.min_tokens
        grammar = seq.grammar
        if grammar is not None and grammar.finished and token in self.eos_token_ids:
            reason = "stop"  # the grammar took the stop token where it may end: whatever ignore_eos / min_tokens say
        elif past_min and not sp.ignore_eos and token in self.eos_token_ids:
            reason = "stop"
        elif past_min and token in sp.stop_token_ids:
            reason, stop_reason = "stop", token
        if self.tokenizer is not None and sp.detokenize and (reason is None or sp.include_stop_str_in_output):
            delta = detokenize_incrementally(self.tokenizer, seq, sp.skip_special_tokens)
            hit = None
            if reason is None and past_min:
                hit = check_stop_strings(seq, len(delta), sp.stop, sp.include_stop_str_in_output)
            if hit is not None:
                reason, stop_reason = "stop", hit
        if reason is None and grammar is not None and grammar.finished:
            reason = "stop"  # the document is complete, and only a stop token may follow (or the budget closed it)
        if reason is None and seq.tokens_left(self.max_model_len) <= 0:
            reason = "length"
        if reason is not None:
            self.scheduler.finish(seq, reason)
            seq.stop_reason = stop_reason
            seq.grammar = None

    def _decode_one(self, token: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token])

    def _held(self, req: Request) -> bool:
        """stream_interval: whether a streamed request's output waits for more tokens. It goes once a sample has
        stream_interval unsent tokens, has finished with unsent ones, or has sent none yet (the first token at once,
        as vLLM's --stream-interval does); the output that goes carries every token held back."""
        for seq in req.seqs:
            unsent = seq.num_output_tokens - seq.sent_token_len
            if unsent and (unsent >= self.stream_interval or not seq.sent_token_len or seq.is_finished):
                return False
        return True

    def _make_output(self, req: Request, force: bool = False) -> EngineOutput | DeltaTuple | None:
        if req.pooling_params is not None:  # only reached on abort: no embedding
            return self._pooling_output(req, [])
        sp = req.sampling_params
        finished = req.finished
        kind = sp.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished and not force:
            return None
        if kind is RequestOutputKind.DELTA and self.stream_interval > 1 and not finished and not force \
                and self._held(req):
            return None
        holdback = max(len(s) for s in sp.stop) - 1 if sp.stop else 0
        if self.delta_tuples and kind is RequestOutputKind.DELTA and sp.logprobs is None and len(req.seqs) == 1:
            seq = req.seqs[0]  # hot: once per request and step when streaming
            text, tokens, _ = _take_delta(seq, holdback, None)
            return (req.request_id, seq.index, text, tokens, seq.finish_reason, seq.stop_reason, finished or force,
                    req.num_cached_tokens or 0, req.arrival_time, req.first_token_time)
        outs = []
        for seq in req.seqs:
            logprobs = seq.logprobs if sp.logprobs is not None else None
            if kind is RequestOutputKind.DELTA:
                text, tokens, logprobs = _take_delta(seq, holdback, logprobs)
            else:
                text, tokens = seq.text[:_shown(seq, holdback)], seq.output_token_ids
            outs.append(CompletionOutput(seq.index, text, tokens,
                                         seq.cumulative_logprob if sp.logprobs is not None else None,
                                         logprobs, seq.finish_reason, seq.stop_reason))
        metrics = {"arrival_time": req.arrival_time}
        if req.first_token_time is not None:
            metrics["first_token_time"] = req.first_token_time
        if not self.output_prompts:
            return RequestOutput(req.request_id, None, None, outs, finished or force, req.num_cached_tokens or 0,
                                 metrics)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, finished or force,
                             req.num_cached_tokens or 0, metrics)


def _shown(seq: Sequence, holdback: int) -> int:
    """How much of seq's text may be shown: all once it finished, else all but the last `holdback` characters (a stop
    string may still be forming there)."""
    if not holdback or seq.status is SequenceStatus.FINISHED:
        return len(seq.text)
    return max(0, len(seq.text) - holdback)


def _take_delta(seq: Sequence, holdback: int, logprobs: list | None) -> tuple[str, list[int], list | None]:
    """seq's text, tokens and logprobs (when given) not sent yet, marked sent."""
    first = seq.num_prompt_tokens + seq.sent_token_len
    text, tokens = seq.text[seq.sent_text_len:_shown(seq, holdback)], seq.token_ids[first:]
    logprobs = logprobs[seq.sent_token_len:] if logprobs is not None else None
    seq.sent_text_len += len(text)
    seq.sent_token_len += len(tokens)
    return text, tokens, logprobs
