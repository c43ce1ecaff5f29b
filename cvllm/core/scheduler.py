"""Continuous batching: which sequences run in the next step, and with how many tokens.

``Scheduler`` is built by ``engine/`` on rank 0 (with the ``BlockManager``) and owned by
the engine thread; it never runs on other ranks. Each step the engine calls
``schedule()`` -> ``SchedulerOutput`` (built here, read by ``build_step_input`` and the
engine), runs the step on every rank, then calls ``update(out, sampled)``. The two
alternate: ``schedule()`` refuses to run while a step is in flight, and blocks of a
sequence aborted or finished while its step is in flight are freed only in ``update()``
(DESIGN rule 8: KV blocks are freed only after every rank has finished the step).

Policy, per step, under ``max_num_batched_tokens`` and ``max_num_seqs``:
  1. RUNNING sequences with one token left (decodes), oldest first;
  2. RUNNING sequences still catching up (chunked prefill), up to ``chunk_limit`` each;
  3. WAITING sequences FCFS, same chunk rule, admitted only if their blocks fit and only
     when nothing was preempted this step. With ``prefill_chunk_size == 0`` the whole
     uncomputed part must fit in one step, or the sequence waits.
When a running sequence cannot get a block, the most recently admitted running sequence
(possibly itself) is preempted by recompute: its blocks (and state slot) are freed,
num_computed_tokens goes back to 0, its output tokens are kept and it re-enters at the
FRONT of the queue.

KV cache groups (``core/kv_cache_manager.py``): a sequence is admitted or given tokens
only when every group has its blocks, and a linear-attention state slot is assigned on
admission. After each step (``update``) sliding-window groups free the blocks no future
query can see, so such a group holds at most ``ceil((W - 1 + n) / bs) + 1`` blocks per
sequence given ``n`` new tokens.

A sequence that can never run (its known tokens need more blocks than the whole cache, or,
without chunking, more tokens than the step budget) is finished with reason 'length'
rather than preempted forever; the engine sees it in ``SchedulerOutput.finished``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple, Union

from cvllm.config import SchedulerConfig
from cvllm.core.block_manager import BlockManager
from cvllm.core.kv_cache_manager import KVCacheManager
from cvllm.core.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    """Tokens computed for this sequence in this step (from seq.num_computed_tokens on)."""
    samples: bool
    """This step completes the sequence's known tokens, so its last logits are sampled."""


