"""Reading GGUF files: validation, metadata, and dequantized weights under HF names.

``open_gguf`` memory-maps the file with ``gguf.GGUFReader`` after a bounded parse of its
header (``gguf_header.py``: every length checked, the first bad tensor named), and checks
every tensor's byte range against the file size; any failure is a ModelLoadError naming
the file. The reader of the last file opened is kept, because parsing a GGUF's
metadata (a 49k-token vocabulary) takes seconds and config and weights both need it.

``iter_gguf_weights`` yields lazy tensors (``lazy.LazyTensor``), float32 in HF layout
once read: ``gguf.quants.dequantize`` returns row-major ``[out, in]`` arrays (GGUF lists
dims innermost first), and for archs whose converter permutes Q/K rows the permutation is
undone (and for Gemma the +1 it folds into norm weights is taken out again). A rank that
narrows a tensor to its shard dequantizes only that part from the memory map when it is
made of whole quantization blocks, else the whole tensor (``read_gguf_part``).
Each lazy tensor of a GGUF also carries its GGML type and ``read_raw`` (``read_gguf_raw``:
the part's bytes as stored, Q/K rows un-permuted the same way), which a quantized
parameter reads instead of floats; ``gguf_tensor_types`` gives every tensor's type by its
HF name before the model exists (the quantization config is built from it).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Tuple

import numpy as np
import torch

from .errors import ModelLoadError
from .gguf_config import gguf_architecture, gguf_to_hf_config
from .gguf_header import read_gguf_header
from .gguf_names import get_arch, hf_tensor_name, unpermute_qk
from .lazy import LazyTensor, Ranges, record_materialized
from .progress import progress

_MAX_DIMS = 4  # ggml tensors have at most 4 dims

_cache_lock = threading.Lock()
_cached: Optional[Tuple[Tuple[str, int, int], Any]] = None


def _file_key(path: Path) -> Tuple[str, int, int]:
    st = path.stat()
    return (str(path.resolve()), st.st_size, st.st_mtime_ns)


def open_gguf(path: Path) -> Any:
    """A validated ``gguf.GGUFReader`` for ``path`` (cached for the last file opened)."""
    global _cached
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist" if not path.exists()
                             else f"{path} is not a file")
    key = _file_key(path)
    with _cache_lock:
        if _cached is not None and _cached[0] == key:
            return _cached[1]
        reader = _read(path, key[1])
        _cached = (key, reader)
        return reader


def clear_gguf_cache() -> None:
    """Drop the cached reader (and its memory map), e.g. once weights are loaded."""
    global _cached
    with _cache_lock:
        _cached = None


def _read(path: Path, size: int) -> Any:
    # gguf-py believes the header: a garbage length loops or allocates for ever, and an
    # unknown type id or a shape that is not whole blocks fails without the tensor's name.
    # The bounded parse (tens of ms next to the reader's second) names what is wrong first.
    read_gguf_header(path)
    try:
        reader = _reader_class()(path)
    except (ValueError, KeyError, IndexError, OverflowError, UnicodeDecodeError) as e:
        # Left to the reader are faults the header parse cannot see (it does not decode
        # values), so this is a corrupt file, said without a tensor name.
        raise ModelLoadError(f"{path} is truncated or corrupt; cannot read it as GGUF ({e})") from e
    _check_tensors(path, reader, size)
    return reader


def _reader_class() -> type:
    from gguf import GGUFReader

    class FastGGUFReader(GGUFReader):
        """GGUFReader over a plain ndarray view of its memory map. Slicing an ``np.memmap``
        runs Python hooks on every slice, and parsing a 49k-token vocabulary slices ~10^6
        times: the plain view makes opening a file about 3x faster. The view keeps the map
        alive, and the data stays read-only."""

        @property
        def data(self) -> np.ndarray:
            return self._data

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    return FastGGUFReader


def _check_tensors(path: Path, reader: Any, size: int) -> None:
    for t in reader.tensors:
        if len(t.shape) > _MAX_DIMS or any(int(d) <= 0 for d in t.shape):
            raise ModelLoadError(f"{path}: tensor {t.name!r} has a bad shape {list(t.shape)}")
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise ModelLoadError(f"{path}: tensor {t.name!r} ends at byte {end} but the file has "
                                 f"{size} bytes; the file is truncated (re-download it)")


def gguf_config(path: Path) -> dict:
    """HF-style config dict of a GGUF file."""
    return gguf_to_hf_config(open_gguf(path))


def dequantize_tensor(t: Any) -> torch.Tensor:
    """One reader tensor as float32 in HF (row-major, outermost dim first) shape."""
    arr = _dequantize(t, t.data)
    want = _hf_shape(t)
    if tuple(arr.shape) != want:
        # 1-D (norm) tensors come back flat either way; anything else must match.
        if int(np.prod(arr.shape)) != int(np.prod(want)):
            raise ModelLoadError(f"GGUF tensor {t.name!r}: dequantized shape {arr.shape} != {want}")
        arr = arr.reshape(want)
    out = _to_tensor(arr)
    record_materialized(out.numel() * 4)
    return out


def _hf_shape(t: Any) -> Tuple[int, ...]:
    return tuple(int(d) for d in reversed(t.shape))


def _dequantize(t: Any, data: np.ndarray) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        return dequantize(data, t.tensor_type)
    except NotImplementedError as e:
        raise ModelLoadError(f"GGUF tensor {t.name!r} has type {t.tensor_type.name}, "
                             "which cvllm cannot dequantize") from e


def _to_tensor(arr: np.ndarray) -> torch.Tensor:
    if arr.dtype != np.float32:
        arr = arr.astype(np.float32)
    elif not arr.flags.writeable or not arr.flags.c_contiguous:
        # F32 tensors are views of the read-only memory map; torch needs its own copy.
        arr = np.ascontiguousarray(arr).copy()
    return torch.from_numpy(arr)


def _block_slice(t: Any, ranges: Ranges) -> Optional[Tuple[slice, ...]]:
    """The index of ``t.data`` holding exactly ``ranges`` of the HF-shaped tensor, or None
    when the part is not made of whole quantization blocks. ``t.data`` is ``[..., row
    bytes]`` (quantized: each row a run of blocks) or ``[..., cols]`` (plain types), its
    leading dims the HF ones; rows are always whole blocks, a column range only when it
    starts and ends on a block boundary."""
    from gguf import GGML_QUANT_SIZES

    data, shape = t.data, _hf_shape(t)
    if tuple(data.shape[:-1]) != shape[:-1] or not shape:
        return None
    (c0, n), cols = ranges[-1], shape[-1]
    if data.shape[-1] == cols:  # one element per column (F32, F16)
        last = slice(c0, c0 + n)
    else:
        block, type_size = GGML_QUANT_SIZES[t.tensor_type]
        if data.shape[-1] * block != cols * type_size or c0 % block or n % block:
            return None
        last = slice(c0 // block * type_size, (c0 + n) // block * type_size)
    return tuple(slice(s, s + k) for s, k in ranges[:-1]) + (last,)


def read_gguf_part(t: Any, ranges: Ranges) -> torch.Tensor:
    """``ranges`` of a reader tensor as float32, dequantizing only those rows and block
    columns when they are whole quantization blocks (rows always are; a column range of a
    row-parallel split is when ``in / tp`` is a multiple of the block, 32 or 256); else
    the whole tensor is dequantized and then sliced (counted as whole)."""
    shape = _hf_shape(t)
    if all(s == 0 and n == d for (s, n), d in zip(ranges, shape)):
        return dequantize_tensor(t)
    index = _block_slice(t, ranges)
    if index is None:
        whole = dequantize_tensor(t)
        for dim, (s, n) in enumerate(ranges):
            whole = whole.narrow(dim, s, n)
        return whole.contiguous()
    arr = _dequantize(t, t.data[index]).reshape(tuple(n for _, n in ranges))
    out = _to_tensor(arr)
    record_materialized(out.numel() * 4)
    return out


def read_gguf_raw(t: Any, ranges: Ranges) -> torch.Tensor:
    """``ranges`` of a reader tensor as its stored bytes, ``uint8 [..., n, cols / B * S]``:
    rows are whole blocks always, a column range only on block boundaries (else a
    ModelLoadError naming the tensor: a tensor-parallel split that would cut a block)."""
    index = _block_slice(t, ranges)
    if index is None:
        from gguf import GGML_QUANT_SIZES

        block = GGML_QUANT_SIZES[t.tensor_type][0]
        (c0, n) = ranges[-1]
        raise ModelLoadError(f"GGUF tensor {t.name!r} ({t.tensor_type.name}, blocks of {block}): "
                             f"columns [{c0}, {c0 + n}) do not fall on block boundaries")
    part = np.ascontiguousarray(t.data[index]).view(np.uint8)
    out = torch.from_numpy(part.copy())  # the memory map is read-only
    record_materialized(out.numel())
    return out


def _permuted(read, shape, rows_per_head: Optional[int]):
    """``read`` with llama.cpp's Q/K row permutation undone: a part of whole heads is
    un-permuted on its own (``unpermute_qk`` over its heads); a part cutting a head reads
    all rows, un-permutes, then narrows. Rows are whole blocks, so the raw bytes permute
    the same way as the values."""
    if rows_per_head is None:
        return read

    def unpermuted(ranges: Ranges) -> torch.Tensor:
        s, n = ranges[0]
        if s % rows_per_head == 0 and n % rows_per_head == 0:
            return unpermute_qk(read(ranges), n // rows_per_head)
        w = unpermute_qk(read(((0, shape[0]),) + tuple(ranges[1:])), shape[0] // rows_per_head)
        return w.narrow(0, s, n).contiguous()

    return unpermuted


def _gguf_reader(t: Any, rows_per_head: Optional[int], norm_offset: float):
    """Reader of one tensor in HF layout as float32 (Q/K rows un-permuted, Gemma's norm
    offset taken out)."""
    read = _permuted(lambda ranges: read_gguf_part(t, ranges), _hf_shape(t), rows_per_head)
    if not norm_offset:
        return read
    return lambda ranges: read(ranges) - norm_offset


def gguf_tensor_types(path: Path) -> Dict[str, int]:
    """``HF name -> GGML type id`` of every weight of a GGUF file (the quantization config
    is built from it before the model exists)."""
    reader = open_gguf(path)
    arch = get_arch(gguf_architecture(reader))
    types = {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name, arch)
        if name is not None:
            types[name] = int(t.tensor_type)
    return types


def iter_gguf_weights(path: Path) -> Iterator[Tuple[str, LazyTensor]]:
    """Yield ``(hf_name, LazyTensor)`` for every weight of a GGUF file: float32 in HF
    layout when materialised, only the narrowed part dequantized (``read_gguf_part``)."""
    reader = open_gguf(path)
    arch = get_arch(gguf_architecture(reader))
    cfg = gguf_to_hf_config(reader)
    # Map all names first so an unknown tensor fails before seconds of dequantizing.
    names = [(t, hf_tensor_name(t.name, arch)) for t in reader.tensors]
    named = [(t, n) for t, n in names if n is not None]
    for t, name in progress(iter(named), len(named), f"Loading {Path(path).name}"):
        heads = None
        if arch.permute_qk and ".self_attn.q_proj." in name:
            heads = cfg["num_attention_heads"]
        elif arch.permute_qk and ".self_attn.k_proj." in name:
            heads = cfg["num_key_value_heads"]
        shape = _hf_shape(t)
        rows_per_head = None
        if heads is not None:
            if shape[0] % (2 * heads):
                raise ModelLoadError(f"cannot un-permute a Q/K tensor of {shape[0]} rows over "
                                     f"{heads} heads")
            rows_per_head = shape[0] // heads
        offset = arch.norm_weight_offset if name.endswith("norm.weight") else 0.0
        raw = _permuted(lambda ranges, t=t: read_gguf_raw(t, ranges), shape, rows_per_head)
        yield name, LazyTensor(name, shape, torch.float32, _gguf_reader(t, rows_per_head, offset),
                               ggml_type=int(t.tensor_type), read_raw=raw)
    # Loaded: free the parsed metadata (tens of MB for a large vocabulary) in a long-lived
    # server; a later call simply re-reads it. Lazy tensors keep their own memory-map views.
    clear_gguf_cache()
