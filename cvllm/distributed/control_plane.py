"""Rank 0 -> every rank: the STEP / ABORT / SHUTDOWN / HEARTBEAT messages of the job.

Built once per rank by the composition root with ``make_control_plane(env)`` (after
``init_distributed`` for the gloo transport; every rank must call it at the same point,
since it creates a communicator collectively) and owned by the rank's engine (rank 0,
which ``broadcast``s) or worker loop (ranks != 0, which ``recv``). Rank 0 starts a
heartbeat thread that sends HEARTBEAT whenever it has sent nothing for
``heartbeat_interval_s`` (~1 s), so a worker whose ``recv(timeout_s=10)`` times out knows
rank 0 is gone.

Framing is ``cvllm.core.wire_format``'s, never a second one, never pickle: a STEP's body is
the bytes of ``StepInput.pack()`` (its own header then its arrays); any other kind is
``ControlMessage(kind, step_id).pack()``, a header alone. On the wire each message is two
phases: the fixed ``HEADER_SIZE``-byte header, then (when the header's body length is not
zero) the body. A worker parses and bounds the header (magic, version, kind, length <=
``max_body_bytes``) before allocating the body buffer, then checks the crc32; any failure
raises ``ControlPlaneError`` and leaves the plane broken.

``Message.body`` on the worker is what rank 0 passed: for STEP the whole packed StepInput
(give it to ``StepInput.unpack``), for the other kinds ``b""``.

Transports: ``MPIControlPlane`` (mpi4py non-blocking Ibcast on a duplicate of
COMM_WORLD; the worker polls with a short sleep, so an idle worker does not spin a core
and ``recv`` can time out), ``GlooControlPlane`` (torch.distributed gloo broadcasts of
uint8 tensors on a group of its own, async and polled the same way) and
``InProcessControlPlane`` (queues, for --multithread; also world size 1).
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional, Tuple

from cvllm.core.wire_format import (
    HEADER_SIZE, ControlMessage, MessageHeader, MessageKind, StepInputError,
)
from cvllm.distributed.inprocess import InProcessGroup
from cvllm.distributed.launch_env import LaunchEnv
from cvllm.utils import tuning

logger = logging.getLogger("cvllm.distributed")

MAX_CONTROL_BODY_BYTES = 64 << 20
"""Default bound on a message body: far above a StepInput of 100k tokens."""
DEFAULT_HEARTBEAT_INTERVAL_S = 1.0
BODY_TIMEOUT_S = 60.0
"""Once a header arrived, its body follows at once; waiting longer means a broken stream."""
_POLL_MIN_S, _POLL_MAX_S = 20e-6, 1e-3
HOT_WINDOW_S = 0.1
"""After a STEP, a worker's next receive polls this long without sleeping (it only yields
the GIL; one core busy while steps keep coming): while rank 0 is stepping the next STEP
comes within a step's time, and a sleep of even 20 us (60+ us with the kernel's timer
slack), grown to 1 ms across a 3 ms decode step, would delay this rank's launch. Past
the window, or after a HEARTBEAT (rank 0 idle), it backs off to the growing sleep.
``CVLLM_HOT_POLL_S`` overrides it (0: never, e.g. where CPU quotas are tight)."""
BODY_HOT_S = 0.01
"""A message's body follows its header at once: polled hot this long whatever the window."""


def hot_window_s() -> float:
    """``CVLLM_HOT_POLL_S`` (seconds >= 0, ``utils/tuning.py``), else ``HOT_WINDOW_S``."""
    value = tuning.current().hot_poll_s
    return HOT_WINDOW_S if value is None else value


class ControlPlaneError(RuntimeError):
    """A corrupt, oversized or wrong-version message, or a broken transport."""


class ControlPlaneTimeout(ControlPlaneError):
    """No message arrived within ``recv``'s timeout (the plane stays usable)."""


@dataclass(frozen=True)
class Message:
    """One message as a worker receives it."""

    kind: MessageKind
    step_id: int
    body: bytes
    """STEP: the packed StepInput (header included); other kinds: ``b""``."""