@dataclass
class SchedulerOutput:
    step_id: int
    """Increments with every output that has work; an empty output repeats the last id."""
    scheduled: List[ScheduledSeq] = field(default_factory=list)
    """Decodes first, then prefill chunks (running, then newly admitted)."""
    preempted: List[int] = field(default_factory=list)
    """seq_ids preempted (by recompute) while building this step."""
    finished: List[int] = field(default_factory=list)
    """seq_ids that left the scheduler since the previous output, by any path (update,
    abort, finish, or finished here because they can never fit)."""

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_seqs(self) -> int:
        return len(self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class _StepBuilder:
    budget: int
    scheduled: Dict[int, ScheduledSeq] = field(default_factory=dict)  # insertion-ordered
    preempted: List[int] = field(default_factory=list)

    def add(self, seq: Sequence, n: int) -> None:
        samples = seq.num_computed_tokens + n == seq.num_tokens
        self.scheduled[seq.seq_id] = ScheduledSeq(seq, n, samples)
        self.budget -= n


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, block_manager: Union[BlockManager, KVCacheManager]
    ) -> None:
        """``block_manager``: a ``KVCacheManager`` (every group), or one ``BlockManager``
        for a model with a single group and no state layers."""
        self.config = config
        if isinstance(block_manager, BlockManager):
            block_manager = KVCacheManager([block_manager])
        self.kv_cache_manager = block_manager
        self.block_manager = block_manager.groups[0]
        """Group 0's block manager (the only one of most models)."""
        self.waiting: deque[Sequence] = deque()
        self.running: List[Sequence] = []
        """In admission order: the last one is the first to be preempted."""
        self.num_preemptions_total = 0
        self._step_id = 0
        self._seqs: Dict[int, Sequence] = {}  # every unfinished sequence, by seq_id
        self._in_flight: Optional[SchedulerOutput] = None
        self._in_flight_ids: set[int] = set()
        self._deferred_free: List[Sequence] = []
        self._finished_ids: List[int] = []

    # ----- queries -------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def step_id(self) -> int:
        """The id of the last step with work (0 before the first)."""
        return self._step_id

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    def get_seq(self, seq_id: int) -> Optional[Sequence]:
        return self._seqs.get(seq_id)

    # ----- requests in and out -------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        if seq.seq_id in self._seqs:
            raise ValueError(f"seq_id {seq.seq_id} is already scheduled")
        if (seq.status is not SequenceStatus.WAITING or seq.num_computed_tokens
                or any(seq.block_ids_by_group) or seq.state_slot >= 0):
            raise ValueError(f"only a fresh WAITING sequence can be added, got {seq!r}")
        if seq.num_tokens > self.config.max_model_len:
            raise ValueError(
                f"sequence {seq.seq_id} has {seq.num_tokens} tokens, more than "
                f"max_model_len={self.config.max_model_len}"
            )
        self._seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def abort(self, request_id: str) -> List[Sequence]:
        """Finish every unfinished sequence of request_id with reason 'abort'."""
        seqs = [s for s in self._seqs.values() if s.request_id == request_id]
        for seq in seqs:
            self._finish_seq(seq, SequenceStatus.FINISHED_ABORTED)
        return seqs

    def finish(
        self, key: Union[int, str], reason: str, stop_reason: Optional[Union[int, str]] = None
    ) -> List[Sequence]:
        """Finish by seq_id (int) or request_id (str); the engine's stop-string path.

        Unknown or already finished sequences are ignored (returns []).
        """
        status = SequenceStatus.from_finish_reason(reason)
        if isinstance(key, str):
            seqs = [s for s in self._seqs.values() if s.request_id == key]
        else:
            seqs = [self._seqs[key]] if key in self._seqs else []
        for seq in seqs:
            self._finish_seq(seq, status, stop_reason)
        return seqs

    def _finish_seq(
        self, seq: Sequence, status: SequenceStatus, stop_reason: Optional[Union[int, str]] = None
    ) -> None:
        seq.set_finished(status, stop_reason)
        del self._seqs[seq.seq_id]
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._finished_ids.append(seq.seq_id)
        if seq.seq_id in self._in_flight_ids:
            self._deferred_free.append(seq)  # other ranks may still be writing its blocks
        else:
            self.kv_cache_manager.free(seq)

    # ----- schedule ------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        if self._in_flight is not None:
            raise RuntimeError(
                f"schedule() called while step {self._in_flight.step_id} is in flight; "
                "call update() first"
            )
        step = _StepBuilder(budget=self.config.max_num_batched_tokens)
        self._schedule_running(step)
        if not step.preempted:
            self._schedule_waiting(step)
        finished, self._finished_ids = self._finished_ids, []
        if not step.scheduled:
            return SchedulerOutput(self._step_id, [], step.preempted, finished)
        self._step_id += 1
        scheduled = list(step.scheduled.values())
        out = SchedulerOutput(self._step_id, scheduled, step.preempted, finished)
        self._in_flight = out
        self._in_flight_ids = set(step.scheduled)
        return out

    def _schedule_running(self, step: _StepBuilder) -> None:
        decodes = [s for s in self.running if s.num_uncomputed_tokens == 1]
        prefills = [s for s in self.running if s.num_uncomputed_tokens > 1]
        for seq in decodes + prefills:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted or finished earlier in this loop
            if step.budget <= 0:
                break
            if not self._can_ever_fit(seq):
                self._finish_seq(seq, SequenceStatus.FINISHED_LENGTH)
                continue
            n = self._num_new_tokens(seq, step.budget)
            if n == 0 or not self._make_room(seq, n, step):
                continue
            self.kv_cache_manager.allocate(seq, n)
            step.add(seq, n)

    def _schedule_waiting(self, step: _StepBuilder) -> None:
        while self.waiting and step.budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self._can_ever_fit(seq):
                self._finish_seq(seq, SequenceStatus.FINISHED_LENGTH)
                continue
            n = self._num_new_tokens(seq, step.budget)
            kv = self.kv_cache_manager
            if n == 0 or not (kv.can_allocate(seq, n) and kv.can_assign_state_slot(seq)):
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            kv.allocate(seq, n)
            kv.assign_state_slot(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            step.add(seq, n)

    def _num_new_tokens(self, seq: Sequence, budget: int) -> int:
        remaining = seq.num_uncomputed_tokens
        if remaining < 1:
            raise RuntimeError(f"{seq!r} has no token left to compute")
        n = min(remaining, self.config.chunk_limit, budget)
        if self.config.prefill_chunk_size == 0 and n < remaining:
            return 0  # chunking disabled: all or nothing
        return n

    def _can_ever_fit(self, seq: Sequence) -> bool:
        max_chunk = min(self.config.chunk_limit, self.config.max_num_batched_tokens)
        if not self.kv_cache_manager.can_ever_fit(seq, max_chunk):
            return False
        no_chunking = self.config.prefill_chunk_size == 0
        return not (no_chunking and seq.num_uncomputed_tokens > self.config.max_num_batched_tokens)

    def _make_room(self, seq: Sequence, n: int, step: _StepBuilder) -> bool:
        """Preempt the newest running sequences until seq gets its blocks.

        Returns False when seq itself had to be preempted.
        """
        while not self.kv_cache_manager.can_allocate(seq, n):
            victim = self.running[-1]
            self._preempt(victim, step)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, step: _StepBuilder) -> None:
        entry = step.scheduled.pop(seq.seq_id, None)
        if entry is not None:  # already given tokens in this step: take them back
            step.budget += entry.num_new_tokens
        self.running.remove(seq)
        self.kv_cache_manager.free(seq)  # blocks and state slot: recompute starts afresh
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(seq)
        step.preempted.append(seq.seq_id)

    # ----- update --------------------------------------------------------------------

    def update(self, out: SchedulerOutput, sampled: Dict[int, int]) -> List[Sequence]:
        """Apply a finished step: advance, append sampled tokens, finish, free blocks.

        Returns the sequences that finished in this update (their blocks are freed).
        """
        if out.is_empty:
            return []
        if self._in_flight is None or out.step_id != self._in_flight.step_id:
            in_flight = self._in_flight.step_id if self._in_flight else None
            raise RuntimeError(
                f"update() for step {out.step_id}, but the step in flight is {in_flight}"
            )
        missing = [e.seq.seq_id for e in out.scheduled
                   if e.samples and not e.seq.is_finished() and e.seq.seq_id not in sampled]
        if missing:
            raise ValueError(
                f"update() of step {out.step_id}: no sampled token for seq_ids {missing}"
            )
        finished: List[Sequence] = []
        for entry in out.scheduled:
            seq = entry.seq
            if seq.is_finished():
                continue  # aborted or finished while the step was in flight
            seq.num_computed_tokens += entry.num_new_tokens
            # Every rank is done with this step, so out-of-window blocks can go (rule 8).
            self.kv_cache_manager.remove_out_of_window_blocks(seq)
            if not entry.samples:
                continue
            seq.append_token(sampled[seq.seq_id])
            status, stop_reason = self._check_stop(seq)
            if status is not None:
                self._finish_seq(seq, status, stop_reason)
                finished.append(seq)
        self._in_flight, self._in_flight_ids = None, set()
        for seq in self._deferred_free:
            self.kv_cache_manager.free(seq)
        self._deferred_free = []
        return finished

    def _check_stop(self, seq: Sequence) -> Tuple[Optional[SequenceStatus], Optional[int]]:
        """Why seq stops after its newest token, if it does.

        EOS and stop tokens count only once ``min_tokens`` tokens were generated before
        them (vLLM's semantics: the stop token itself is not one of the min_tokens).
        """
        params, token = seq.params, seq.last_token_id
        if seq.num_output_tokens - 1 >= params.min_tokens:
            if not params.ignore_eos and token in seq.eos_token_ids:
                return SequenceStatus.FINISHED_STOPPED, None
            if token in params.stop_token_ids:
                return SequenceStatus.FINISHED_STOPPED, token
        if seq.max_tokens is not None and seq.num_output_tokens >= seq.max_tokens:
            return SequenceStatus.FINISHED_LENGTH, None
        if seq.num_tokens >= self.config.max_model_len:
            return SequenceStatus.FINISHED_LENGTH, None
        return None, None
