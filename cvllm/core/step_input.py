"""The wire contract between ranks: one scheduled step as flat little-endian arrays.

``build_step_input`` runs on rank 0 right after ``Scheduler.schedule()`` and builds a
``StepInput`` from the ``SchedulerOutput``. ``distributed/`` broadcasts ``pack()``'s bytes;
every other rank ``unpack()``s them, checks ``step_id`` and hands the ``StepInput`` to its
``ModelRunner``, which owns it for that one step (rank 0 keeps its own copy). Only rank 0
samples, but all ranks receive the sampling rows: they are small, and a rank that takes
over sampling later needs no new wire format.

Wire format (version 1), never pickle:

    header  <4s H H Q Q I>: magic b"CVLS", version, kind, step_id, body length, crc32(body)
    body    (STEP only) u32 array count, then per array:
            <H B B> name id, dtype code, ndim;  ndim x u32 dims;  raw little-endian data

Control messages (ABORT, SHUTDOWN, HEARTBEAT) are the header alone with an empty body.
Every length is bounded before anything is allocated (DESIGN rule 12); a malformed
buffer raises ``StepInputError``.

Shapes: T tokens in the step, B sequences, S sampling rows (sequences whose logits are
sampled this step), M max blocks of any sequence in the step.
"""

from __future__ import annotations

import enum
import itertools
import struct
import zlib
from dataclasses import dataclass
from typing import Dict, Optional, Union

import numpy as np

from cvllm.core.scheduler import SchedulerOutput

MAGIC = b"CVLS"
VERSION = 1
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
_I32, _I64, _F32 = _DTYPES[1], _DTYPES[2], _DTYPES[3]
_DTYPE_CODES = {dt: code for code, dt in _DTYPES.items()}

# name id -> (field name, dtype, dims). The ids are the wire format: never reuse one.
_FIELDS = {
    1: ("input_ids", _I32, ("T",)),
    2: ("positions", _I32, ("T",)),
    3: ("slot_mapping", _I64, ("T",)),
    4: ("query_start_loc", _I32, ("B+1",)),
    5: ("seq_lens", _I32, ("B",)),
    6: ("block_tables", _I32, ("B", "M")),
    7: ("logits_indices", _I32, ("S",)),
    8: ("sample_rows", _I32, ("S",)),
    9: ("temperature", _F32, ("S",)),
    10: ("top_p", _F32, ("S",)),
    11: ("top_k", _I32, ("S",)),
    12: ("min_p", _F32, ("S",)),
    13: ("presence_penalty", _F32, ("S",)),
    14: ("frequency_penalty", _F32, ("S",)),
    15: ("repetition_penalty", _F32, ("S",)),
    16: ("has_seed", _I32, ("S",)),
    17: ("seeds", _I64, ("S",)),
    18: ("output_index", _I32, ("S",)),
}
_FIELD_IDS = {name: fid for fid, (name, _, _) in _FIELDS.items()}
SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "has_seed", "seeds", "output_index",
)
"""The per-row values ``_sampling_arrays`` fills from each sequence's SamplingParams."""


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


def _pack_message(kind: MessageKind, step_id: int, body: bytes = b"") -> bytes:
    if not 0 <= step_id < 2**64:
        raise StepInputError(f"step_id {step_id} does not fit in u64")
    return MessageHeader(kind, step_id, len(body), zlib.crc32(body)).pack() + body


