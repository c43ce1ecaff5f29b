"""The framing of every message between ranks: a checked header, and for a STEP the named
arrays of a ``StepInput`` (``core/step_input.py``).

Used by ``StepInput.pack`` / ``unpack`` and ``ControlMessage`` on every rank; the
transports (``distributed/control_plane.py``) read ``MessageHeader`` alone to know how
many body bytes follow. Pure Python + numpy.

Wire format (version 2), never pickle:

    header  <4s H H Q Q I>: magic b"CVLS", version, kind, step_id, body length, crc32(body)
    body    (STEP only) u32 array count, then per array:
            <H B B> name id, dtype code, ndim;  ndim x u32 dims;  raw little-endian data

Control messages (ABORT, SHUTDOWN, HEARTBEAT) are the header alone with an empty body.
Every length is bounded before anything is allocated (DESIGN rule 12); a malformed
buffer raises ``StepInputError``.

Version 2 added kv_group_windows, group_slot_mapping, group_block_tables, state_slots;
version 3 added prev_rows; version 4 added block_copies.
"""

from __future__ import annotations

import enum
import struct
import zlib
from dataclasses import dataclass
from typing import Any, Dict

import numpy as np

MAGIC = b"CVLS"
VERSION = 4
DEFAULT_MAX_BODY_BYTES = 1 << 30


class StepInputError(ValueError):
    """A StepInput or a message buffer is malformed; the message says what is wrong."""


class MessageKind(enum.IntEnum):
    STEP = 1
    ABORT = 2
    SHUTDOWN = 3
    HEARTBEAT = 4


_HEADER = struct.Struct("<4sHHQQI")
HEADER_SIZE = _HEADER.size
_COUNT = struct.Struct("<I")
_DESC = struct.Struct("<HBB")
_DIM = struct.Struct("<I")

_DTYPES = {1: np.dtype("<i4"), 2: np.dtype("<i8"), 3: np.dtype("<f4")}
I32, I64, F32 = _DTYPES[1], _DTYPES[2], _DTYPES[3]
"""The little-endian dtypes of the arrays on the wire."""
_DTYPE_CODES = {dt: code for code, dt in _DTYPES.items()}

# name id -> (field name, dtype, dims). The ids are the wire format: never reuse one.
STEP_FIELDS = {
    1: ("input_ids", I32, ("T",)),
    2: ("positions", I32, ("T",)),
    3: ("slot_mapping", I64, ("T",)),
    4: ("query_start_loc", I32, ("B+1",)),
    5: ("seq_lens", I32, ("B",)),
    6: ("block_tables", I32, ("B", "M")),
    7: ("logits_indices", I32, ("S",)),
    8: ("sample_rows", I32, ("S",)),
    9: ("temperature", F32, ("S",)),
    10: ("top_p", F32, ("S",)),
    11: ("top_k", I32, ("S",)),
    12: ("min_p", F32, ("S",)),
    13: ("presence_penalty", F32, ("S",)),
    14: ("frequency_penalty", F32, ("S",)),
    15: ("repetition_penalty", F32, ("S",)),
    16: ("has_seed", I32, ("S",)),
    17: ("seeds", I64, ("S",)),
    18: ("output_index", I32, ("S",)),
    19: ("kv_group_windows", I32, ("G",)),
    20: ("group_slot_mapping", I64, ("G-1", "T")),
    21: ("group_block_tables", I32, ("G-1", "B", "M")),
    22: ("state_slots", I32, ("B",)),
    23: ("prev_rows", I32, ("T",)),
    24: ("block_copies", I32, ("C", "2")),
}
"""The arrays of a STEP body, in wire order: ``StepInput`` has one field of each."""


