"""Parameters that hold GGML quantization blocks, and the views their loaders write through.

A quantized layer's weight is one flat ``uint8`` parameter (made by the GGUF methods in
``quantization/gguf_methods.py``) whose ``packed`` attribute is a ``PackedLayout``: the logical
float shape ``(*lead, N, K)`` (``lead``: experts of a MoE layer) and its output rows in
parts, each part ``rows`` rows of one GGML type (a fused qkv layer of a Q4_K_M file holds
q and k in Q4_K and v in Q6_K). Part ``i`` is stored contiguously as
``[*lead, rows_i, K / B_i * S_i]``: the file's own bytes, rows after rows.

The parallel layers' ``weight_loader``s shard in logical coordinates, exactly as for a
float weight: ``weight_view(param)`` is ``param.data`` for a plain parameter and a
``PackedView`` for a packed one, which offers the three things those loaders use --
``shape``, ``narrow(dim, start, length)`` and ``zero_()`` -- and is filled by
``layers.utils.copy_checked``. A narrow of the input features that would cut a block is
refused there (``BlockSplitError``); the builder checks the same before anything loads.
Filling reads a GGUF tensor's blocks as they are when its type is the part's type, and
otherwise quantizes the float values to the part's type on the parameter's device
(``--isq``, or a float tensor in a quantized fused layer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from cvllm.config import ConfigError
from cvllm.kernels.quant.ggml_types import FLOAT_TYPES, GgmlType, block_shape, row_bytes

_FLOAT_DTYPES = {GgmlType.F32: torch.float32, GgmlType.F16: torch.float16,
                 GgmlType.BF16: torch.bfloat16}


class BlockSplitError(ConfigError):
    """A split of a packed weight's input features that would cut a quantization block."""


