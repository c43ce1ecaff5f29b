"""Processes of the job on this node: the ranks cvllm spawns itself, and ending the job.

Used by ``runtime/spmd.py`` on the process that starts a node's ranks: rank 0 under spawn
(``cvllm serve --d 0,1,2,3``) and node-local rank 0 of every node under the SSH launch
(``--num-nodes``). ``LocalRanks`` owns the child processes (``sys.executable -m cvllm``
with the parent's argv and the ``CVLLM_*`` variables of ``launch_env.child_environ``):
it relays each child's stderr line by line to this process's stderr (and log) prefixed
with ``[rank N]``, watches for a child that exits, and kills them all when the job ends
(Linux: each child also gets SIGKILL from the kernel if this process dies,
``PR_SET_PDEATHSIG``). ``abort_job`` ends the whole job from any rank: MPI Abort under
mpirun, else the spawned children are killed and the process leaves with ``os._exit``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, List, Optional, Sequence

logger = logging.getLogger("cvllm.launch")

_PR_SET_PDEATHSIG = 1
_MAX_LINE = 64 << 10
"""A relayed stderr line is cut at this many bytes (bounded reads, DESIGN rule 12)."""


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


class LocalRanks:
    """The ranks this process spawned; ``on_exit(rank, returncode)`` is called (from a
    watcher thread) when one ends by itself, before ``terminate``."""

    def __init__(self, on_exit: Optional[Callable[[int, int], None]] = None) -> None:
        self.procs: List[subprocess.Popen] = []
        self.ranks: List[int] = []
        self._on_exit = on_exit
        self._stopping = threading.Event()
        self._relays: List[threading.Thread] = []

    def spawn(self, rank: int, argv: Sequence[str], environ: dict) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "cvllm", *argv]
        proc = subprocess.Popen(cmd, env=environ, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        self.procs.append(proc)
        self.ranks.append(rank)
        relay = threading.Thread(target=self._relay, args=(rank, proc), daemon=True,
                                 name=f"cvllm-relay-rank{rank}")
        relay.start()
        self._relays.append(relay)
        logger.info("spawned rank %d (pid %d)", rank, proc.pid)
        return proc

    def _relay(self, rank: int, proc: subprocess.Popen) -> None:
        """Copy the child's stderr to ours, each line prefixed with its rank (unless the
        log format already names it); report the child's exit."""
        tag = f"[rank {rank}]"
        out = sys.stderr
        for raw in iter(lambda: proc.stderr.readline(_MAX_LINE), b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            try:
                out.write((line if tag in line else f"{tag} {line}") + "\n")
                out.flush()
            except (OSError, ValueError):  # our stderr is gone: keep draining the pipe
                pass
        code = proc.wait()
        if not self._stopping.is_set() and self._on_exit is not None:
            self._on_exit(rank, code)

    def wait(self, timeout_s: float) -> bool:
        """Wait for every child to exit by itself (after SHUTDOWN); True if they did."""
        deadline = time.monotonic() + timeout_s
        self._stopping.set()
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        for relay in self._relays:
            relay.join(timeout=1.0)
        return True

    def terminate(self, grace_s: float = 2.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s`` for any child still running."""
        self._stopping.set()
        alive = [p for p in self.procs if p.poll() is None]
        for p in alive:
            _signal(p, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in alive:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(p, signal.SIGKILL)
                p.wait()

    def kill(self) -> None:
        self._stopping.set()
        for p in self.procs:
            if p.poll() is None:
                _signal(p, signal.SIGKILL)


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass


_ABORT_LOCK = threading.Lock()


def abort_job(transport: str, reason: str, code: int = 1,
              children: Optional[LocalRanks] = None) -> None:
    """End the whole job from this rank now (never returns): log why, kill this node's
    spawned ranks, MPI Abort under mpirun (mpirun then kills every rank), else leave at
    once with ``os._exit`` (the others see their connection to this rank drop)."""
    with _ABORT_LOCK:  # a second failure while aborting must not race the first
        logger.critical("ending the job: %s", reason)
        for h in logging.getLogger("cvllm").handlers:
            try:
                h.flush()
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
        if children is not None:
            children.kill()
        if transport == "mpi":
            try:
                from mpi4py import MPI

                MPI.COMM_WORLD.Abort(code)
            except Exception:  # noqa: BLE001 - fall through to _exit
                pass
        sys.stderr.flush()
        os._exit(code)
