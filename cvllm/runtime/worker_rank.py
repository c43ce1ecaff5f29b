"""A worker rank (rank != 0) after start-up: it runs the worker loop until SHUTDOWN,
holds SIGTERM / SIGINT until then (rank 0 drains first), and leaves without hanging.

Called by ``runtime/spmd.run_process_rank`` on every process rank != 0; ``--multithread``
rank threads run the worker loop directly (``runtime/threads.py``).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from typing import Callable, List, Optional

from cvllm.runtime.supervisor import SHUTDOWN_WAIT_S, abort_after, leave_groups

logger = logging.getLogger("cvllm.spmd")

WORKER_SIGTERM_WAIT_S = 90.0
"""A worker that got SIGTERM / SIGINT waits this long for rank 0's SHUTDOWN (rank 0
drains first, ``server/lifecycle.py``), then leaves; with ``--shutdown-timeout`` (serve)
it waits that timeout plus WORKER_GRACE_S instead."""
WORKER_GRACE_S = 3.0
"""Rank 0 aborts what is left at the shutdown timeout and sends SHUTDOWN about a second
later; a worker waits this long past the timeout (the bound is 5 s)."""
WORKER_SECOND_SIGNAL_WAIT_S = 2.5
"""After a second SIGTERM / SIGINT a worker waits this much more for SHUTDOWN (rank 0,
signalled too, aborts and sends it at once), then leaves."""
EXIT_DEADLINE_S = 4.5
"""A signalled rank is gone this long after its shutdown timeout (or after a second
signal) whatever hangs (``utils/exit_deadline.py``); after SHUTDOWN a worker is gone
within EXIT_AFTER_SHUTDOWN_S."""
EXIT_AFTER_SHUTDOWN_S = 2.0


def run_worker_rank(env, engine_options, control, device, reporter, supervisor,
                    shutdown_timeout_s: Optional[float] = None) -> None:
    """The worker loop until SHUTDOWN (a failure aborts the job), then leave."""
    from cvllm.engine.builder import build_engine_config
    from cvllm.utils.exit_deadline import exit_by
    from cvllm.worker.worker_loop import run_worker

    stop_requested = _defer_termination(shutdown_timeout_s)
    try:
        setup = build_engine_config(**engine_options, tp_size=env.world_size, device=device)
        run_worker(env, setup.config, setup.source, control, stop_requested=stop_requested)
    except BaseException as e:  # noqa: BLE001 - any failure ends the job
        abort_after(env, supervisor, f"rank {env.rank} failed: {e!r}", e, reporter)
    # The job is over: leaving (health link, process groups, MPI) must not hang.
    exit_by(EXIT_AFTER_SHUTDOWN_S, f"rank {env.rank} after SHUTDOWN", code=0)
    if reporter is not None:
        reporter.close()
    control.close()
    if supervisor.children is not None and not supervisor.children.wait(SHUTDOWN_WAIT_S):
        supervisor.children.terminate()
    if getattr(device, "type", device) == "cuda" and env.transport != "inprocess":
        _exit_now(env)  # NCCL teardown can block on a peer that already left
    leave_groups()


def _exit_now(env) -> None:
    """A worker's clean exit on GPUs after SHUTDOWN: flush, finalize MPI, leave without
    destroying the NCCL communicators (the driver frees them with the process)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    if env.transport == "mpi":
        from mpi4py import MPI

        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.Finalize()
    os._exit(0)


def _defer_termination(shutdown_timeout_s: Optional[float] = None) -> Callable[[], bool]:
    """Workers: SIGTERM / SIGINT (mpirun and torchrun forward them to every rank) do not
    stop the rank at once; it waits for rank 0's SHUTDOWN, at most the shutdown timeout
    plus WORKER_GRACE_S (WORKER_SIGTERM_WAIT_S without one), or WORKER_SECOND_SIGNAL_WAIT_S
    after a second signal; the exit deadline bounds the rest. Returns ``stop_requested``
    for the worker loop: true once the rank should give up waiting."""
    times: List[float] = []
    wait = WORKER_SIGTERM_WAIT_S if shutdown_timeout_s is None \
        else shutdown_timeout_s + WORKER_GRACE_S

    def handler(signum, _frame) -> None:
        from cvllm.utils.exit_deadline import exit_by

        name = signal.Signals(signum).name
        times.append(time.monotonic())
        if len(times) == 1:
            logger.info("%s: waiting for rank 0's SHUTDOWN (at most %.0f s)", name, wait)
            if shutdown_timeout_s is not None:
                exit_by(shutdown_timeout_s + EXIT_DEADLINE_S, f"{name} on a worker")
        elif len(times) == 2:
            logger.warning("second %s: waiting at most %.1f s more for SHUTDOWN", name,
                           WORKER_SECOND_SIGNAL_WAIT_S)
            exit_by(EXIT_DEADLINE_S, f"second {name} on a worker")

    def stop_requested() -> bool:
        now = time.monotonic()
        return bool(times) and (now - times[0] > wait or (
            len(times) > 1 and now - times[1] > WORKER_SECOND_SIGNAL_WAIT_S))

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    return stop_requested