def check_input_split(name: str, size: int, tp_size: int, per_partition: int,
                      granularity: int, piece: Optional[int] = None) -> None:
    """Refuse, at start-up, a split of ``size`` input features over ``tp_size`` ranks
    (``per_partition`` on this rank; ``piece``: the unit of an uneven split, a head) that
    would cut quantization blocks of ``granularity`` features."""
    if per_partition % granularity == 0 and (piece is None or piece % granularity == 0):
        return
    fits = [n for n in range(1, 17) if size % n == 0 and (size // n) % granularity == 0]
    raise BlockSplitError(
        f"{name}: {size} input features over {tp_size} ranks would cut quantization blocks "
        f"of {granularity}; rank counts that work: {fits or 'none'}")


@dataclass(frozen=True)
class PackedLayout:
    """Where each part of a packed weight lives in its flat byte buffer."""

    lead: Tuple[int, ...]
    """Leading logical dims (``(E,)`` for experts, ``()`` for a linear)."""
    parts: Tuple[Tuple[int, GgmlType], ...]
    """``(rows, type)`` of each output part, in row order."""
    cols: int
    """Input features ``K`` (every part's rows are ``K`` long)."""

    def __post_init__(self) -> None:
        for rows, t in self.parts:
            row_bytes(t, self.cols)  # raises when K is not whole blocks of t

    @property
    def rows(self) -> int:
        return sum(r for r, _ in self.parts)

    @property
    def shape(self) -> Tuple[int, ...]:
        return (*self.lead, self.rows, self.cols)

    def part_bytes(self, i: int) -> int:
        rows, t = self.parts[i]
        return math.prod(self.lead) * rows * row_bytes(t, self.cols)

    @property
    def nbytes(self) -> int:
        return sum(self.part_bytes(i) for i in range(len(self.parts)))

    def part_offsets(self) -> List[Tuple[int, int, int]]:
        """``(first row, byte offset, row bytes)`` of each part."""
        out, row, off = [], 0, 0
        for i, (rows, t) in enumerate(self.parts):
            out.append((row, off, row_bytes(t, self.cols)))
            row, off = row + rows, off + self.part_bytes(i)
        return out

    def part_tensor(self, buf: torch.Tensor, i: int) -> torch.Tensor:
        """Part ``i`` of the flat buffer as ``uint8 [*lead, rows_i, row bytes]``."""
        _, off, rb = self.part_offsets()[i]
        return buf[off: off + self.part_bytes(i)].view(*self.lead, self.parts[i][0], rb)

    def groups(self) -> List[Tuple[int, int, GgmlType, List[int]]]:
        """Runs of consecutive parts of one type: ``(first row, rows, type, part ids)``."""
        out: List[Tuple[int, int, GgmlType, List[int]]] = []
        row = 0
        for i, (rows, t) in enumerate(self.parts):
            if out and out[-1][2] == t:
                first, n, _, ids = out[-1]
                out[-1] = (first, n + rows, t, ids + [i])
            else:
                out.append((row, rows, t, [i]))
            row += rows
        return out


class PackedView:
    """A logical ``[*lead, N, K]`` window on a packed parameter, for weight loaders."""

    def __init__(self, buf: torch.Tensor, layout: PackedLayout, name: str = "",
                 ranges: Optional[Sequence[Tuple[int, int]]] = None):
        self.buf, self.layout, self.name = buf, layout, name
        self.ranges = tuple(ranges) if ranges is not None else tuple(
            (0, d) for d in layout.shape)

    @property
    def shape(self) -> torch.Size:
        return torch.Size(n for _, n in self.ranges)

    def dim(self) -> int:
        return len(self.ranges)

    def narrow(self, dim: int, start: int, length: int) -> "PackedView":
        dim %= len(self.ranges)
        offset, size = self.ranges[dim]
        if start < 0 or length < 0 or start + length > size:
            raise ValueError(f"narrow({dim}, {start}, {length}) outside a dimension of {size}")
        ranges = list(self.ranges)
        ranges[dim] = (offset + start, length)
        return PackedView(self.buf, self.layout, self.name, ranges)

    def __getitem__(self, index: int) -> "PackedView":
        """``view[e]``: one expert (the first leading dim), like ``tensor[e]``."""
        if not self.layout.lead or not isinstance(index, int):
            raise TypeError("a packed view is indexed only by an expert id")
        view = self.narrow(0, index, 1)
        return _Squeezed(view)

    def _regions(self):
        """``(part tensor window, first logical row of the window)`` per part the row range
        touches; the window is ``uint8 [*lead part, rows, byte cols]``."""
        *lead_r, (r0, n), (c0, k) = self.ranges
        for i, (first, _, _) in enumerate(self.layout.part_offsets()):
            rows, t = self.layout.parts[i]
            lo, hi = max(r0, first), min(r0 + n, first + rows)
            if lo >= hi:
                continue
            elems, nbytes = block_shape(t)
            if c0 % elems or k % elems:
                raise BlockSplitError(
                    f"{self.name}: input features [{c0}, {c0 + k}) of a {t.name} weight do not "
                    f"fall on its blocks of {elems}")
            win = self.layout.part_tensor(self.buf, i)
            for d, (s, m) in enumerate(lead_r):
                win = win.narrow(d, s, m)
            win = win.narrow(-2, lo - first, hi - lo).narrow(-1, c0 // elems * nbytes,
                                                             k // elems * nbytes)
            yield win, lo - r0, t

    def zero_(self) -> "PackedView":
        # All-zero blocks are zeros in every GGML type (zero scales), so padding rows and
        # padding input blocks add nothing.
        for win, _, _ in self._regions():
            win.zero_()
        return self

    def load(self, src) -> None:
        """Fill this window from a checkpoint tensor of the same logical shape (a GGUF
        ``LazyTensor`` keeps its blocks when its type matches; anything else is quantized
        here, on the buffer's device)."""
        if tuple(src.shape) != tuple(self.shape):
            raise ValueError(f"shape mismatch: checkpoint tensor {tuple(src.shape)} vs "
                             f"parameter {tuple(self.shape)}")
        for win, row, t in self._regions():
            part = src.narrow(src.dim() - 2, row, win.shape[-2])
            win.copy_(encode(part, t, win.device).view(win.shape))


class _Squeezed(PackedView):
    """``view[e]``: the expert dim dropped from ``shape`` (still narrowed underneath)."""

    def __init__(self, inner: PackedView):
        super().__init__(inner.buf, inner.layout, inner.name, inner.ranges)

    @property
    def shape(self) -> torch.Size:
        return torch.Size(n for _, n in self.ranges[1:])

    def dim(self) -> int:
        return len(self.ranges) - 1

    def narrow(self, dim: int, start: int, length: int) -> "PackedView":
        return _Squeezed(PackedView.narrow(self, dim % self.dim() + 1, start, length))

    def load(self, src) -> None:
        if tuple(src.shape) != tuple(self.shape):
            raise ValueError(f"shape mismatch: checkpoint tensor {tuple(src.shape)} vs "
                             f"parameter {tuple(self.shape)}")
        whole = PackedView(self.buf, self.layout, self.name, self.ranges)
        whole.load(src.unsqueeze(0) if isinstance(src, torch.Tensor) else _Unsqueezed(src))


class _Unsqueezed:
    """A lazy expert tensor ``[N, K]`` seen as ``[1, N, K]`` (narrow / read pass through)."""

    def __init__(self, src):
        self.src = src
        self.ggml_type = getattr(src, "ggml_type", None)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((1, *self.src.shape))

    def dim(self) -> int:
        return self.src.dim() + 1

    def narrow(self, dim: int, start: int, length: int) -> "_Unsqueezed":
        return _Unsqueezed(self.src.narrow(dim % self.dim() - 1, start, length))

    def read_raw(self) -> torch.Tensor:
        return self.src.read_raw().unsqueeze(0)

    def materialize(self) -> torch.Tensor:
        return _as_tensor(self.src).unsqueeze(0)


def _as_tensor(x) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else x.materialize()


def encode(src, t: GgmlType, device: torch.device) -> torch.Tensor:
    """``src [..., n, K]`` as ``t``'s bytes ``uint8 [..., n, K / B * S]`` on ``device``:
    the stored blocks of a GGUF tensor of that type, else quantized (or cast) here."""
    if getattr(src, "ggml_type", None) == int(t):
        return src.read_raw().to(device)
    w = _as_tensor(src).to(device)
    if t in FLOAT_TYPES:
        return w.to(_FLOAT_DTYPES[t]).contiguous().view(torch.uint8)
    from cvllm.quantization.ggml_quantizer import quantize

    k = w.shape[-1]
    raw = quantize(w.reshape(-1, k).float(), t)  # [rows, K / B * S]
    return raw.view(*w.shape[:-1], raw.shape[-1])


def weight_view(param: torch.Tensor):
    """What a weight loader writes through: ``param.data``, or a ``PackedView`` of a
    packed parameter."""
    layout = getattr(param, "packed", None)
    if layout is None:
        return param.data
    return PackedView(param.data, layout, getattr(param, "packed_name", ""))


def create_packed(lead: Sequence[int], parts: Sequence[Tuple[int, GgmlType]], cols: int,
                  name: str) -> torch.nn.Parameter:
    """A packed parameter (its bytes uninitialised) with its ``packed`` layout attached."""
    layout = PackedLayout(tuple(lead), tuple((int(r), GgmlType(t)) for r, t in parts), cols)
    param = torch.nn.Parameter(torch.empty(layout.nbytes, dtype=torch.uint8),
                               requires_grad=False)  # flat bytes of every part
    param.packed = layout
    param.packed_name = name
    return param
