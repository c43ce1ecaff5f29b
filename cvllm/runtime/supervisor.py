"""How the job ends: the first failure anywhere ends all of it, once; a clean end leaves
the process groups.

``JobSupervisor`` is built once per process rank by ``runtime/spmd.run_process_rank``
(and once by ``--multithread``, ``runtime/threads.py``) and owned by that rank: rank 0's
runner, its health monitor and its spawned ranks report failures to it, and it ends the
job after ``grace_s`` (``launcher.abort_job``: MPI Abort under mpirun, else kill the
spawned ranks and ``os._exit``). ``abort_after`` is the path of a rank that fails itself:
log (and report over the health link), then end the job at once.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from typing import Any, Callable, List, Optional

from cvllm.config import ConfigError
from cvllm.runtime.launcher import LocalRanks, abort_job

logger = logging.getLogger("cvllm.spmd")

FAILURE_GRACE_S = 5.0
"""Rank 0 keeps answering ``/health`` with 503 this long before it ends the job."""
SHUTDOWN_WAIT_S = 30.0
"""After SHUTDOWN, how long rank 0 waits for the ranks it spawned to exit."""


class JobSupervisor:
    """Rank 0 (and any spawner): the first failure ends the whole job, once. Failures
    reported during the grace period are named in the final message too: when a worker
    dies, rank 0's own transport error often arrives before the news of the death."""

    MAX_LATER = 4
    """Later failures kept for the final message."""

    def __init__(self, transport: str, children: Optional[LocalRanks] = None,
                 grace_s: float = FAILURE_GRACE_S) -> None:
        self.transport = transport
        self.children = children
        self.grace_s = grace_s
        self.failure: Optional[str] = None
        self.later: List[str] = []
        self._listeners: List[Callable[[str], None]] = []
        self._lock = threading.Lock()

    def add_listener(self, fn: Callable[[str], None]) -> None:
        """``fn(reason)`` runs at the first failure (e.g. ``AsyncEngine.fail``)."""
        self._listeners.append(fn)
        if self.failure is not None:
            fn(self.failure)

    def fail(self, reason: str, code: int = 1, grace_s: Optional[float] = None) -> None:
        with self._lock:
            if self.failure is not None:
                first_line = reason.splitlines()[0] if reason else reason
                if len(self.later) < self.MAX_LATER and first_line not in self.later:
                    self.later.append(first_line)
                return
            self.failure = reason
        logger.error("job failure: %s", reason.splitlines()[0] if reason else reason)
        for fn in self._listeners:
            try:
                fn(reason)
            except Exception:  # noqa: BLE001 - the job ends anyway
                logger.exception("failure listener raised")
        wait = self.grace_s if grace_s is None else grace_s
        threading.Thread(target=self._abort_later, args=(reason, code, wait), daemon=True,
                         name="cvllm-abort").start()

    def _abort_later(self, reason: str, code: int, wait: float) -> None:
        time.sleep(wait)
        abort_job(self.transport, self.final_reason(), code, self.children)

    def final_reason(self) -> str:
        """The first failure, then any reported after it ('; also: ...')."""
        with self._lock:
            later = list(self.later)
        reason = self.failure or ""
        return reason + "".join(f"; also: {r}" for r in later)

    def child_exited(self, rank: int, code: int) -> None:
        if code != 0:
            self.fail(f"rank {rank} exited with status {code}")


def exit_code(err: BaseException) -> int:
    """2 for a mistake the user can fix (printed as one ``cvllm: error:`` line, as a
    single process does), the status of a ``SystemExit``, else 1."""
    from cvllm.loader.errors import ModelLoadError
    from cvllm.models.registry import UnsupportedArchitectureError

    if isinstance(err, SystemExit):
        return err.code if isinstance(err.code, int) else 1
    if isinstance(err, (ConfigError, ModelLoadError, UnsupportedArchitectureError)):
        print(f"cvllm: error: {err}", file=sys.stderr, flush=True)
        return 2
    return 1


def abort_after(env, supervisor: JobSupervisor, reason: str, err: BaseException,
                 link: Any = None) -> None:
    """Log ``err`` with its traceback (and send it over the health link), then end the
    job now (never returns)."""
    code = exit_code(err)
    text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    logger.error("%s\n%s", reason, text)
    if link is not None and hasattr(link, "error"):
        try:
            link.error(text)  # rank 0 logs it as "rank N failed: <traceback>"
        except Exception:  # noqa: BLE001 - aborting anyway
            pass
    abort_job(env.transport, reason, code or 1, supervisor.children)


def leave_groups() -> None:
    from cvllm.distributed.rendezvous import shutdown_distributed

    try:
        shutdown_distributed()
    except Exception as e:  # noqa: BLE001 - the job is over; only say why
        logger.warning("leaving the process groups failed: %s", e)

