"""The synchronous engine: one ``step()`` schedules, runs the model and detokenizes.

Built once on rank 0 by ``cli.py`` (serve/generate) or by the offline ``LLM`` class; owned
by whichever thread drives ``step()`` (the ``AsyncEngine`` loop thread when serving). It
owns the scheduler, the per-request detokenizers and the metrics; the ``ModelRunner`` it
drives owns the model and the KV cache.

The loop is overlapped (``docs/adr/overlapped-engine-loop.md``): ``step()`` launches step
N+1 -- schedule, build the ``StepInput``, ``runner.launch`` (H2D copies, the forward, a
CUDA graph replay for a padded decode step, the sampler and the one device-to-host copy,
all without a host sync) -- while step N still runs on the device, and only then waits
for N's sampled ids, updates the scheduler and detokenizes N. Step N+1's inputs that
are N's tokens are placeholders the runner fills in on the device (and adds to the
penalty counts there). The loop falls back to one step at a time when the runner has no
``launch``, when ``overlap`` is off, or when the scheduler could not give every sequence
its blocks without a preemption (``SchedulerOutput.starved``).

Structured output (``engine/structured.py``): a constrained row's bitmask needs the token
its sequence is sampling in the step in flight, so a step with constrained rows launched
in the overlapped loop defers its sampler (``runner.launch(..., defer_sampling=True)``):
its forward runs on the device while the host waits for step N, feeds N's tokens to the
grammars and fills the masks; then the sampler is launched.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from cvllm.config import EngineConfig
from cvllm.core.kv_cache_manager import KVCacheLayout, KVCacheManager
from cvllm.core.prompt_limits import check_prompt_length
from cvllm.core.sampling_batch import build_sampling_batch
from cvllm.core.scheduler import Scheduler
from cvllm.core.scheduler_output import SchedulerOutput
from cvllm.core.sequence import Sequence
from cvllm.core.step_builder import build_step_input
from cvllm.engine.detokenizer import IncrementalDetokenizer
from cvllm.engine.structured import GrammarState
from cvllm.engine.tokenizer import Tokenizer
from cvllm.outputs import EngineMetrics, LatencyHistograms, RequestOutput, TokenLogprob
from cvllm.sampling_params import SamplingParams

logger = logging.getLogger("cvllm.engine")

INTERNAL_REQUEST_PREFIX = "__cvllm_"
"""Request ids of the engine's own requests (the server's warm-up), which the latency
histograms leave out."""


@dataclass
class _InFlight:
    """A launched step: its schedule, its sampling rows' sequences, the runner's handle."""

    out: SchedulerOutput
    sampling_seqs: List[Sequence]
    handle: object  # has .result() -> StepResult | None
    deferred: bool = False
    """The handle is the runner's ``DeferredSampling``: its sampler is not launched yet."""


@dataclass
class _Request:
    seq: Sequence
    detok: IncrementalDetokenizer
    num_emitted_tokens: int = 0
    pending_logprobs: List[TokenLogprob] = field(default_factory=list)
    last_token_time: Optional[float] = None
    """When the latest output with generated tokens was made (None before the first)."""
    timed: bool = True
    """Counted in the latency histograms (not the server's internal warm-up request)."""