def _checked_body(buf, max_body_bytes: int) -> tuple[MessageHeader, memoryview]:
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
        return _pack_message(self.kind, self.step_id)

    @classmethod
    def unpack(cls, buf, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> "ControlMessage":
        header, _ = _checked_body(buf, max_body_bytes)
        if header.kind == MessageKind.STEP:
            raise StepInputError("expected a control message, got STEP")
        return cls(header.kind, header.step_id)


def unpack_message(
    buf, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
) -> Union["StepInput", ControlMessage]:
    """Dispatch on the header kind: a STEP gives a StepInput, anything else a ControlMessage."""
    if MessageHeader.unpack(buf, max_body_bytes).kind == MessageKind.STEP:
        return StepInput.unpack(buf, max_body_bytes)
    return ControlMessage.unpack(buf, max_body_bytes)


@dataclass(eq=False)
class StepInput:
    step_id: int
    input_ids: np.ndarray  # [T] int32
    positions: np.ndarray  # [T] int32
    slot_mapping: np.ndarray  # [T] int64, block_id * block_size + offset
    query_start_loc: np.ndarray  # [B+1] int32
    seq_lens: np.ndarray  # [B] int32, context length after this step
    block_tables: np.ndarray  # [B, M] int32, 0-padded past each sequence's blocks
    logits_indices: np.ndarray  # [S] int32, index in T of each sampling row's last token
    sample_rows: np.ndarray  # [S] int32, which of the B sequences
    temperature: np.ndarray  # [S] float32
    top_p: np.ndarray  # [S] float32
    top_k: np.ndarray  # [S] int32, -1 = off
    min_p: np.ndarray  # [S] float32
    presence_penalty: np.ndarray  # [S] float32
    frequency_penalty: np.ndarray  # [S] float32
    repetition_penalty: np.ndarray  # [S] float32
    has_seed: np.ndarray  # [S] int32, 0/1: whether seeds[i] is set
    seeds: np.ndarray  # [S] int64, any int64 is a valid seed
    output_index: np.ndarray  # [S] int32, tokens the sequence generated before this step

    # ----- shape helpers ---------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_samples(self) -> int:
        return int(self.logits_indices.shape[0])

    @property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.query_start_loc)  # [B]

    @property
    def max_query_len(self) -> int:
        return int(self.query_lens.max()) if self.num_seqs else 0

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens.max()) if self.num_seqs else 0

    def arrays(self) -> Dict[str, np.ndarray]:
        return {name: getattr(self, name) for name, _, _ in _FIELDS.values()}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StepInput) or self.step_id != other.step_id:
            return False
        mine, theirs = self.arrays(), other.arrays()
        return all(
            mine[k].dtype == theirs[k].dtype and mine[k].shape == theirs[k].shape
            and np.array_equal(mine[k], theirs[k]) for k in mine
        )

    @classmethod
    def empty(cls, step_id: int = 0) -> "StepInput":
        """A step with no sequences (B = T = S = 0)."""
        arrays = {name: np.zeros(0, dt) for name, dt, _ in _FIELDS.values()}
        arrays["query_start_loc"] = np.zeros(1, _I32)
        arrays["block_tables"] = np.zeros((0, 0), _I32)
        return cls(step_id=step_id, **arrays)

    # ----- validation ------------------------------------------------------------------

    def validate(self, block_size: Optional[int] = None, num_blocks: Optional[int] = None) -> None:
        """Check dtypes, shapes and the invariants the runner relies on.

        With ``block_size`` (and ``num_blocks``) it also checks that every slot lies in
        the block its sequence's block table names, inside the cache.
        """
        self._validate_layout()
        self._validate_batch()
        self._validate_sampling()
        if block_size is not None:
            self._validate_slots(block_size, num_blocks)

    def _validate_layout(self) -> None:
        if not 0 <= self.step_id < 2**64:
            raise StepInputError(f"step_id {self.step_id} does not fit in u64")
        T, B, S = self.num_tokens, self.num_seqs, self.num_samples
        for name, dtype, dims in _FIELDS.values():
            arr = getattr(self, name)
            if not isinstance(arr, np.ndarray) or arr.dtype != dtype:
                got = getattr(arr, "dtype", type(arr).__name__)
                raise StepInputError(f"{name} must be a {dtype} array, got {got}")
            sizes = {"T": T, "B": B, "S": S, "B+1": B + 1, "M": arr.shape[-1] if arr.ndim else -1}
            want = tuple(sizes[d] for d in dims)
            if arr.shape != want:
                raise StepInputError(
                    f"{name} has shape {arr.shape}, expected {want} (T={T}, B={B}, S={S})"
                )

    def _validate_batch(self) -> None:
        qsl, T = self.query_start_loc, self.num_tokens
        if qsl[0] != 0 or qsl[-1] != T:
            raise StepInputError(
                f"query_start_loc must run from 0 to T={T}, got {qsl[0]}..{qsl[-1]}"
            )
        query_lens = self.query_lens
        if (query_lens < 1).any():
            raise StepInputError(
                "query_start_loc must be strictly increasing (every sequence computes >= 1 token)"
            )
        if (self.seq_lens < query_lens).any():
            raise StepInputError("seq_lens must be >= the query length of each sequence")
        # Each sequence's new tokens sit at positions [seq_len - query_len, seq_len).
        starts = np.repeat(self.seq_lens - query_lens, query_lens)
        offsets = np.arange(T) - np.repeat(qsl[:-1], query_lens)
        if not np.array_equal(self.positions, starts + offsets):
            raise StepInputError("positions do not match query_start_loc and seq_lens")
        if (self.slot_mapping < 0).any():
            raise StepInputError("slot_mapping must be non-negative")
        if (self.block_tables < 0).any():
            raise StepInputError("block_tables must be non-negative")

    def _validate_sampling(self) -> None:
        rows, B = self.sample_rows, self.num_seqs
        if ((rows < 0) | (rows >= B)).any() or (np.diff(rows) <= 0).any():
            raise StepInputError(f"sample_rows must be strictly increasing indices in [0, {B})")
        if not np.array_equal(self.logits_indices, self.query_start_loc[rows + 1] - 1):
            raise StepInputError("logits_indices must point at the last token of each sampled row")
        floats = [getattr(self, n) for n in SAMPLING_FIELDS if getattr(self, n).dtype == _F32]
        if not all(np.isfinite(a).all() for a in floats):
            raise StepInputError("sampling values must be finite")
        checks = [
            ("temperature", (self.temperature >= 0).all()),
            ("top_p", ((self.top_p > 0) & (self.top_p <= 1)).all()),
            ("top_k", ((self.top_k == -1) | (self.top_k >= 1)).all()),
            ("min_p", ((self.min_p >= 0) & (self.min_p <= 1)).all()),
            ("repetition_penalty", (self.repetition_penalty > 0).all()),
            ("has_seed", np.isin(self.has_seed, (0, 1)).all()),
            ("output_index", (self.output_index >= 0).all()),
        ]
        for name, ok in checks:
            if not ok:
                raise StepInputError(f"{name} has an out-of-range value")

    def _validate_slots(self, block_size: int, num_blocks: Optional[int]) -> None:
        M = self.block_tables.shape[1]
        if self.num_seqs and -(-self.max_seq_len // block_size) > M:
            raise StepInputError(
                f"block_tables has {M} columns, too few for seq_len {self.max_seq_len}"
            )
        if num_blocks is not None and (self.block_tables >= num_blocks).any():
            raise StepInputError(f"block_tables names a block >= num_blocks={num_blocks}")
        seq_idx = np.repeat(np.arange(self.num_seqs), self.query_lens)  # [T]
        pos = self.positions.astype(np.int64)
        blocks = self.block_tables[seq_idx, pos // block_size].astype(np.int64)
        if not np.array_equal(self.slot_mapping, blocks * block_size + pos % block_size):
            raise StepInputError("slot_mapping does not match block_tables and positions")

    # ----- wire ------------------------------------------------------------------------

    def pack(self) -> bytes:
        self.validate()
        parts = [_COUNT.pack(len(_FIELDS))]
        for fid, (name, dtype, _) in _FIELDS.items():
            arr = np.ascontiguousarray(getattr(self, name))
            parts.append(_DESC.pack(fid, _DTYPE_CODES[dtype], arr.ndim))
            parts.extend(_DIM.pack(d) for d in arr.shape)
            parts.append(arr.tobytes())
        return _pack_message(MessageKind.STEP, self.step_id, b"".join(parts))

    @classmethod
    def unpack(cls, buf, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> "StepInput":
        header, body = _checked_body(buf, max_body_bytes)
        if header.kind != MessageKind.STEP:
            raise StepInputError(f"expected a STEP message, got {header.kind.name}")
        arrays = _parse_arrays(body)
        step = cls(step_id=header.step_id, **arrays)
        step.validate()
        return step


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


def _parse_arrays(body: memoryview) -> Dict[str, np.ndarray]:
    reader = _Reader(body)
    (count,) = reader.unpack(_COUNT, "array count")
    if count != len(_FIELDS):
        raise StepInputError(f"STEP body has {count} arrays, expected {len(_FIELDS)}")
    arrays: Dict[str, np.ndarray] = {}
    for _ in range(count):
        fid, code, ndim = reader.unpack(_DESC, "array descriptor")
        if fid not in _FIELDS:
            raise StepInputError(f"unknown array name id {fid}")
        name, dtype, dims = _FIELDS[fid]
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


def build_step_input(out: SchedulerOutput, block_size: int) -> StepInput:
    """Flatten a SchedulerOutput into the arrays every rank runs (rank 0 only)."""
    entries = out.scheduled
    B = len(entries)
    if B == 0:
        return StepInput.empty(out.step_id)
    query_lens = np.fromiter((e.num_new_tokens for e in entries), np.int64, B)  # [B]
    computed = np.fromiter((e.seq.num_computed_tokens for e in entries), np.int64, B)  # [B]
    seq_lens = computed + query_lens  # [B]
    query_start_loc = np.zeros(B + 1, np.int64)  # [B+1]
    np.cumsum(query_lens, out=query_start_loc[1:])
    T = int(query_start_loc[-1])

    M = max(len(e.seq.block_ids) for e in entries)
    block_tables = np.zeros((B, M), _I32)  # [B, M]
    for i, e in enumerate(entries):
        if len(e.seq.block_ids) * block_size < seq_lens[i]:
            raise ValueError(f"{e.seq!r} has too few blocks for {seq_lens[i]} tokens")
        block_tables[i, :len(e.seq.block_ids)] = e.seq.block_ids

    input_ids = np.fromiter(
        itertools.chain.from_iterable(
            e.seq.token_ids[e.seq.num_computed_tokens:e.seq.num_computed_tokens + e.num_new_tokens]
            for e in entries
        ),
        _I32,
        T,
    )  # [T]
    seq_idx = np.repeat(np.arange(B), query_lens)  # [T]
    offsets = np.arange(T) - np.repeat(query_start_loc[:-1], query_lens)  # [T] index in its query
    positions = np.repeat(computed, query_lens) + offsets  # [T]
    blocks = block_tables[seq_idx, positions // block_size].astype(_I64)  # [T]
    slot_mapping = blocks * block_size + positions % block_size  # [T]

    rows = [i for i, e in enumerate(entries) if e.samples]
    sampled = [entries[i].seq for i in rows]
    rows_arr = np.asarray(rows, _I32)  # [S]
    return StepInput(
        step_id=out.step_id,
        input_ids=input_ids,
        positions=positions.astype(_I32),
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc.astype(_I32),
        seq_lens=seq_lens.astype(_I32),
        block_tables=block_tables,
        logits_indices=(query_start_loc[rows_arr + 1] - 1).astype(_I32),
        sample_rows=rows_arr,
        **_sampling_arrays(sampled),
    )


def _sampling_arrays(seqs) -> Dict[str, np.ndarray]:
    """Per-sampling-row values from each sequence's SamplingParams."""
    params = [s.params for s in seqs]
    return {
        "temperature": np.asarray([p.temperature for p in params], _F32),
        "top_p": np.asarray([p.top_p for p in params], _F32),
        "top_k": np.asarray([p.top_k for p in params], _I32),
        "min_p": np.asarray([p.min_p for p in params], _F32),
        "presence_penalty": np.asarray([p.presence_penalty for p in params], _F32),
        "frequency_penalty": np.asarray([p.frequency_penalty for p in params], _F32),
        "repetition_penalty": np.asarray([p.repetition_penalty for p in params], _F32),
        "has_seed": np.asarray([p.seed is not None for p in params], _I32),
        "seeds": np.asarray([p.seed or 0 for p in params], _I64),
        "output_index": np.asarray([s.num_output_tokens for s in seqs], _I32),
    }
