"""A bounded parse of a GGUF file's header, run before ``gguf.GGUFReader`` trusts it.

Built by ``gguf_loader.open_gguf`` on whichever rank opens the file, and thrown away once
the reader exists: it only proves the header can be trusted. gguf-py believes every count
and length it reads (an array length of 2^60 loops for ever), and fails on an unknown type
id or a shape that is not whole blocks with no tensor name in the message. This parse walks
the same bytes with every length checked against the bytes left before it is used, skips
the metadata values without decoding them (a 49k-token vocabulary costs tens of ms), and
raises a ModelLoadError naming the first bad tensor (or key), its type and what is wrong.

Layout (all little-endian unless the version reads byte-swapped, as gguf-py detects it):
magic, u32 version, u64 tensor count, u64 key count; per key: string key, u32 value type,
value; per tensor: string name, u32 n_dims, u64 dims[n_dims] (innermost first), u32 type
id, u64 offset (from the data section, which starts at the header's end rounded up to
``general.alignment``). A string is a u64 length and its bytes. No torch here.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ..kernels.quant.ggml_types import BLOCK_SHAPES, GgmlType
from .errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
MIN_GGUF_BYTES = 24  # magic, version, tensor count, key count
_VERSIONS = (2, 3)  # what gguf-py reads; version 1 had 32-bit counts
_DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 4  # GGML_MAX_DIMS
# Keys and tensor names are short (llama.cpp caps names at 64 bytes); a longer one is
# garbage, refused before it is copied out of the map.
_MAX_KEY_BYTES = 1 << 16
_MAX_NAME_BYTES = 1 << 16
_MAX_ARRAY_DEPTH = 8  # gguf-py nests arrays; llama.cpp writes none nested

_STRING, _ARRAY, _UINT32 = 8, 9, 4
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, the smallest value
_MIN_TENSOR_BYTES = 8 + 4 + 4 + 8  # name length, n_dims, type id, offset
_KNOWN: Optional[Dict[int, Tuple[int, int]]] = None  # built by _known_types on first use


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor-info entry. ``dims`` in GGUF order (innermost first); ``start`` and
    ``end`` are absolute byte offsets of its data in the file."""

    name: str
    ggml_type: int
    dims: Tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class GGUFHeader:
    """What the header says, checked: every tensor's data lies inside the file."""

    version: int
    alignment: int
    data_offset: int
    tensors: Tuple[GGUFTensorInfo, ...]


_Info = Tuple[str, int, Tuple[int, ...], int, int]  # name, type id, dims, offset, n_bytes


class _Bad(Exception):
    """A header fault; ``read_gguf_header`` prefixes the path and raises ModelLoadError."""


class _Cursor:
    """Reads forward through the map; every read is checked against the file's end."""

    def __init__(self, buf: mmap.mmap, size: int) -> None:
        self.buf, self.size, self.pos, self.order = buf, size, 0, "<"

    def take(self, n: int, what: str) -> int:
        """Start of the next ``n`` bytes, or _Bad when the file ends first."""
        if n > self.size - self.pos:
            raise _Bad(f"{what} at byte {self.pos} needs {n} bytes but the file has "
                       f"{self.size}; the file is truncated or corrupt")
        start, self.pos = self.pos, self.pos + n
        return start

    def uint(self, code: str, what: str) -> int:
        start = self.take(struct.calcsize(code), what)
        return struct.unpack_from(self.order + code, self.buf, start)[0]

    def text(self, what: str, limit: int) -> str:
        n = self.uint("Q", f"the length of {what}")
        if n > limit:
            raise _Bad(f"{what} at byte {self.pos - 8} has a length of {n} bytes (at most {limit});"
                       " the file is corrupt")
        start = self.take(n, what)
        try:
            return self.buf[start:start + n].decode("utf-8")
        except UnicodeDecodeError:
            raise _Bad(f"{what} at byte {start} is not UTF-8; the file is corrupt") from None

    def count(self, n: int, min_bytes: int, what: str) -> int:
        """``n`` after checking that ``n`` items of ``min_bytes`` each fit in the bytes
        left, so a garbage count fails here instead of driving a loop or an allocation."""
        if n * min_bytes > self.size - self.pos:
            raise _Bad(f"{what} is {n}, but only {self.size - self.pos} bytes follow at byte "
                       f"{self.pos}; the file is truncated or corrupt")
        return n

    def skip_strings(self, n: int, what: str) -> None:
        # The hot loop of a vocabulary (~10^5 strings): locals, no per-string method call.
        buf, pos, size = self.buf, self.pos, self.size
        unpack = struct.Struct(self.order + "Q").unpack_from
        for _ in range(self.count(n, 8, f"the length of {what}")):
            if pos + 8 > size:
                break
            pos += 8 + unpack(buf, pos)[0]
        else:
            if pos <= size:
                self.pos = pos
                return
        raise _Bad(f"{what} runs past the file's end of {size} bytes; the file is truncated "
                   "or corrupt")


