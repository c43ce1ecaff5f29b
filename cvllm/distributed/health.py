"""The worker -> rank 0 liveness link: a small TCP side channel next to the control plane.

The control plane only broadcasts from rank 0, so it cannot tell rank 0 that a worker
died. Rank 0 runs one ``HealthMonitor`` (built by the composition root, owned by the
engine; a thread with a listening socket bound to the given address only, by default
on the rendezvous port + 1, see ``LaunchEnv.health_port``). Every other rank runs one
``HealthReporter`` (``health_reporter.py``, a daemon thread) that connects, says
HELLO(rank), sends HEARTBEAT every second, forwards LOG(text) for its log records /
stderr lines at WARNING and above (so every rank's stderr reaches the rank-0 log),
ERROR(traceback) when it fails, and BYE when it exits cleanly.

The monitor records the first failure: "rank 1: connection lost" (closed without BYE),
"rank 1 silent for 6.0 s" (no frame for ``silence_s`` <= 5 s: a stopped or wedged
process), "rank 1: <error text>" (ERROR frame) or "rank 1: protocol error: ..." (a bad
frame), and calls the ``on_failure`` callbacks once, from its thread.

Frames (never pickle): header ``<4s B B H I>`` = magic b"CVLH", version, kind, rank,
payload length; then the UTF-8 payload. The length is checked against
``MAX_PAYLOAD_BYTES`` (64 KiB) before any payload byte is buffered; senders truncate.
"""

from __future__ import annotations

import enum
import logging
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

logger = logging.getLogger("cvllm.distributed")

MAGIC = b"CVLH"
VERSION = 1
MAX_PAYLOAD_BYTES = 64 << 10
DEFAULT_SILENCE_S = 5.0
DEFAULT_HEARTBEAT_S = 1.0
_HEADER = struct.Struct("<4sBBHI")
HEADER_SIZE = _HEADER.size


class FrameKind(enum.IntEnum):
    HELLO = 1
    HEARTBEAT = 2
    LOG = 3
    ERROR = 4
    BYE = 5


class HealthProtocolError(ValueError):
    """A malformed or oversized health frame."""


@dataclass(frozen=True)
class Frame:
    kind: FrameKind
    rank: int
    text: str = ""


def encode_frame(kind: FrameKind, rank: int, text: str = "") -> bytes:
    """One frame; ``text`` is cut to ``MAX_PAYLOAD_BYTES`` of UTF-8 (on a char boundary)."""
    payload = text.encode("utf-8", "replace")
    if len(payload) > MAX_PAYLOAD_BYTES:
        payload = payload[:MAX_PAYLOAD_BYTES].decode("utf-8", "ignore").encode("utf-8")
    return _HEADER.pack(MAGIC, VERSION, int(kind), rank, len(payload)) + payload


class FrameDecoder:
    """Incremental decoder of one connection's byte stream."""

    def __init__(self, max_payload: int = MAX_PAYLOAD_BYTES) -> None:
        self.max_payload = max_payload
        self._buf = bytearray()
        self._header: Optional[Tuple[FrameKind, int, int]] = None

    def feed(self, data: bytes) -> List[Frame]:
        self._buf += data
        frames = []
        while True:
            if self._header is None:
                if len(self._buf) < HEADER_SIZE:
                    return frames
                self._header = self._parse_header(bytes(self._buf[:HEADER_SIZE]))
                del self._buf[:HEADER_SIZE]
            kind, rank, length = self._header
            if len(self._buf) < length:
                return frames
            text = bytes(self._buf[:length]).decode("utf-8", "replace")
            del self._buf[:length]
            self._header = None
            frames.append(Frame(kind, rank, text))

    def _parse_header(self, raw: bytes) -> Tuple[FrameKind, int, int]:
        magic, version, kind, rank, length = _HEADER.unpack(raw)
        if magic != MAGIC:
            raise HealthProtocolError(f"bad magic {magic!r}")
        if version != VERSION:
            raise HealthProtocolError(f"unsupported version {version}")
        try:
            kind = FrameKind(kind)
        except ValueError:
            raise HealthProtocolError(f"unknown frame kind {kind}") from None
        if length > self.max_payload:
            raise HealthProtocolError(f"frame of {length} bytes exceeds {self.max_payload}")
        return kind, rank, length


class _Peer:
    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.decoder = sock, FrameDecoder()
        self.rank: Optional[int] = None
        self.last_seen = time.monotonic()
        self.said_bye = False
        self.closed = False


