"""A worker's end of the health link (``health.py``): ``HealthReporter``, a daemon thread
that keeps rank 0 informed.

Built once per rank != 0 by ``runtime/spmd.py`` at start-up (the link, its frames and
what rank 0's ``HealthMonitor`` makes of them: ``health.py``); owned by that rank, which
reports its fatal error through it and closes it (BYE) on a clean exit.
"""

from __future__ import annotations

import logging
import queue
import socket
import sys
import threading
import time
from typing import Optional, Tuple

from cvllm.distributed.health import (
    DEFAULT_HEARTBEAT_S, MAX_PAYLOAD_BYTES, FrameKind, encode_frame,
)

logger = logging.getLogger("cvllm.distributed")


class HealthReporter:
    """A worker's daemon thread that keeps rank 0 informed (ranks != 0)."""

    def __init__(self, addr: str, port: int, rank: int,
                 interval_s: float = DEFAULT_HEARTBEAT_S, connect_timeout_s: float = 60.0,
                 max_queued: int = 1000) -> None:
        self.addr, self.port, self.rank = addr, port, rank
        self.interval_s, self.connect_timeout_s = interval_s, connect_timeout_s
        self._queue: "queue.Queue[Tuple[bytes, Optional[threading.Event]]]" = \
            queue.Queue(max_queued)
        self._dropped = 0
        self.failure: Optional[str] = None
        """Why the link to rank 0 is down (None while it is up)."""
        self.connected = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cvllm-health-reporter",
                                        daemon=True)
        self._thread.start()

    def log(self, text: str) -> None:
        """Forward one log line to rank 0's log (never blocks; drops when backed up)."""
        self._put(encode_frame(FrameKind.LOG, self.rank, text), None)

    def error(self, text: str, flush_timeout_s: float = 2.0) -> bool:
        """Report this rank's fatal error; waits until it is on the wire (True) or the
        timeout passes (False)."""
        done = threading.Event()
        self._put(encode_frame(FrameKind.ERROR, self.rank, text), done)
        return done.wait(flush_timeout_s)

    def close(self, timeout_s: float = 2.0) -> None:
        """Say BYE (a clean exit, not a failure) and stop the thread."""
        done = threading.Event()
        self._put(encode_frame(FrameKind.BYE, self.rank), done)
        done.wait(timeout_s if self.connected.is_set() else 0)
        self._stop.set()
        self._thread.join(timeout=timeout_s)

    def install_log_handler(self, target: Optional[logging.Logger] = None,
                            level: int = logging.WARNING) -> logging.Handler:
        """Forward ``target``'s records (default the ``cvllm`` logger) at ``level``+."""
        handler = _ForwardHandler(self, level)
        (target or logging.getLogger("cvllm")).addHandler(handler)
        return handler

    def forward_stderr(self) -> None:
        """Also forward raw ``sys.stderr`` lines (tracebacks, warnings) to rank 0."""
        if not isinstance(sys.stderr, _StderrTee):
            sys.stderr = _StderrTee(sys.stderr, self)

    def _put(self, frame: bytes, done: Optional[threading.Event]) -> None:
        try:
            self._queue.put_nowait((frame, done))
        except queue.Full:
            self._dropped += 1

    def _connect(self) -> Optional[socket.socket]:
        deadline = time.monotonic() + self.connect_timeout_s
        while not self._stop.is_set():
            try:
                return socket.create_connection((self.addr, self.port), timeout=5)
            except OSError as e:
                if time.monotonic() >= deadline:
                    self.failure = f"cannot reach rank 0 at {self.addr}:{self.port}: {e}"
                    logger.error("health: %s", self.failure)
                    return None
                time.sleep(0.2)
        return None

    def _run(self) -> None:
        sock = self._connect()
        if sock is None:
            return
        try:
            sock.sendall(encode_frame(FrameKind.HELLO, self.rank))
            self.connected.set()
            self._pump(sock)
        except OSError as e:
            self.failure = f"lost rank 0 at {self.addr}:{self.port}: {e}"
        finally:
            self.connected.clear()
            sock.close()

    def _pump(self, sock: socket.socket) -> None:
        last = time.monotonic()
        while not self._stop.is_set():
            wait = max(0.0, self.interval_s - (time.monotonic() - last))
            try:
                frame, done = self._queue.get(timeout=wait)
            except queue.Empty:
                frame, done = encode_frame(FrameKind.HEARTBEAT, self.rank), None
            sock.sendall(frame)
            last = time.monotonic()
            if done is not None:
                done.set()
            if frame[5] == FrameKind.BYE:  # byte 5: the kind field of the header
                return


class _ForwardHandler(logging.Handler):
    def __init__(self, reporter: HealthReporter, level: int) -> None:
        super().__init__(level)
        self.reporter = reporter
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.reporter.log(self.format(record))
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


class _StderrTee:
    """sys.stderr that also forwards each complete line to rank 0."""

    def __init__(self, inner, reporter: HealthReporter) -> None:
        self._inner, self._reporter, self._partial = inner, reporter, ""

    def write(self, text: str) -> int:
        n = self._inner.write(text)
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()[-MAX_PAYLOAD_BYTES:]
        for line in lines:
            if line.strip():
                self._reporter.log(line)
        return n

    def __getattr__(self, name):
        return getattr(self._inner, name)
