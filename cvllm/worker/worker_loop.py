"""The loop of every rank but 0: run the steps rank 0 broadcasts, in order, until SHUTDOWN.

Built by ``runtime/spmd.py`` on each rank != 0 after ``init_distributed``; the rank's
``ModelRunner`` (its weight shard and KV cache) is owned by this loop for the life of the
process. DESIGN rule 8: a worker decides nothing. It receives a message, checks that a
STEP's ``step_id`` follows the previous one, and runs the same forward as rank 0 (the
LM head's all-gather included; the runner samples only on rank 0). HEARTBEATs only prove
that rank 0 is alive; no message at all for ``idle_timeout_s`` means rank 0 is gone and
the worker fails (the caller turns a failure into a job abort: ``runtime/spmd.py``).

Fault injection for tests (documented in docs/distributed.md):
``CVLLM_FAULT_INJECT="rank=1,step=5"`` raises ``InjectedFault`` on rank 1 just before it
runs step 5 (rank 0 checks it in its runner wrapper too).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from cvllm.core.step_input import StepInput
from cvllm.core.wire_format import MessageKind, StepInputError

logger = logging.getLogger("cvllm.worker")

FAULT_ENV = "CVLLM_FAULT_INJECT"
DEFAULT_IDLE_TIMEOUT_S = 10.0
"""A worker that hears nothing (not even a HEARTBEAT) from rank 0 this long exits."""


class InjectedFault(RuntimeError):
    """Raised on purpose by ``CVLLM_FAULT_INJECT`` (tests of the fault paths)."""


class WorkerError(RuntimeError):
    """This worker cannot go on (rank 0 vanished, aborted, or sent an out-of-order step)."""


@dataclass(frozen=True)
class FaultInjector:
    """``rank=R,step=S``: rank R raises just before running step S. Unset: never."""

    rank: Optional[int] = None
    step: Optional[int] = None

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "FaultInjector":
        text = (os.environ if environ is None else environ).get(FAULT_ENV, "").strip()
        if not text:
            return cls()
        fields = {}
        for part in text.split(","):
            key, sep, value = part.partition("=")
            if not sep or key.strip() not in ("rank", "step") or not value.strip().isdigit():
                raise ValueError(f"{FAULT_ENV}={text!r}: expected 'rank=R,step=S'")
            fields[key.strip()] = int(value)
        if set(fields) != {"rank", "step"}:
            raise ValueError(f"{FAULT_ENV}={text!r}: expected 'rank=R,step=S'")
        return cls(fields["rank"], fields["step"])

    def check(self, rank: int, step_id: int) -> None:
        if self.rank == rank and self.step == step_id:
            raise InjectedFault(f"{FAULT_ENV}: fault injected on rank {rank} at step {step_id}")


def run_worker(env, config, source, control, *, idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
               stop_requested: Optional[Callable[[], bool]] = None) -> int:
    """Build this rank's ModelRunner (its shard, its KV cache) and serve rank 0's steps;
    returns 0 after SHUTDOWN."""
    from cvllm.worker.model_runner import ModelRunner

    from cvllm.utils.gc_freeze import freeze_startup_objects

    runner = ModelRunner(config, source, env.rank)
    freeze_startup_objects()  # the model's objects live as long as the rank
    logger.info("rank %d ready: %d KV blocks", env.rank, runner.num_blocks)
    return serve_steps(runner, control, env.rank, idle_timeout_s=idle_timeout_s,
                       stop_requested=stop_requested)


def serve_steps(runner, control, rank: int, *, idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
                fault: Optional[FaultInjector] = None,
                stop_requested: Optional[Callable[[], bool]] = None) -> int:
    """The loop proper (``runner``: anything with ``execute(step, sampling)``). Returns 0 on
    SHUTDOWN; raises ``WorkerError`` (rank 0 silent, ABORT, a step out of order, or
    ``stop_requested()`` true: a SIGTERM waited too long for SHUTDOWN),
    ``ControlPlaneError`` (a corrupt message) or the runner's own error."""
    from cvllm.distributed.control_plane import ControlPlaneTimeout

    fault = fault if fault is not None else FaultInjector.from_env()
    last: Optional[int] = None
    while True:
        if stop_requested is not None and stop_requested():
            raise WorkerError(f"rank {rank}: signalled to stop and no SHUTDOWN came")
        try:
            msg = control.recv(timeout_s=idle_timeout_s)
        except ControlPlaneTimeout:
            raise WorkerError(f"rank {rank}: no message from rank 0 for {idle_timeout_s:.0f} s; "
                              "rank 0 is gone") from None
        if msg.kind == MessageKind.STEP:
            step = step_from_message(msg)
            if last is not None and step.step_id != last + 1:
                raise WorkerError(f"rank {rank}: step {step.step_id} after step {last} "
                                  "(a step was lost or repeated)")
            fault.check(rank, step.step_id)
            runner.execute(step, None)
            last = step.step_id
        elif msg.kind == MessageKind.SHUTDOWN:
            logger.info("rank %d: SHUTDOWN after step %s", rank, last)
            return 0
        elif msg.kind == MessageKind.ABORT:
            raise WorkerError(f"rank {rank}: rank 0 aborted the job")
        # HEARTBEAT: rank 0 is alive and idle; nothing to do.


def step_from_message(msg) -> StepInput:
    """The StepInput a STEP message carries (the whole packed buffer, header included);
    its step_id must be the message's."""
    step = StepInput.unpack(msg.body)
    if step.step_id != msg.step_id:
        raise StepInputError(f"STEP message {msg.step_id} carries step {step.step_id}")
    return step