class HealthMonitor:
    """Rank 0's listener: which workers are connected, and the first failure."""

    def __init__(self, bind_addr: str, port: int, world_size: int,
                 silence_s: float = DEFAULT_SILENCE_S) -> None:
        self.world_size, self.silence_s = world_size, silence_s
        self._listener = socket.create_server((bind_addr, port), reuse_port=False)
        self._listener.setblocking(False)
        self.address: Tuple[str, int] = self._listener.getsockname()[:2]
        self.port = self.address[1]
        self._cond = threading.Condition()
        self._hello: Dict[int, _Peer] = {}
        self._failure: Optional[str] = None
        self._callbacks: List[Callable[[str], None]] = []
        self._stop = threading.Event()
        self._stopping = False
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._run, name="cvllm-health-monitor",
                                        daemon=True)
        self._thread.start()
        logger.info("health monitor listening on %s:%d for %d workers", *self.address,
                    world_size - 1)

    # ----- public ---------------------------------------------------------------------

    @property
    def failure(self) -> Optional[str]:
        return self._failure

    @property
    def healthy(self) -> bool:
        return self._failure is None

    def connected_ranks(self) -> List[int]:
        with self._cond:
            return sorted(self._hello)

    def wait_for_workers(self, timeout_s: float) -> bool:
        """True once every rank 1..world_size-1 said HELLO; False on timeout or failure."""
        want = self.world_size - 1
        with self._cond:
            self._cond.wait_for(lambda: len(self._hello) >= want or self._failure is not None,
                                timeout=timeout_s)
            return len(self._hello) >= want and self._failure is None

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(failure)`` once at the first failure (now, if already failed)."""
        with self._cond:
            failure = self._failure
            if failure is None:
                self._callbacks.append(callback)
        if failure is not None:
            callback(failure)

    def stopping(self) -> None:
        """Rank 0 is shutting the job down: workers leaving now are not failures."""
        self._stopping = True

    def close(self) -> None:
        self._stopping = True
        self._stop.set()
        self._thread.join(timeout=5)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()
        self._selector.close()

    # ----- monitor thread -------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(timeout=0.2):
                if key.data is None:
                    self._accept()
                else:
                    self._read(key.data)
            self._check_silence()

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except OSError:
            return
        sock.setblocking(False)
        self._selector.register(sock, selectors.EVENT_READ, _Peer(sock))

    def _read(self, peer: _Peer) -> None:
        try:
            data = peer.sock.recv(MAX_PAYLOAD_BYTES + HEADER_SIZE)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop(peer, None if peer.said_bye else "connection lost")
            return
        peer.last_seen = time.monotonic()
        try:
            frames = peer.decoder.feed(data)
        except HealthProtocolError as e:
            self._drop(peer, f"protocol error: {e}")
            return
        for frame in frames:
            self._handle(peer, frame)

    def _handle(self, peer: _Peer, frame: Frame) -> None:
        if frame.kind == FrameKind.HELLO:
            if not 1 <= frame.rank < self.world_size or frame.rank in self._hello:
                self._drop(peer, f"protocol error: HELLO from rank {frame.rank} "
                                 f"(world of {self.world_size}, seen {sorted(self._hello)})")
                return
            with self._cond:
                peer.rank = frame.rank
                self._hello[frame.rank] = peer
                self._cond.notify_all()
            logger.info("rank %d connected to the health monitor", frame.rank)
        elif peer.rank is None:
            self._drop(peer, f"protocol error: {frame.kind.name} before HELLO")
        elif frame.kind == FrameKind.LOG:
            logger.warning("rank %d: %s", peer.rank, frame.text)
        elif frame.kind == FrameKind.ERROR:
            logger.error("rank %d failed: %s", peer.rank, frame.text)
            self._fail(f"rank {peer.rank}: {frame.text}")
        elif frame.kind == FrameKind.BYE:
            peer.said_bye = True

    def _check_silence(self) -> None:
        now = time.monotonic()
        for peer in list(self._hello.values()):
            quiet = now - peer.last_seen
            if quiet > self.silence_s and not peer.said_bye and not peer.closed:
                self._drop(peer, f"silent for {quiet:.1f} s", sep=" ")

    def _drop(self, peer: _Peer, reason: Optional[str], sep: str = ": ") -> None:
        peer.closed = True
        try:
            self._selector.unregister(peer.sock)
        except (KeyError, ValueError):
            pass
        peer.sock.close()
        if reason is None or self._stopping:
            return
        who = f"rank {peer.rank}" if peer.rank is not None else "an unidentified peer"
        self._fail(f"{who}{sep}{reason}")

    def _fail(self, failure: str) -> None:
        with self._cond:
            if self._failure is not None or self._stopping:
                return
            self._failure = failure
            callbacks, self._callbacks = self._callbacks, []
            self._cond.notify_all()
        logger.error("health: %s", failure)
        for cb in callbacks:
            try:
                cb(failure)
            except Exception:  # noqa: BLE001 - a bad callback must not kill the monitor
                logger.exception("health failure callback raised")