def read_gguf_header(path: Path) -> GGUFHeader:
    """The checked header of ``path``; ModelLoadError naming the file and the first bad
    tensor (or key) when anything in it is out of bounds or inconsistent."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        magic = f.read(4)
        if size < MIN_GGUF_BYTES or magic != GGUF_MAGIC:
            raise ModelLoadError(f"{path} is not a GGUF file (starts with {magic!r}, "
                                 f"expected {GGUF_MAGIC!r}; {size} bytes)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            try:
                return _parse(_Cursor(buf, size))
            except _Bad as e:
                raise ModelLoadError(f"{path}: {e}") from None


def _parse(cur: _Cursor) -> GGUFHeader:
    cur.take(4, "the magic")
    version = cur.uint("I", "the version")
    if version & 0xFFFF == 0:
        # Written on a big-endian host: gguf-py reads it byte-swapped, so do we.
        cur.order = ">"
        version = struct.unpack_from(">I", cur.buf, 4)[0]
    if version not in _VERSIONS:
        raise _Bad(f"GGUF version {version} is not supported (only {_VERSIONS})")
    n_tensors = cur.uint("Q", "the tensor count")
    n_kv = cur.count(cur.uint("Q", "the key count"), _MIN_KV_BYTES, "the key count")
    alignment = _skip_metadata(cur, n_kv)
    cur.count(n_tensors, _MIN_TENSOR_BYTES, "the tensor count")
    infos: List[_Info] = []
    seen: Dict[str, int] = {}
    for i in range(n_tensors):
        info = _tensor_info(cur, i, alignment)
        if info[0] in seen:
            raise _Bad(f"tensor {info[0]!r} is listed twice (entries {seen[info[0]]} and {i}); "
                       "the file is corrupt")
        seen[info[0]] = i
        infos.append(info)
    data_offset = -(-cur.pos // alignment) * alignment
    tensors = tuple(GGUFTensorInfo(name, t, dims, data_offset + off, data_offset + off + n)
                    for name, t, dims, off, n in infos)
    _check_ranges(tensors, cur.size)
    return GGUFHeader(version, alignment, data_offset, tensors)


def _skip_metadata(cur: _Cursor, n_kv: int) -> int:
    """Walk the key/value pairs without decoding the values; the data alignment."""
    alignment, keys = _DEFAULT_ALIGNMENT, set()
    for i in range(n_kv):
        key = cur.text(f"metadata key {i}", _MAX_KEY_BYTES)
        if key in keys:
            raise _Bad(f"metadata key {key!r} appears twice; the file is corrupt")
        keys.add(key)
        vtype = cur.uint("I", f"the type of metadata key {key!r}")
        if key == "general.alignment":
            if vtype != _UINT32:
                raise _Bad(f"general.alignment has value type {vtype}, expected uint32")
            alignment = cur.uint("I", "general.alignment")
            if alignment == 0 or alignment & (alignment - 1):
                raise _Bad(f"general.alignment is {alignment}, not a power of two")
        else:
            _skip_value(cur, vtype, key, 0)
    return alignment


def _skip_value(cur: _Cursor, vtype: int, key: str, depth: int) -> None:
    if vtype in _SCALAR_BYTES:
        cur.take(_SCALAR_BYTES[vtype], f"the value of {key!r}")
    elif vtype == _STRING:
        cur.take(cur.uint("Q", f"the length of {key!r}"), f"the value of {key!r}")
    elif vtype == _ARRAY and depth < _MAX_ARRAY_DEPTH:
        itype = cur.uint("I", f"the item type of {key!r}")
        n = cur.uint("Q", f"the length of {key!r}")
        what = f"the array {key!r}"
        if itype in _SCALAR_BYTES:
            cur.take(cur.count(n, _SCALAR_BYTES[itype], f"the length of {what}")
                     * _SCALAR_BYTES[itype], what)
        elif itype == _STRING:
            cur.skip_strings(n, what)
        elif itype == _ARRAY:
            for _ in range(cur.count(n, 12, f"the length of {what}")):  # item type + length
                _skip_value(cur, _ARRAY, key, depth + 1)
        else:
            raise _Bad(f"{what} has items of unknown value type {itype}; the file is corrupt")
    elif vtype == _ARRAY:
        raise _Bad(f"metadata key {key!r} nests arrays deeper than {_MAX_ARRAY_DEPTH}")
    else:
        raise _Bad(f"metadata key {key!r} has unknown value type {vtype}; the file is corrupt")


def _tensor_info(cur: _Cursor, i: int, alignment: int) -> _Info:
    """``(name, type id, dims, offset, n_bytes)`` of tensor-info entry ``i``, checked."""
    name = cur.text(f"the name of tensor {i}", _MAX_NAME_BYTES)
    n_dims = cur.uint("I", f"the dimension count of tensor {name!r}")
    if n_dims > _MAX_DIMS:
        raise _Bad(f"tensor {name!r} has {n_dims} dimensions (at most {_MAX_DIMS}); "
                   "the file is corrupt")
    dims = struct.unpack_from(f"{cur.order}{n_dims}Q", cur.buf,
                              cur.take(8 * n_dims, f"the shape of tensor {name!r}"))
    type_id = cur.uint("I", f"the type of tensor {name!r}")
    offset = cur.uint("Q", f"the offset of tensor {name!r}")
    shape = list(reversed(dims))  # as HF and the rest of cvllm write it, outermost first
    if type_id not in _known_types():
        raise _Bad(f"tensor {name!r} (shape {shape}) has unknown GGML type id {type_id}; "
                   "the file is corrupt or newer than this cvllm")
    tname = _type_name(type_id)
    block, block_bytes = _known_types()[type_id]
    if 0 in dims:
        raise _Bad(f"tensor {name!r} ({tname}) has an empty shape {shape}; the file is corrupt")
    if dims and dims[0] % block:
        raise _Bad(f"tensor {name!r} ({tname}, shape {shape}): {dims[0]} columns are not a "
                   f"multiple of the {tname} block of {block}; the file is corrupt")
    if offset % alignment:
        raise _Bad(f"tensor {name!r} ({tname}, shape {shape}): offset {offset} is not a "
                   f"multiple of the alignment {alignment}; the file is corrupt")
    n_elems = 1
    for d in dims:
        n_elems *= d
    return name, type_id, dims, offset, n_elems // block * block_bytes


def _check_ranges(tensors: Tuple[GGUFTensorInfo, ...], size: int) -> None:
    """Every tensor's data inside the file, and no two overlapping (a shape patched larger
    than the bytes written for it runs into its neighbour)."""
    for t in tensors:
        if t.end > size:
            raise _Bad(f"tensor {_describe(t)}: data [{t.start}, {t.end}) is past the file's end "
                       f"of {size} bytes; the file is truncated or its header is corrupt "
                       "(re-download it)")
    ordered = sorted(tensors, key=lambda t: t.start)
    for a, b in zip(ordered, ordered[1:]):
        if a.end > b.start:
            raise _Bad(f"tensor {_describe(a)}: data [{a.start}, {a.end}) overlaps tensor "
                       f"{b.name!r} at [{b.start}, {b.end}); the header's sizes do not add up "
                       "(the file is corrupt)")


def _describe(t: GGUFTensorInfo) -> str:
    return f"{t.name!r} ({_type_name(t.ggml_type)}, shape {list(reversed(t.dims))})"


def _type_name(type_id: int) -> str:
    try:
        return GgmlType(type_id).name
    except ValueError:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(type_id).name


def _known_types() -> Dict[int, Tuple[int, int]]:
    """``type id -> (block elems, block bytes)``: cvllm's table, plus the types gguf-py
    knows and cvllm does not (it reads them; the quantization config decides later)."""
    global _KNOWN
    if _KNOWN is None:
        from gguf import GGML_QUANT_SIZES

        known = {int(t): shape for t, shape in GGML_QUANT_SIZES.items()}
        known.update({int(t): shape for t, shape in BLOCK_SHAPES.items()})
        _KNOWN = known
    return _KNOWN

