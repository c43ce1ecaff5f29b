"""What one scheduled step is: ``SchedulerOutput`` and its ``ScheduledSeq`` entries, and
``StepDraft``, the step while ``Scheduler.schedule()`` builds it.

Built on rank 0 by ``core/scheduler.py``; read by ``build_step_input``
(``core/step_builder.py``) and by the engine, which hands the output back to
``Scheduler.update()`` once the step ran on every rank. Never sent to other ranks: they
see only the ``StepInput`` built from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from cvllm.core.sequence import Sequence


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    """Tokens computed for this sequence in this step (from seq.num_computed_tokens on)."""
    samples: bool
    """This step completes the sequence's known tokens, so its last logits are sampled."""
    start: Optional[int] = None
    """The sequence's ``num_computed_tokens`` before this step: its first new position
    (None: its ``num_computed_tokens`` now, for outputs built by hand)."""
    prev_row: int = -1
    """When the first new token is a placeholder: the sampling row of the step in flight
    that samples it (the runner patches it in on the device); else -1."""
    sample_index: int = -1
    """Where this step's sampled token goes in ``seq.token_ids`` (a placeholder until
    ``update``); -1 when the step does not sample the sequence."""

    def __post_init__(self) -> None:
        if self.start is None:
            self.start = self.seq.num_computed_tokens


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
    starved: bool = False
    """A running sequence was skipped because it needed a preemption while another step
    was in flight; the next step should be scheduled with nothing in flight."""
    block_copies: List[Tuple[int, int]] = field(default_factory=list)
    """(src, dst) blocks of KV group 0 whose K/V every rank copies before this step's
    forward (``copy_prefix_hits``)."""

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
class StepDraft:
    """One step while ``Scheduler.schedule()`` builds it: the token budget left and what
    is scheduled, preempted and copied so far."""

    budget: int
    scheduled: Dict[int, ScheduledSeq] = field(default_factory=dict)  # insertion-ordered
    preempted: List[int] = field(default_factory=list)
    block_copies: List[Tuple[int, int]] = field(default_factory=list)

    starved: bool = False

    def add(self, seq: Sequence, n: int) -> None:
        start = seq.num_computed_tokens
        samples = start + n == seq.num_tokens
        prev_row = seq.last_sample_row if seq.num_pending_tokens else -1
        self.scheduled[seq.seq_id] = ScheduledSeq(seq, n, samples, start, prev_row)
        seq.num_computed_tokens += n  # counted as computed from now on
        self.budget -= n

    def extend(self, entry: ScheduledSeq, n: int) -> None:
        """``n`` more tokens for a sequence already in this step, right after its own."""
        seq = entry.seq
        entry.num_new_tokens += n
        entry.samples = entry.start + entry.num_new_tokens == seq.num_tokens
        seq.num_computed_tokens += n
        self.budget -= n