def encode_frame(kind: MessageKind, step_id: int, body: bytes = b"",
                 max_body_bytes: int = MAX_CONTROL_BODY_BYTES) -> Tuple[bytes, bytes]:
    """``(header, payload)`` of one message, checking ``body`` matches ``kind``."""
    kind = MessageKind(kind)
    try:
        if kind != MessageKind.STEP:
            if body:
                raise ControlPlaneError(f"{kind.name} carries no body, got {len(body)} bytes")
            return ControlMessage(kind, step_id).pack(), b""
        header = MessageHeader.unpack(body[:HEADER_SIZE], max_body_bytes)
    except StepInputError as e:
        raise ControlPlaneError(f"cannot send {kind.name}: {e}") from None
    if header.kind != MessageKind.STEP or header.step_id != step_id:
        raise ControlPlaneError(
            f"STEP body is a {header.kind.name} of step {header.step_id}, expected the "
            f"packed StepInput of step {step_id}"
        )
    if len(body) != HEADER_SIZE + header.body_len:
        raise ControlPlaneError("STEP body length does not match its header")
    return bytes(body[:HEADER_SIZE]), bytes(body[HEADER_SIZE:])


def decode_header(buf: bytes, max_body_bytes: int) -> MessageHeader:
    """Parse and bound a received header (before its body is allocated)."""
    try:
        return MessageHeader.unpack(buf, max_body_bytes)
    except StepInputError as e:
        raise ControlPlaneError(f"rejected control message: {e}") from None


def decode_body(header: MessageHeader, header_bytes: bytes, payload: bytes) -> Message:
    if len(payload) != header.body_len:
        raise ControlPlaneError(
            f"body of {len(payload)} bytes, header says {header.body_len}"
        )
    if zlib.crc32(payload) != header.crc:
        raise ControlPlaneError(
            f"rejected control message: crc32 mismatch in step {header.step_id} "
            f"({header.kind.name}): body is corrupt"
        )
    body = header_bytes + payload if header.kind == MessageKind.STEP else b""
    return Message(header.kind, header.step_id, body)


