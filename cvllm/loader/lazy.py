"""Lazy checkpoint tensors: a weight's shape and dtype, read only when asked, and only the
part asked for.

Built by the tensor iterators (``safetensors_loader``, ``gguf_loader``) on every rank,
one per checkpoint tensor; consumed right away by the parameters' ``weight_loader``s,
which ``narrow`` to this rank's slice first and only then ``materialize`` (through
``layers.utils.copy_checked``). So a rank of a tensor-parallel group reads (and for GGUF
dequantizes) about ``1/tp_size`` of every sharded weight; with one rank the whole tensor
is read exactly as before (``safe_open.get_tensor``, one ``dequantize`` call).

``LazyTensor`` offers the small part of ``torch.Tensor``'s API the loaders need:
``shape``, ``dtype``, ``dim()``, ``size()``, ``narrow(dim, start, length)`` (another
LazyTensor) and ``materialize()`` (a fresh, writable ``torch.Tensor`` of ``shape``).
Code that needs anything else (a reshape, a stack) materialises first.

A GGUF tensor kept in its quantization blocks also carries ``ggml_type`` (the GGML type
id) and ``read_raw()``: the same part as the file's bytes, ``uint8 [..., n, cols / B * S]``
(a column range must fall on block boundaries). A quantized parameter's loader reads that
instead of the float values (``quantization/packed.py``); every other loader materialises
floats as before. Plain tensors have ``ggml_type = None``.

``materialized_bytes()`` counts the bytes this thread's readers produced (a whole tensor
when a slice could not be read on its own), so a test can check that a rank read only
its shard.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional, Sequence, Tuple, Union

import torch

Ranges = Tuple[Tuple[int, int], ...]
"""Per dimension of the full tensor: ``(start, length)`` of the part wanted."""
Reader = Callable[[Ranges], torch.Tensor]
"""Reads the given ranges of the full tensor: returns a tensor of the ranges' lengths."""
RawReader = Callable[[Ranges], torch.Tensor]
"""Reads the given ranges of the full tensor as its stored quantization blocks (uint8)."""

_counter = threading.local()


def record_materialized(nbytes: int) -> None:
    """Called by the readers with the bytes of every tensor they produce."""
    _counter.bytes = getattr(_counter, "bytes", 0) + int(nbytes)


def materialized_bytes() -> int:
    """Bytes produced by this thread's lazy reads since the last reset."""
    return getattr(_counter, "bytes", 0)


def reset_materialized_bytes() -> None:
    _counter.bytes = 0


class LazyTensor:
    """A (part of a) checkpoint tensor not read yet."""

    __slots__ = ("name", "dtype", "full_shape", "ranges", "_read", "ggml_type", "_read_raw")

    def __init__(self, name: str, full_shape: Sequence[int], dtype: torch.dtype, read: Reader,
                 ranges: Optional[Ranges] = None, ggml_type: Optional[int] = None,
                 read_raw: Optional[RawReader] = None):
        self.name = name
        self.dtype = dtype
        self.ggml_type = ggml_type
        """GGML type id of the stored blocks (None: a plain tensor, no ``read_raw``)."""
        self._read_raw = read_raw
        self.full_shape = tuple(int(d) for d in full_shape)
        self.ranges: Ranges = ranges if ranges is not None else tuple(
            (0, d) for d in self.full_shape)
        self._read = read

    @property
    def shape(self) -> torch.Size:
        return torch.Size(n for _, n in self.ranges)

    def dim(self) -> int:
        return len(self.ranges)

    def size(self, dim: Optional[int] = None) -> Union[torch.Size, int]:
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return self.shape.numel()

    @property
    def is_whole(self) -> bool:
        """True when no dimension has been narrowed."""
        return all(s == 0 and n == d for (s, n), d in zip(self.ranges, self.full_shape))

    def narrow(self, dim: int, start: int, length: int) -> "LazyTensor":
        """Like ``torch.Tensor.narrow``: rows ``[start, start + length)`` of ``dim``."""
        ndim = self.dim()
        if not -ndim <= dim < ndim:
            raise IndexError(f"{self.name}: narrow dim {dim} of a {ndim}-d tensor")
        dim %= ndim
        offset, size = self.ranges[dim]
        if start < 0 or length < 0 or start + length > size:
            raise ValueError(f"{self.name}: narrow({dim}, {start}, {length}) outside a "
                             f"dimension of size {size}")
        ranges = list(self.ranges)
        ranges[dim] = (offset + start, length)
        return LazyTensor(self.name, self.full_shape, self.dtype, self._read, tuple(ranges),
                          self.ggml_type, self._read_raw)

    def materialize(self) -> torch.Tensor:
        """Read this part now: a fresh tensor of ``shape`` in ``dtype``."""
        out = self._read(self.ranges)
        if tuple(out.shape) != tuple(self.shape):
            raise RuntimeError(f"{self.name}: reader returned {tuple(out.shape)} for a part of "
                               f"shape {tuple(self.shape)}")
        return out

    def read_raw(self) -> torch.Tensor:
        """This part as the file's quantization blocks: ``uint8 [..., n, cols / B * S]``."""
        if self._read_raw is None:
            raise RuntimeError(f"{self.name}: not a block-quantized tensor")
        return self._read_raw(self.ranges)

    def __repr__(self) -> str:
        return (f"LazyTensor({self.name!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"of {self.full_shape})")


def materialize(x: Union[torch.Tensor, LazyTensor]) -> torch.Tensor:
    """``x`` as a ``torch.Tensor`` (read now when lazy)."""
    return x if isinstance(x, torch.Tensor) else x.materialize()