class LLMEngine:
    """Rank 0's engine. ``runner`` is anything with ``execute(step, sampling)`` (a
    ``SamplingBatch``) returning the sampled ids (and logprobs) for the step's sampling
    rows, plus ``kv_layout`` (a
    ``KVCacheLayout``) or, for one full-attention group, just ``num_blocks``."""

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, runner, overlap: bool = True):
        self.config = config
        self.tokenizer = tokenizer
        self.runner = runner
        self.block_size = config.cache.block_size
        layout = getattr(runner, "kv_layout", None) or KVCacheLayout.single(
            runner.num_blocks, self.block_size
        )
        if layout.block_size != self.block_size:
            raise ValueError(f"runner's block size {layout.block_size} != {self.block_size}")
        self.kv_layout = layout
        self.kv_cache_manager = KVCacheManager.from_layout(
            layout, enable_caching=self._prefix_caching(config, layout),
            max_cached_tokens=config.cache.prefix_cache_max_tokens)
        self.block_manager = self.kv_cache_manager.groups[0]
        """KV group 0's blocks (the only group of most models)."""
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager)
        self.requests: Dict[str, _Request] = {}
        self._seq_ids = itertools.count()
        self._request_of: Dict[int, str] = {}
        self.eos_token_ids = list(config.model.eos_token_ids)
        self.stats = Counter()
        self.finished_by_reason: Counter = Counter()
        self.latency = LatencyHistograms()
        """TTFT, inter-token, end-to-end and queue time of requests (``/metrics``)."""
        self.overlap = overlap and hasattr(runner, "launch")
        """Launch step N+1 before waiting for step N (needs ``runner.launch``)."""
        self._deferred_sampling = self.overlap and bool(getattr(runner, "deferred_sampling", False))
        """The runner can launch a forward and its sampler apart (``defer_sampling``)."""
        self._in_flight: Optional[_InFlight] = None
        self.grammar = GrammarState(tokenizer.hf, config.model.vocab_size, self.eos_token_ids)
        """Structured-output matchers of the constrained requests (compiler built lazily)."""

    @staticmethod
    def _prefix_caching(config: EngineConfig, layout: KVCacheLayout) -> bool:
        """Prefix caching as configured, except for models with linear-attention state
        layers: a hit would need each layer's state at the block boundary, which cvllm
        does not snapshot, so they recompute every prompt."""
        if not config.cache.enable_prefix_caching:
            return False
        if layout.num_state_slots:
            logger.info("prefix caching is off for %s: its linear-attention layers keep a "
                        "per-sequence state that cached KV blocks cannot restore",
                        config.model.architecture)
            return False
        return True

    # ---------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt_token_ids: List[int], params: SamplingParams) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        check_prompt_length(len(prompt_token_ids), self.config.model.max_model_len)
        vocab = self.config.model.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")
        seq = Sequence(next(self._seq_ids), request_id, [int(t) for t in prompt_token_ids], params,
                       eos_token_ids=self.eos_token_ids, arrival_time=time.monotonic())
        seq.max_tokens = params.max_tokens
        self.grammar.add(seq)  # compiles (cached); a bad constraint raises before anything is kept
        detok = IncrementalDetokenizer(self.tokenizer.hf, seq.prompt_token_ids,
                                       skip_special_tokens=params.skip_special_tokens, stop=params.stop)
        self.requests[request_id] = _Request(
            seq, detok, timed=not request_id.startswith(INTERNAL_REQUEST_PREFIX))
        self._request_of[seq.seq_id] = request_id
        self.scheduler.add(seq)
        self.stats["prompt_tokens"] += len(prompt_token_ids)

    def abort_request(self, request_id: str) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self._request_of.pop(req.seq.seq_id, None)
        self.grammar.remove(req.seq.seq_id)
        self.scheduler.abort(request_id)
        self.finished_by_reason["abort"] += 1
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # ---------------------------------------------------------------- step
    def step(self) -> List[RequestOutput]:
        """Advance by one step: the outputs of the step that completed (and of sequences
        the scheduler ended). In the overlapped loop the next step is already running."""
        outputs: List[RequestOutput] = []
        if self._in_flight is None:
            self._in_flight = self._launch_next(outputs, overlapped=False)
            if self._in_flight is None:
                return outputs
        current, self._in_flight = self._in_flight, None
        if self._can_overlap(current):
            self._in_flight = self._launch_next(outputs, overlapped=True)
        result = self._apply(current)
        if self._in_flight is not None and self._in_flight.deferred:
            # the next step's forward runs meanwhile; its sampler waited for these masks
            self._sample_deferred(self._in_flight)
        return outputs + self._make_outputs(current.out, current.sampling_seqs, result)

    def _launch_next(self, outputs: List[RequestOutput], overlapped: bool) -> Optional[_InFlight]:
        out = self.scheduler.schedule()
        # The scheduler may end a sequence that can never fit (reason 'length').
        outputs.extend(self._scheduler_finished(out.finished))
        if not out.scheduled:
            return None
        step = build_step_input(out, self.block_size, self.kv_layout.windows)
        sampling_seqs = [s.seq for s in out.scheduled if s.samples]
        sampling = build_sampling_batch(sampling_seqs)
        # Launched before the step in flight is done, a constrained row's grammar has not
        # seen its last token yet: its mask is filled once that token is in.
        defer = overlapped and self.grammar.any_constrained(sampling_seqs)
        if not defer:
            self.grammar.fill(sampling, sampling_seqs)
        if defer:
            handle = self.runner.launch(step, sampling, defer_sampling=True)
        elif self.overlap:
            handle = self.runner.launch(step, sampling)
        else:
            handle = _Done(self.runner.execute(step, sampling))
        return _InFlight(out, sampling_seqs, handle, deferred=defer)

    def _sample_deferred(self, launched: _InFlight) -> None:
        self.grammar.fill(launched.handle.sampling, launched.sampling_seqs)
        launched.handle = launched.handle.sample()
        launched.deferred = False

    def _can_overlap(self, current: _InFlight) -> bool:
        # A constrained row's next bitmask needs the token this step is sampling: with a
        # runner that can defer sampling, the next forward still overlaps (the mask is
        # filled while it runs); without, the loop waits.
        return (self.overlap and not current.out.starved
                and (self._deferred_sampling or not self.grammar.any_constrained(current.sampling_seqs)))

    def _apply(self, current: _InFlight):
        """Wait for a launched step's ids and apply them (scheduler, grammars); returns the
        runner's result for ``_make_outputs``."""
        result = current.handle.result()
        # A step of prefill chunks only samples nothing; the runner then returns None.
        tokens = result.token_ids if result is not None else []
        sampled = {seq.seq_id: int(tok) for seq, tok in zip(current.sampling_seqs, tokens)}
        self.scheduler.update(current.out, sampled)
        self._advance_grammars(current.sampling_seqs, sampled)
        self.stats["steps"] += 1
        self.stats["generation_tokens"] += len(sampled)
        return result

    def _advance_grammars(self, seqs: List[Sequence], sampled: Dict[int, int]) -> None:
        """Feed each constrained sequence its new token; a completed grammar ends it."""
        if not self.grammar.any_constrained(seqs):
            return
        for seq in seqs:
            if seq.is_finished() or seq.seq_id not in sampled:
                continue
            why = self.grammar.accept(seq, sampled[seq.seq_id])
            if why is not None:
                self.scheduler.finish(seq.seq_id, "stop", None)

    def _scheduler_finished(self, seq_ids: List[int]) -> List[RequestOutput]:
        outputs = []
        for seq_id in seq_ids:
            req = self.requests.get(self._request_of.get(seq_id, ""))
            if req is not None and req.seq.seq_id == seq_id and req.seq.is_finished():
                outputs.append(self._advance_request(req))
        return outputs

    def _make_outputs(self, out: SchedulerOutput, sampling_seqs: List[Sequence], result) -> List[RequestOutput]:
        outputs = []
        for row, seq in enumerate(sampling_seqs):
            req = self.requests.get(seq.request_id)
            if req is None:  # aborted while the step ran
                continue
            if result.logprobs is not None:
                req.pending_logprobs.append(self._token_logprob(result, row))
            outputs.append(self._advance_request(req))
        return outputs

    def _advance_request(self, req: _Request) -> RequestOutput:
        seq = req.seq
        new_ids = seq.confirmed_output_token_ids_from(req.num_emitted_tokens)  # a fresh list
        req.num_emitted_tokens += len(new_ids)
        finished = seq.is_finished()
        text_ids = new_ids
        if finished and isinstance(seq.stop_reason, int):
            text_ids = new_ids[:-1]  # EOS / stop token: counted in usage, never shown as text
        if new_ids and req.timed:
            self._observe_tokens(req)
        res = req.detok.push(text_ids)
        delta = res.delta_text
        if res.stop_hit is not None and not finished:
            self.scheduler.finish(seq.seq_id, "stop", res.stop_hit)
            finished = seq.is_finished()
        if finished:
            if res.stop_hit is None:
                delta += req.detok.flush()
            self._retire(req)
        logprobs, req.pending_logprobs = req.pending_logprobs, []
        return RequestOutput(
            request_id=seq.request_id, delta_text=delta, delta_token_ids=new_ids,
            num_prompt_tokens=seq.num_prompt_tokens, num_output_tokens=req.num_emitted_tokens,
            finished=finished, finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason, logprobs=logprobs,
            num_cached_tokens=seq.num_cached_tokens,
        )

    def _retire(self, req: _Request) -> None:
        seq = req.seq
        self.grammar.remove(seq.seq_id)
        self.requests.pop(seq.request_id, None)
        self._request_of.pop(seq.seq_id, None)
        self.finished_by_reason[seq.finish_reason or "stop"] += 1
        if not req.timed:
            return
        self.latency.e2e_request_latency.observe(time.monotonic() - seq.arrival_time)
        if seq.first_scheduled_time is not None:
            self.latency.request_queue_time.observe(seq.first_scheduled_time - seq.arrival_time)

    def _observe_tokens(self, req: _Request) -> None:
        """An output of req carries generated tokens: its TTFT, or one inter-token gap."""
        now = time.monotonic()
        if req.last_token_time is None:
            self.latency.time_to_first_token.observe(now - req.seq.arrival_time)
        else:
            self.latency.inter_token_latency.observe(now - req.last_token_time)
        req.last_token_time = now

    def _token_logprob(self, result, row: int) -> TokenLogprob:
        tok = int(result.token_ids[row])
        top, top_ids = {}, {}
        if result.top_ids is not None:
            for tid, lp in zip(result.top_ids[row], result.top_logprobs[row]):
                top[self.tokenizer.decode([int(tid)], skip_special_tokens=False)] = float(lp)
                top_ids[int(tid)] = float(lp)
        return TokenLogprob(token_id=tok, token=self.tokenizer.decode([tok], skip_special_tokens=False),
                            logprob=float(result.logprobs[row]), top=top, top_ids=top_ids)

    # ---------------------------------------------------------------- metrics
    def metrics(self) -> EngineMetrics:
        return EngineMetrics(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_blocks_total=sum(g.num_total_blocks for g in self.kv_cache_manager.groups),
            kv_blocks_free=sum(g.num_free_blocks for g in self.kv_cache_manager.groups),
            kv_blocks_cached=self.kv_cache_manager.num_cached_free_blocks,
            prefix_cache_queries_total=self.kv_cache_manager.prefix_cache_stats.queries,
            prefix_cache_hits_total=self.kv_cache_manager.prefix_cache_stats.hits,
            prompt_tokens_total=self.stats["prompt_tokens"],
            generation_tokens_total=self.stats["generation_tokens"],
            num_preemptions_total=self.scheduler.num_preemptions_total,
            steps_total=self.stats["steps"],
            requests_finished=dict(self.finished_by_reason),
            latency=self.latency.copy(),
        )


class _Done:
    """A step run synchronously (``runner.execute``), with the ``launch`` handle's API."""

    def __init__(self, result):
        self._result = result

    def result(self):
        return self._result