class ControlPlane(ABC):
    """The rank-0 broadcast channel; transports implement ``_send_bytes`` (rank 0) and
    ``_recv_bytes`` (other ranks), both collective over the job's ranks."""

    def __init__(self, rank: int, world_size: int,
                 max_body_bytes: int = MAX_CONTROL_BODY_BYTES) -> None:
        self.rank, self.world_size = rank, world_size
        self.max_body_bytes = max_body_bytes
        self._lock = threading.Lock()
        self._last_send = time.monotonic()
        self._last_step_id = 0
        self._broken: Optional[str] = None
        self._closed = threading.Event()
        self._heartbeat: Optional[threading.Thread] = None
        self._hot_until = 0.0  # receivers poll without sleeping until then
        self.hot_window_s = hot_window_s()
        self._after_step = False  # the last message received was a STEP

    # ----- rank 0 ---------------------------------------------------------------------

    def broadcast(self, kind: MessageKind, step_id: int, body: bytes = b"") -> None:
        """Send one message to every other rank (rank 0 only)."""
        if self.rank != 0:
            raise ControlPlaneError(f"rank {self.rank} cannot broadcast: only rank 0 decides")
        header, payload = encode_frame(kind, step_id, body, self.max_body_bytes)
        self._send_frame(header, payload)
        if kind == MessageKind.STEP:
            self._last_step_id = step_id

    def _send_frame(self, header: bytes, payload: bytes) -> None:
        with self._lock:
            if self._broken:
                raise ControlPlaneError(f"control plane is broken: {self._broken}")
            try:
                self._send_bytes(header)
                if payload:
                    self._send_bytes(payload)
            except Exception as e:
                self._broken = f"send failed: {e}"
                raise ControlPlaneError(self._broken) from e
            self._last_send = time.monotonic()

    def start_heartbeat(self, interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S) -> None:
        """Rank 0: send HEARTBEAT whenever nothing was sent for ``interval_s``."""
        if self.rank != 0 or self.world_size == 1 or self._heartbeat is not None:
            return
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, args=(interval_s,),
                                           name="cvllm-control-heartbeat", daemon=True)
        self._heartbeat.start()

    def _heartbeat_loop(self, interval_s: float) -> None:
        while not self._closed.wait(interval_s / 4):
            if time.monotonic() - self._last_send < interval_s:
                continue
            try:
                self.broadcast(MessageKind.HEARTBEAT, self._last_step_id)
            except ControlPlaneError as e:
                if not self._closed.is_set():
                    logger.error("control-plane heartbeat stopped: %s", e)
                return

    # ----- ranks != 0 -----------------------------------------------------------------

    def recv(self, timeout_s: Optional[float] = None) -> Message:
        """The next message from rank 0 (ranks != 0). ``ControlPlaneTimeout`` when none
        arrives within ``timeout_s``; ``ControlPlaneError`` for a bad message."""
        if self.rank == 0:
            raise ControlPlaneError("rank 0 sends, it does not receive")
        if self._broken:
            raise ControlPlaneError(f"control plane is broken: {self._broken}")
        # After a STEP the next one is due within a step's time of this call (the worker
        # calls recv once it has launched that step).
        self._hot_until = time.monotonic() + self.hot_window_s if self._after_step else 0.0
        header_bytes = self._recv_bytes(HEADER_SIZE, timeout_s)
        try:
            header = decode_header(header_bytes, self.max_body_bytes)
            self._hot_until = time.monotonic() + BODY_HOT_S  # the body follows at once
            payload = self._recv_bytes(header.body_len, BODY_TIMEOUT_S) \
                if header.body_len else b""
            # Heartbeats and the like: rank 0 is idle, so back off.
            self._after_step = header.kind == MessageKind.STEP
            return decode_body(header, header_bytes, payload)
        except ControlPlaneError as e:
            self._broken = str(e)
            logger.error("rank %d: %s", self.rank, e)
            raise

    # ----- transport ------------------------------------------------------------------

    @abstractmethod
    def _send_bytes(self, data: bytes) -> None:
        """Rank 0: broadcast ``data`` (blocking until it may be reused)."""

    @abstractmethod
    def _recv_bytes(self, n: int, timeout_s: Optional[float]) -> bytes:
        """Other ranks: receive the next broadcast, exactly ``n`` bytes."""

    def close(self) -> None:
        """Stop the heartbeat and release the transport (does not send SHUTDOWN)."""
        self._closed.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)

    def __enter__(self) -> "ControlPlane":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _poll(done, timeout_s: Optional[float], what: str, hot_until: float = 0.0) -> None:
    """Call ``done()`` until it is true or the deadline passes (``ControlPlaneTimeout``):
    until ``hot_until`` (a ``time.monotonic()`` value) only yielding the GIL between
    calls, then with a growing sleep (20 us .. 1 ms)."""
    now = time.monotonic()
    deadline = None if timeout_s is None else now + timeout_s
    pause = _POLL_MIN_S
    while not done():
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            raise ControlPlaneTimeout(f"no {what} within {timeout_s:.1f} s")
        if now < hot_until:
            time.sleep(0)
            continue
        time.sleep(pause)
        pause = min(pause * 2, _POLL_MAX_S)


class MPIControlPlane(ControlPlane):
    """mpi4py Ibcast on a duplicate of COMM_WORLD (world rank = job rank)."""

    def __init__(self, max_body_bytes: int = MAX_CONTROL_BODY_BYTES, comm=None) -> None:
        from mpi4py import MPI  # lazy: libmpi only under mpirun

        self._MPI = MPI
        self._comm = (comm or MPI.COMM_WORLD).Dup()  # collective: every rank calls it
        super().__init__(self._comm.Get_rank(), self._comm.Get_size(), max_body_bytes)
        self._pending: Optional[Tuple[object, bytearray]] = None

    def _send_bytes(self, data: bytes) -> None:
        buf = bytearray(data)
        self._comm.Ibcast([buf, self._MPI.BYTE], root=0).Wait()

    def _recv_bytes(self, n: int, timeout_s: Optional[float]) -> bytes:
        if self._pending is None:
            buf = bytearray(n)
            self._pending = (self._comm.Ibcast([buf, self._MPI.BYTE], root=0), buf)
        request, buf = self._pending
        if len(buf) != n:
            raise ControlPlaneError(f"pending receive of {len(buf)} bytes, asked for {n}")
        _poll(request.Test, timeout_s, "control message", self._hot_until)
        self._pending = None
        return bytes(buf)

    def close(self) -> None:
        super().close()
        if self._pending is None and self._comm != self._MPI.COMM_NULL:
            self._comm.Free()  # not with an Ibcast still posted (it would never match)


