"""Continuous batching: which sequences run in the next step, and with how many tokens.

``Scheduler`` is built by ``engine/`` on rank 0 (with the ``BlockManager``) and owned by
the engine thread; it never runs on other ranks. Each step the engine calls
``schedule()`` -> ``SchedulerOutput`` (built here, read by ``build_step_input`` and the
engine), runs the step on every rank, then calls ``update(out, sampled)``.

At most two steps are in flight: the overlapped engine loop schedules step N+1 while N
runs. ``schedule()`` advances ``num_computed_tokens`` at once (a scheduled token counts as
computed), and every sequence a step samples gets a placeholder token
(``core/sequence.py``), so step N+1 can give it its next decode before N's token is known;
``update(N)`` writes the real ids over the placeholders, oldest step first. While a step
is in flight nothing is preempted: a sequence that would need it is skipped and the
output says ``starved`` (the engine then runs the next step synchronously). Blocks of a
sequence that finishes or is aborted while steps that use it are in flight are freed
only after ``update()`` of the last of them (DESIGN rule 8: KV blocks are freed only
after every rank has finished the step).

Policy, per step, under the token budget ``max_num_batched_tokens`` (B) and
``max_num_seqs`` (vLLM v1's order, plus a share kept for new requests):
  1. RUNNING sequences with one token left (decodes), oldest first, one token each. They
     are never held back by a prefill: they take the budget first, and they are
     scheduled even past it (a step then has at most ``max(B, max_num_seqs)`` tokens);
  2. RUNNING sequences still catching up (chunked prefill), oldest first, up to
     ``chunk_cap`` each (``chunk_limit``, and where ``chunk_context_tokens`` is set --
     the CPU -- fewer tokens the longer the context they attend over), from what the
     decodes left. While WAITING sequences could be admitted, these chunks leave part
     of it for them (``_reserve_for_waiting``: what
     the waiting sequences ask for, at most half), so a request that arrives while a long
     prompt is being prefilled is admitted in the next step and starts its own prefill
     beside it; what the admissions do not use goes back to the running chunks;
  3. WAITING sequences FCFS, same chunk rule, admitted only if their blocks fit and only
     when nothing was preempted this step. With ``prefill_chunk_size == 0`` the whole
     uncomputed part must fit in one step, or the sequence waits. With prefix caching, a
     sequence whose next block past its cached prefix is one a running prefill has yet
     to compute waits for it (``_prefix_in_progress``: requests that arrive together
     with one new system prompt compute it once, not once each), and the queue behind
     it may go first.
So a long prompt costs each step at most B tokens of work, whatever else runs: B bounds
the time between two tokens of a decoding stream and, with the share kept for admissions,
the wait of a new request for its first token.
When a running sequence cannot get a block, the most recently admitted running sequence
(possibly itself) is preempted by recompute: its blocks (and state slot) are freed,
num_computed_tokens goes back to 0, its output tokens are kept and it re-enters at the
FRONT of the queue.

KV cache groups (``core/kv_cache_manager.py``): a sequence is admitted or given tokens
only when every group has its blocks, and a linear-attention state slot is assigned on
admission. After each step (``update``) sliding-window groups free the blocks no future
query can see, so such a group holds at most ``ceil((W - 1 + n) / bs) + 1`` blocks per
sequence given ``n`` new tokens.

Prefix caching (``core/prefix_cache.py``, when the ``KVCacheManager`` has it on): a waiting
sequence is admitted past the longest cached block-aligned prefix of its tokens (never
its last token: its logits are needed), taking those blocks by reference, so its
``num_computed_tokens`` starts at the hit and chunked prefill goes on from there; a
sequence preempted earlier hits its own freed blocks. A sequence's full blocks are
registered once their tokens are confirmed and scheduled: at admission (so a sequence
admitted later in the same step, such as another choice of the same prompt, shares
them; every backend writes a step's K/V before it attends), after the running sequences
are scheduled (never before: a preempted sequence's blocks of this step are never
computed) and in ``update`` (tokens that were placeholders).
With ``SchedulerConfig.copy_prefix_hits`` (the CPU) a sequence admitted while nothing else
runs takes fresh blocks for its hit too, as copies of the cached ones
(``SchedulerOutput.block_copies``, made by every rank before the step's forward): its
blocks are then consecutive ids, which the CPU attention reads in place instead of
gathering them every layer and step; the cached blocks stay cached. Only from blocks that
are plainly free (never by evicting one: it could be a block of the hit itself);
otherwise, and for sequences admitted beside others, the hit is shared.

A sequence that can never run (its known tokens need more blocks than the whole cache, or,
without chunking, more tokens than the step budget) is finished with reason 'length'
rather than preempted forever; the engine sees it in ``SchedulerOutput.finished``.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Dict, List, Optional, Tuple, Union

from cvllm.config import SchedulerConfig
from cvllm.core.block_manager import BlockManager
from cvllm.core.kv_cache_manager import KVCacheManager
from cvllm.core.scheduler_output import SchedulerOutput, StepDraft
from cvllm.core.sequence import Sequence, SequenceStatus


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
        self._in_flight: List[SchedulerOutput] = []
        """Steps scheduled and not yet updated, oldest first (at most two)."""
        self._deferred_free: List[Tuple[int, Sequence]] = []
        """(last in-flight step id that uses it, sequence) to free once that step is done."""
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
        """Queue a fresh sequence. Its prompt was admitted by the engine
        (``core/prompt_limits.check_prompt_length``: shorter than ``max_model_len``), the
        one place a prompt's length is checked; this checks only the scheduler's own
        bookkeeping."""
        if seq.seq_id in self._seqs:
            raise ValueError(f"seq_id {seq.seq_id} is already scheduled")
        if (seq.status is not SequenceStatus.WAITING or seq.num_computed_tokens
                or any(seq.block_ids_by_group) or seq.state_slot >= 0):
            raise ValueError(f"only a fresh WAITING sequence can be added, got {seq!r}")
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
        seq.drop_pending()
        del self._seqs[seq.seq_id]
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._finished_ids.append(seq.seq_id)
        users = [o.step_id for o in self._in_flight
                 if any(e.seq is seq for e in o.scheduled)]
        if users:
            self._deferred_free.append((max(users), seq))  # ranks may still use its blocks
        else:
            self.kv_cache_manager.free(seq)

    # ----- schedule ------------------------------------------------------------------

    @property
    def num_in_flight(self) -> int:
        """Steps scheduled whose ``update()`` has not run yet."""
        return len(self._in_flight)

    def schedule(self) -> SchedulerOutput:
        """The next step. With a step in flight (the overlapped loop) nothing is preempted
        and sequences whose in-flight token is certainly their last are left out."""
        if len(self._in_flight) >= 2:
            raise RuntimeError(
                f"schedule() called with steps {[o.step_id for o in self._in_flight]} in "
                "flight; call update() first"
            )
        step = StepDraft(budget=self.config.max_num_batched_tokens)
        self._schedule_running(step)
        if not step.preempted:
            self._schedule_waiting(step)
            self._top_up_running(step)
        finished, self._finished_ids = self._finished_ids, []
        if not step.scheduled:
            return SchedulerOutput(self._step_id, [], step.preempted, finished, step.starved)
        self._step_id += 1
        scheduled = list(step.scheduled.values())
        for row, entry in enumerate(e for e in scheduled if e.samples):
            entry.sample_index = entry.seq.append_placeholder(row)
        out = SchedulerOutput(self._step_id, scheduled, step.preempted, finished, step.starved,
                              step.block_copies)
        self._in_flight.append(out)
        return out

    def _last_token_in_flight(self, seq: Sequence) -> bool:
        """seq's pending placeholder is certainly its last token (max_tokens or
        max_model_len), so no step may be scheduled past it."""
        if not seq.num_pending_tokens:
            return False
        if seq.max_tokens is not None and seq.num_output_tokens >= seq.max_tokens:
            return True
        return seq.num_tokens >= self.config.max_model_len

    def _schedule_running(self, step: StepDraft) -> None:
        decodes = [s for s in self.running if s.num_uncomputed_tokens == 1]
        prefills = [s for s in self.running if s.num_uncomputed_tokens > 1]
        for seq in decodes:  # never held back by the budget (policy 1)
            if seq.status is SequenceStatus.RUNNING:
                self._schedule_one_running(seq, 1, step)
        reserve = self._reserve_for_waiting(max(step.budget, 0)) if prefills else 0
        step.budget -= reserve
        for seq in prefills:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted or finished earlier in this loop
            if step.budget <= 0:
                break
            self._schedule_one_running(seq, self._num_new_tokens(seq, step.budget), step)
        step.budget += reserve
        # Only now is it certain that these sequences' tokens are computed this step.
        for entry in step.scheduled.values():
            self.kv_cache_manager.cache_blocks(entry.seq)

    def _schedule_one_running(self, seq: Sequence, n: int, step: StepDraft) -> None:
        if self._last_token_in_flight(seq):
            return
        if not self._can_ever_fit(seq):
            self._finish_seq(seq, SequenceStatus.FINISHED_LENGTH)
            return
        if n == 0:
            return
        # Most decodes fit the blocks they hold: no room to make, nothing to allocate.
        if self.kv_cache_manager.needs_blocks(seq, n):
            if not self._make_room(seq, n, step):
                return
            self.kv_cache_manager.allocate(seq, n)
        step.add(seq, n)

    def _reserve_for_waiting(self, budget: int) -> int:
        """Tokens the running prefill chunks leave for admissions (policy 2): what the
        WAITING sequences that could be admitted ask for (their prompts, before any
        prefix hit), at most half of ``budget``; 0 without a free sequence slot. What the
        admissions leave (a prefix hit, blocks that do not fit) goes back to the running
        chunks in ``_top_up_running``."""
        slots = self.config.max_num_seqs - len(self.running)
        if not self.waiting or slots <= 0 or budget < 2:
            return 0
        cap, want = budget // 2, 0
        for i, seq in enumerate(self.waiting):
            if i >= slots or want >= cap:
                break
            want += min(seq.num_uncomputed_tokens, self.config.chunk_limit)
        return min(want, cap)

    def _top_up_running(self, step: StepDraft) -> None:
        """Give the budget the admissions left to the running prefill chunks that
        ``_reserve_for_waiting`` held back, oldest first, as far as free blocks go (no
        preemption for it)."""
        kv, bs = self.kv_cache_manager, self.block_manager.block_size
        for entry in list(step.scheduled.values()):
            if step.budget <= 0:
                break
            seq = entry.seq
            if entry.samples:
                continue  # a decode, or a chunk that completes its sequence's tokens
            room = self.config.chunk_cap(entry.start) - entry.num_new_tokens
            extra = min(seq.num_uncomputed_tokens, room, step.budget)
            while extra > 0 and not kv.can_allocate(seq, extra):
                extra -= (seq.num_computed_tokens + extra) % bs or bs  # one block less
            if extra <= 0:
                continue
            kv.allocate(seq, extra)
            step.extend(entry, extra)
            kv.cache_blocks(seq)

    def _schedule_waiting(self, step: StepDraft) -> None:
        kv = self.kv_cache_manager
        pending = self._pending_prefix_blocks() if self.waiting else set()
        i = 0
        while i < len(self.waiting) and step.budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[i]
            if not self._can_ever_fit(seq):
                self._finish_seq(seq, SequenceStatus.FINISHED_LENGTH)
                continue
            hit = kv.find_cached_prefix(seq)
            if pending and self._prefix_in_progress(seq, hit, pending):
                i += 1  # its next blocks are being computed: take them as a hit later
                continue
            seq.num_computed_tokens = hit.num_tokens  # the step starts right after the hit
            n = self._num_new_tokens(seq, step.budget)
            if n == 0 or not (kv.can_allocate(seq, n, hit) and kv.can_assign_state_slot(seq)):
                seq.num_computed_tokens = 0
                break  # FCFS: nobody overtakes the head of the queue
            del self.waiting[i]
            copies = None
            if self.config.copy_prefix_hits and hit.num_tokens and not self.running:
                copies = kv.allocate_copying_hit(seq, n, hit)
            if copies is None:
                kv.allocate(seq, n, hit)
            else:
                step.block_copies.extend(copies)
            kv.assign_state_slot(seq)
            kv.record_lookup(seq, hit)
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            step.add(seq, n)
            kv.cache_blocks(seq)

    def _pending_prefix_blocks(self) -> set:
        """Keys of the full blocks running prefills have yet to compute (beyond this step's
        chunks, whose blocks are registered already). Empty without prefix caching."""
        kv = self.kv_cache_manager
        if not kv.enable_caching:
            return set()
        bs, pending = kv.block_size, set()
        for seq in self.running:
            if seq.num_uncomputed_tokens > 1:
                pending.update(seq.update_block_hashes(bs)[seq.num_computed_tokens // bs:])
        return pending

    def _prefix_in_progress(self, seq: Sequence, hit, pending: set) -> bool:
        """seq's first block past its cached prefix is one a running prefill is computing:
        admitting it now would compute the same blocks a second time (N requests with one
        new system prompt would compute it N times, each at 1/N of the step budget).
        It waits, and is admitted with those blocks as a hit once they are computed; later
        requests may go first meanwhile (they cannot use what it would compute either)."""
        hashes = seq.block_hashes
        k = hit.num_tokens // self.kv_cache_manager.block_size
        return k < len(hashes) and hashes[k] in pending

    def _num_new_tokens(self, seq: Sequence, budget: int) -> int:
        remaining = seq.num_uncomputed_tokens
        if remaining < 1:
            raise RuntimeError(f"{seq!r} has no token left to compute")
        n = min(remaining, self.config.chunk_cap(seq.num_computed_tokens), budget)
        if self.config.prefill_chunk_size == 0 and n < remaining:
            return 0  # chunking disabled: all or nothing
        return n

    def _can_ever_fit(self, seq: Sequence) -> bool:
        max_chunk = min(self.config.chunk_limit, self.config.max_num_batched_tokens)
        if not self.kv_cache_manager.can_ever_fit(seq, max_chunk):
            return False
        no_chunking = self.config.prefill_chunk_size == 0
        return not (no_chunking and seq.num_uncomputed_tokens > self.config.max_num_batched_tokens)

    def _make_room(self, seq: Sequence, n: int, step: StepDraft) -> bool:
        """Preempt the newest running sequences until seq gets its blocks.

        Returns False when seq itself had to be preempted, or when a preemption was
        needed while a step is in flight (then ``step.starved``).
        """
        if self._in_flight and not self.kv_cache_manager.can_allocate(seq, n):
            step.starved = True
            return False
        while not self.kv_cache_manager.can_allocate(seq, n):
            victim = self.running[-1]
            self._preempt(victim, step)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, step: StepDraft) -> None:
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
        """Apply the oldest step in flight: write its sampled tokens over their
        placeholders, finish sequences that stop, free blocks no step uses any more.

        Returns the sequences that finished in this update.
        """
        if out.is_empty:
            return []
        self._check_update(out, sampled)
        self._in_flight.pop(0)
        finished: List[Sequence] = []
        for entry in out.scheduled:
            seq = entry.seq
            if seq.is_finished():
                continue  # aborted or finished while the step was in flight
            if entry.samples:
                seq.resolve_placeholder(entry.sample_index, sampled[seq.seq_id])
            # A resolved token may complete a block whose K/V a launched step computes.
            self.kv_cache_manager.cache_blocks(seq)
            # This step is done on every rank, so out-of-window blocks can go (rule 8);
            # a later step in flight never reads them (it only looks further on).
            self.kv_cache_manager.remove_out_of_window_blocks(seq)
            if not entry.samples:
                continue
            status, stop_reason = seq.stop_status(entry.sample_index, self.config.max_model_len)
            if status is not None:
                self._finish_seq(seq, status, stop_reason)
                finished.append(seq)
        self._free_deferred(out.step_id)
        return finished

    def _check_update(self, out: SchedulerOutput, sampled: Dict[int, int]) -> None:
        """``out`` is the oldest step in flight, and ``sampled`` has a token for each
        sequence it samples that is still unfinished."""
        oldest = self._in_flight[0].step_id if self._in_flight else None
        if out.step_id != oldest:
            raise RuntimeError(
                f"update() for step {out.step_id}, but the oldest step in flight is {oldest}"
            )
        missing = [e.seq.seq_id for e in out.scheduled
                   if e.samples and not e.seq.is_finished() and e.seq.seq_id not in sampled]
        if missing:
            raise ValueError(
                f"update() of step {out.step_id}: no sampled token for seq_ids {missing}"
            )

    def _free_deferred(self, step_id: int) -> None:
        """Free the finished sequences whose last step in flight was ``step_id`` or older."""
        done = [seq for last, seq in self._deferred_free if last <= step_id]
        self._deferred_free = [(last, seq) for last, seq in self._deferred_free
                               if last > step_id]
        for seq in done:
            self.kv_cache_manager.free(seq)
