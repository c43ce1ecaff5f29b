"""A process-wide exit deadline: once shutdown starts, the process ends by a set time.

Armed by ``server/lifecycle.py`` on rank 0 (SIGTERM / SIGINT while serving) and by
``runtime/worker_rank.py`` on the other ranks (the signal mpirun / torchrun forward). Shutdown
normally finishes well before the deadline; if any step of it hangs (a peer that left
mid-collective, ``MPI_Finalize``, a join), a daemon thread flushes the logs and leaves
with ``os._exit`` when the deadline passes. Arming again can only bring the deadline
closer (a second SIGTERM: a few seconds from now). Safe to call from signal handlers
(reentrant lock). Stdlib only.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Optional

logger = logging.getLogger("cvllm")

_cond = threading.Condition(threading.RLock())
_deadline: Optional[float] = None  # time.monotonic() value
_reason = ""
_code = 1
_thread: Optional[threading.Thread] = None


def exit_by(seconds: float, reason: str, code: int = 1) -> None:
    """End this process with ``code`` at the latest ``seconds`` from now (``os._exit``),
    unless it exited before. A later call only ever moves the deadline earlier."""
    global _deadline, _reason, _code, _thread
    at = time.monotonic() + max(0.0, seconds)
    with _cond:
        if _deadline is not None and _deadline <= at:
            return
        _deadline, _reason, _code = at, reason, code
        if _thread is None:
            _thread = threading.Thread(target=_watch, name="cvllm-exit-deadline", daemon=True)
            _thread.start()
        _cond.notify_all()


def remaining() -> Optional[float]:
    """Seconds left before the deadline (None while unarmed)."""
    with _cond:
        return None if _deadline is None else _deadline - time.monotonic()


def wait_budget(margin_s: float = 2.0, least_s: float = 1.0, unarmed_s: float = 5.0) -> float:
    """Seconds a shutdown step may wait for something to end (a thread's join): until
    ``margin_s`` before the deadline (left for the steps after it: closing channels,
    SHUTDOWN to the ranks), at least ``least_s`` (past the deadline the process leaves
    anyway); ``unarmed_s`` while no deadline is armed."""
    left = remaining()
    return unarmed_s if left is None else max(least_s, left - margin_s)


def _watch() -> None:
    with _cond:
        while True:
            left = _deadline - time.monotonic()
            if left <= 0:
                break
            _cond.wait(left)
        reason, code = _reason, _code
    try:
        logger.warning("%s: still running at the exit deadline; exiting now", reason)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)