class GlooControlPlane(ControlPlane):
    """torch.distributed gloo broadcasts on a group of its own (after init_distributed)."""

    def __init__(self, max_body_bytes: int = MAX_CONTROL_BODY_BYTES, group=None) -> None:
        import torch.distributed as dist

        self._dist = dist
        # Collective: every rank creates the group at the same point.
        self._group = group or dist.new_group(backend="gloo")
        self._src = dist.get_global_rank(self._group, 0)
        super().__init__(dist.get_rank(self._group), dist.get_world_size(self._group),
                         max_body_bytes)
        self._pending = None

    def _send_bytes(self, data: bytes) -> None:
        import torch

        t = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # [n]
        self._dist.broadcast(t, src=self._src, group=self._group)

    def _recv_bytes(self, n: int, timeout_s: Optional[float]) -> bytes:
        import torch

        if self._pending is None:
            t = torch.empty(n, dtype=torch.uint8)  # [n], n bounded by decode_header
            work = self._dist.broadcast(t, src=self._src, group=self._group, async_op=True)
            self._pending = (work, t)
        work, t = self._pending
        if t.numel() != n:
            raise ControlPlaneError(f"pending receive of {t.numel()} bytes, asked for {n}")
        _poll(work.is_completed, timeout_s, "control message", self._hot_until)
        self._pending = None
        try:
            work.wait()
        except Exception as e:  # gloo raises when rank 0's connection drops
            raise ControlPlaneError(f"gloo broadcast failed: {e}") from e
        return t.numpy().tobytes()


class InProcessControlPlane(ControlPlane):
    """Queues of an InProcessGroup: rank threads of --multithread (or a 1-rank job)."""

    def __init__(self, group: InProcessGroup, rank: int,
                 max_body_bytes: int = MAX_CONTROL_BODY_BYTES) -> None:
        super().__init__(rank, group.world_size, max_body_bytes)
        self._queues = group.control_queues

    def _send_bytes(self, data: bytes) -> None:
        for q in self._queues[1:]:
            q.put(bytes(data))

    def _recv_bytes(self, n: int, timeout_s: Optional[float]) -> bytes:
        import queue

        try:
            data = self._queues[self.rank].get(timeout=timeout_s)
        except queue.Empty:
            raise ControlPlaneTimeout(f"no control message within {timeout_s:.1f} s") from None
        if len(data) != n:
            raise ControlPlaneError(f"received {len(data)} bytes, expected {n}")
        return data


def make_control_plane(env: LaunchEnv, max_body_bytes: int = MAX_CONTROL_BODY_BYTES, *,
                       inprocess_group: Optional[InProcessGroup] = None,
                       heartbeat_interval_s: Optional[float] = DEFAULT_HEARTBEAT_INTERVAL_S
                       ) -> ControlPlane:
    """The control plane of ``env.transport`` for this rank (collective: call it on every
    rank at the same point). Rank 0's heartbeat starts unless ``heartbeat_interval_s`` is
    None. Under --multithread pass the shared ``inprocess_group``."""
    if env.transport == "mpi":
        plane: ControlPlane = MPIControlPlane(max_body_bytes)
    elif env.transport == "gloo":
        plane = GlooControlPlane(max_body_bytes)
    elif env.transport == "inprocess":
        if inprocess_group is None:
            raise ValueError("the in-process control plane needs the shared InProcessGroup")
        plane = InProcessControlPlane(inprocess_group, env.rank, max_body_bytes)
    else:
        plane = InProcessControlPlane(InProcessGroup(1), 0, max_body_bytes)
    if (plane.rank, plane.world_size) != (env.rank, env.world_size):
        raise ControlPlaneError(
            f"{env.transport} transport sees rank {plane.rank} of {plane.world_size}, the "
            f"launch environment says {env.rank} of {env.world_size}"
        )
    if heartbeat_interval_s:
        plane.start_heartbeat(heartbeat_interval_s)
    logger.info("rank %d: %s control plane over %d ranks", env.rank, env.transport,
                env.world_size)
    return plane