@dataclass(frozen=True)
class MessageHeader:
    kind: MessageKind
    step_id: int
    body_len: int
    crc: int

    def pack(self) -> bytes:
        return _HEADER.pack(MAGIC, VERSION, int(self.kind), self.step_id, self.body_len, self.crc)

    @classmethod
    def unpack(cls, buf, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> "MessageHeader":
        """Parse and bound the first HEADER_SIZE bytes (a transport may read them alone)."""
        if len(buf) < HEADER_SIZE:
            raise StepInputError(
                f"message is {len(buf)} bytes, shorter than the {HEADER_SIZE}-byte header"
            )
        magic, version, kind, step_id, body_len, crc = _HEADER.unpack_from(buf, 0)
        if magic != MAGIC:
            raise StepInputError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
        if version != VERSION:
            raise StepInputError(f"unsupported wire version {version}, this build speaks {VERSION}")
        try:
            kind = MessageKind(kind)
        except ValueError:
            raise StepInputError(f"unknown message kind {kind}") from None
        if body_len > max_body_bytes:
            raise StepInputError(f"body of {body_len} bytes exceeds the limit of {max_body_bytes}")
        if kind != MessageKind.STEP and body_len != 0:
            raise StepInputError(
                f"{kind.name} message must have an empty body, got {body_len} bytes"
            )
        return cls(kind, step_id, body_len, crc)


def pack_message(kind: MessageKind, step_id: int, body: bytes = b"") -> bytes:
    """Header + ``body``: a whole message."""
    if not 0 <= step_id < 2**64:
        raise StepInputError(f"step_id {step_id} does not fit in u64")
    return MessageHeader(kind, step_id, len(body), zlib.crc32(body)).pack() + body


def checked_body(buf, max_body_bytes: int) -> tuple[MessageHeader, memoryview]:
    """The header and the body of a whole message, its length and crc32 checked."""
    header = MessageHeader.unpack(buf, max_body_bytes)
    if len(buf) != HEADER_SIZE + header.body_len:
        raise StepInputError(
            f"message is {len(buf)} bytes, header says {HEADER_SIZE + header.body_len} "
            "(truncated or trailing data)"
        )
    body = memoryview(buf)[HEADER_SIZE:]
    if zlib.crc32(body) != header.crc:
        raise StepInputError(f"crc32 mismatch in step {header.step_id}: body is corrupt")
    return header, body


@dataclass(frozen=True)
class ControlMessage:
    """ABORT, SHUTDOWN or HEARTBEAT: the header alone."""

    kind: MessageKind
    step_id: int = 0

    def pack(self) -> bytes:
        if self.kind == MessageKind.STEP:
            raise StepInputError("a STEP message is a StepInput, not a ControlMessage")
        return pack_message(self.kind, self.step_id)

    @classmethod
    def unpack(cls, buf, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> "ControlMessage":
        header, _ = checked_body(buf, max_body_bytes)
        if header.kind == MessageKind.STEP:
            raise StepInputError("expected a control message, got STEP")
        return cls(header.kind, header.step_id)


def encode_arrays(step: Any) -> bytes:
    """A STEP body: every array of ``STEP_FIELDS``, read from ``step``'s fields."""
    parts = [_COUNT.pack(len(STEP_FIELDS))]
    for fid, (name, dtype, _) in STEP_FIELDS.items():
        arr = np.ascontiguousarray(getattr(step, name))
        parts.append(_DESC.pack(fid, _DTYPE_CODES[dtype], arr.ndim))
        parts.extend(_DIM.pack(d) for d in arr.shape)
        parts.append(arr.tobytes())
    return b"".join(parts)


class _Reader:
    """Bounded reads from a body: every read checks the bytes are there first."""

    def __init__(self, body: memoryview) -> None:
        self.body, self.offset = body, 0

    def take(self, n: int, what: str) -> memoryview:
        if n > len(self.body) - self.offset:
            raise StepInputError(
                f"body truncated reading {what}: need {n} bytes at offset {self.offset}"
            )
        view = self.body[self.offset:self.offset + n]
        self.offset += n
        return view

    def unpack(self, st: struct.Struct, what: str) -> tuple:
        return st.unpack(self.take(st.size, what))


def decode_arrays(body: memoryview) -> Dict[str, np.ndarray]:
    """A STEP body's arrays by field name, each bounded, typed and shaped as declared."""
    reader = _Reader(body)
    (count,) = reader.unpack(_COUNT, "array count")
    if count != len(STEP_FIELDS):
        raise StepInputError(f"STEP body has {count} arrays, expected {len(STEP_FIELDS)}")
    arrays: Dict[str, np.ndarray] = {}
    for _ in range(count):
        fid, code, ndim = reader.unpack(_DESC, "array descriptor")
        if fid not in STEP_FIELDS:
            raise StepInputError(f"unknown array name id {fid}")
        name, dtype, dims = STEP_FIELDS[fid]
        if name in arrays:
            raise StepInputError(f"array {name} appears twice")
        if _DTYPES.get(code) != dtype:
            raise StepInputError(
                f"array {name} has dtype code {code}, expected {_DTYPE_CODES[dtype]}"
            )
        if ndim != len(dims):
            raise StepInputError(f"array {name} has ndim {ndim}, expected {len(dims)}")
        shape = tuple(reader.unpack(_DIM, f"{name} shape")[0] for _ in range(ndim))
        count_items = int(np.prod(shape, dtype=object)) if shape else 1
        data = reader.take(count_items * dtype.itemsize, f"{name} data")  # bounded before copying
        arrays[name] = np.frombuffer(data, dtype=dtype).reshape(shape).copy()
    if reader.offset != len(body):
        raise StepInputError(f"{len(body) - reader.offset} bytes of trailing data in STEP body")
    return arrays
