"""Framed messages over a stream socket: the typed channel between rank 0's engine and
the API-server process (``runtime/api_host.py`` on the engine side,
``server/remote_engine.py`` on the other).

A frame is a 5-byte header, the payload's length (unsigned 32-bit, big-endian) and one
byte of kind, then the payload. Lengths are checked against ``MAX_FRAME`` before
anything is allocated, kinds against ``KINDS``; a stream that ends inside a frame is an
error, one that ends between frames is a clean close. Payloads are UTF-8 JSON except
where a kind says otherwise: nothing on this channel is ever pickled (house rule 12).

Blocking helpers (``send_frame``, ``FrameReader``) serve the engine side's threads;
``read_frame_async`` serves the API process's event loop. Stdlib only.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading
from typing import Any, Dict, Optional, Tuple

HEADER = struct.Struct(">IB")
MAX_FRAME = 64 << 20
"""Largest payload either side accepts (64 MiB: a step of 512 outputs with 20 logprobs
each is well under 1 MiB)."""
VERSION = 1
"""Sent in HELLO; a peer of another version is refused at start-up."""

# Engine -> API process
HELLO = 1        # JSON: version, model name, limits, default params, tokenizer, probe
OUTPUTS = 2      # JSON list: one step's outputs of this channel's requests
REQUEST_ERROR = 3  # JSON: a request the engine refused or could not finish
STATUS = 4       # JSON: ready / healthy / error, and the metrics snapshot
RPC_REPLY = 5    # JSON: the answer to an RPC
SIGNAL = 6       # JSON: a SIGTERM / SIGINT rank 0 received, to act on as one's own
# API process -> engine
LISTENING = 20   # JSON: the HTTP address is bound
FATAL = 21       # JSON: the API process cannot start (message)
ADD = 22         # JSON: request id, prompt token ids, sampling params
ABORT = 23       # UTF-8: a request id
DRAIN = 24       # empty: stop taking requests
ABORT_ALL = 25   # empty: end every request now
RPC = 26         # JSON: call id, method, arguments

KINDS = {HELLO: "HELLO", OUTPUTS: "OUTPUTS", REQUEST_ERROR: "REQUEST_ERROR",
         STATUS: "STATUS", RPC_REPLY: "RPC_REPLY", SIGNAL: "SIGNAL", LISTENING: "LISTENING",
         FATAL: "FATAL",
         ADD: "ADD", ABORT: "ABORT", DRAIN: "DRAIN", ABORT_ALL: "ABORT_ALL", RPC: "RPC"}


class ChannelError(ConnectionError):
    """A malformed frame, or the peer went away in the middle of one."""


def encode_frame(kind: int, payload: bytes = b"") -> bytes:
    if kind not in KINDS:
        raise ChannelError(f"unknown frame kind {kind}")
    if len(payload) > MAX_FRAME:
        raise ChannelError(f"a {KINDS[kind]} frame of {len(payload)} bytes is over the "
                           f"{MAX_FRAME}-byte limit")
    return HEADER.pack(len(payload), kind) + payload


def encode_json(kind: int, obj: Any) -> bytes:
    """``obj`` as a JSON frame (ASCII escapes: any string, lone surrogates included,
    survives the trip)."""
    return encode_frame(kind, json.dumps(obj, separators=(",", ":")).encode("ascii"))


def decode_json(kind: int, payload: bytes) -> Any:
    try:
        return json.loads(payload)
    except (ValueError, RecursionError) as e:
        raise ChannelError(f"a {KINDS.get(kind, kind)} frame is not valid JSON: {e}") from None


def check_header(header: bytes) -> Tuple[int, int]:
    """``(length, kind)`` of a frame header, both checked."""
    length, kind = HEADER.unpack(header)
    if kind not in KINDS:
        raise ChannelError(f"unknown frame kind {kind} (a peer of another version?)")
    if length > MAX_FRAME:
        raise ChannelError(f"a {KINDS[kind]} frame announces {length} bytes, over the "
                           f"{MAX_FRAME}-byte limit")
    return length, kind


class FrameReader:
    """Blocking reads of whole frames from a socket (one reader thread)."""

    def __init__(self, sock: socket.socket):
        self._sock = sock

    def _exactly(self, n: int, started: bool) -> Optional[bytes]:
        chunks, got = [], 0
        while got < n:
            chunk = self._sock.recv(min(n - got, 1 << 20))
            if not chunk:
                if got == 0 and not started:
                    return None  # closed between frames
                raise ChannelError("the peer closed the channel in the middle of a frame")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def read(self) -> Optional[Tuple[int, bytes]]:
        """The next ``(kind, payload)``; None once the peer closed the channel."""
        header = self._exactly(HEADER.size, started=False)
        if header is None:
            return None
        length, kind = check_header(header)
        payload = self._exactly(length, started=True) if length else b""
        return kind, payload


class FrameWriter:
    """Thread-safe whole-frame writes to a socket (sendall releases the GIL while the
    kernel takes the bytes)."""

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._lock = threading.Lock()

    def send(self, frame: bytes) -> None:
        with self._lock:
            self._sock.sendall(frame)

    def send_json(self, kind: int, obj: Any) -> None:
        self.send(encode_json(kind, obj))


async def read_frame_async(reader: asyncio.StreamReader) -> Optional[Tuple[int, bytes]]:
    """The event-loop side of ``FrameReader.read``."""
    try:
        header = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise ChannelError("the peer closed the channel in the middle of a frame") from None
    length, kind = check_header(header)
    try:
        payload = await reader.readexactly(length) if length else b""
    except asyncio.IncompleteReadError:
        raise ChannelError("the peer closed the channel in the middle of a frame") from None
    return kind, payload


def error_info(err: BaseException) -> Dict[str, Any]:
    """What crosses the channel of an exception: its class name, message and, for the
    request errors that name a field, ``param``."""
    info: Dict[str, Any] = {"type": type(err).__name__, "message": str(err),
                            "value_error": isinstance(err, ValueError)}
    param = getattr(err, "param", None)
    if isinstance(param, str):
        info["param"] = param
    return info
