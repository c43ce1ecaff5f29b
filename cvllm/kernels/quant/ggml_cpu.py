"""CPU kernels of GGUF (GGML) block-quantized linears, kept quantized in memory.

Built by the GGUF quantization method through ``dispatch.backend_for`` once per weight
after loading (``prepare``), then called every step (``linear``, ``embedding``). Stateless
apart from the weights it prepares; the same on every rank.

The multiply is torch's own int4 CPU kernel, ``aten._weight_int4pack_mm_for_cpu``
(AVX-512 / AVX2, no compiler at install time): ``y = x @ W.T`` where each 4-bit code ``v``
of ``W`` stands for ``scale * (v - 8) + zero`` with a (scale, zero) pair per 32 inputs.
``ggml_cpu_planes`` writes every GGML type in that form (one int4 plane for the 4-bit
types, two or three for the others, laid side by side along K: a 2-plane type costs
about twice a 4-bit one); Q6_K, which no 32-group plane can hold, is kept as a dense copy
in the activation dtype and multiplied by ``F.linear``.

The kernel decodes the weight again for every 4 rows of ``x``, so batches pay: hence
``prepare``'s ``batch_copy`` (a bf16 copy beside the planes of a two-plane type, for
decode batches from ``BATCH_COPY_FROM_M`` rows, on CPUs whose bf16 matmul is fast, AMX
or AVX-512 BF16: ``batch_copy_pays``) and ``DEQUANT_MIN_M`` (prefill without a copy:
dequantize, then oneDNN). The measurements behind these: docs/kernels.md.

Precision: the kernel takes bf16 activations, bf16 (scale, zero) pairs and accumulates in
float32. GGUF's f16 block scales (and Q4_1's ``m + 8 d``, K-quants' ``d * sc``) are rounded
to bf16: a relative error of at most 2^-9 per group scale, a fraction of the 4-bit
quantization step. The codes are exact. float32 activations are rounded to bf16 for the
call and the result is widened back. The int4 kernel's float32 / f16 variants are scalar
code (10-100x slower), so they are never used.

Shapes: ``N`` output features, ``K`` input features, ``P`` planes, ``G`` = 32 inputs per
(scale, zero) group, ``Np`` = N rounded up to the kernel's 64-row tiles, ``R`` block rows.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F

from cvllm.kernels.quant.backend import GgmlBackend, GgmlWeight
from cvllm.kernels.quant.ggml_cpu_planes import (
    DENSE_TYPES, GROUP, ONE_PLANE_TYPES, pack_rows,
)
from cvllm.kernels.quant.ggml_types import QUANTIZED_TYPES, GgmlType, block_shape
from cvllm.kernels.quant.reference import dequantize as _ref_dequantize

TILE_N = 64
"""Output rows per tile of the AVX-512 int4 kernel's packed layout: N is padded to it so
that every tile has the same byte layout (which ``_codes_of_rows`` decodes). Other CPU
builds of the kernel (AVX2: 32-row tiles) pack differently; ``_tiles_decodable`` finds
out once, and there ``prepare`` keeps GGUF's bytes for ``dequantize`` / ``embedding``."""

DEQUANT_MIN_M = 128
"""From this many rows of ``x`` (prefill), dequantizing the weight (to bf16 on CPUs with
AMX, float32 on others: ``dequant_dtype``) and calling ``F.linear`` (oneDNN) beats the
int4 kernel, whose time grows with every 4 rows because it decodes the weight again for
each 4-row tile (measured crossover about 120 rows: docs/kernels.md)."""

BATCH_COPY_FROM_M = {"amx": 3, "avx512_bf16": 8}
"""Rows of ``x`` from which a weight of two or more planes multiplies its bf16 copy, by
the CPU's bf16 matmul (``bf16_matmul_isa``): where the copy measured faster than the
planes, per ISA (docs/kernels.md). One-plane types keep no copy: in a whole decode step,
weights streaming from memory, the copy reads 3.2x the bytes of the plane and gained
nothing."""

_PREP_ROWS = 8192
"""Rows converted at once in ``prepare``: bounds the int32 code buffer (the LM head's
49152 rows would take 230 MB at once)."""

@dataclass
class CpuGgmlWeight(GgmlWeight):
    """A GGML weight in the int4 kernel's layout (or a dense copy for ``DENSE_TYPES``)."""

    ggml_type: GgmlType
    shape: Tuple[int, int]
    """Logical ``(N, K)``."""
    dtype: torch.dtype
    """Activation dtype the weight was prepared for (embedding's default output)."""
    planes: int = 0
    """int4 planes laid along K (0 for a dense weight)."""
    packed: Optional[torch.Tensor] = None
    """``uint8 [Np, P * K / 2]`` in the kernel's tile layout (bytes ``[Np / 64, P * K, 32]``)."""
    scales_zeros: Optional[torch.Tensor] = None
    """``bf16 [P * K / 32, Np, 2]``: (scale, zero) per group and row."""
    dense: Optional[torch.Tensor] = None
    """``[N, K]`` in ``dtype`` for ``DENSE_TYPES``."""
    raw: Optional[torch.Tensor] = None
    """GGUF's bytes, kept only where ``_codes_of_rows`` cannot read this CPU's packing."""
    batch_dense: Optional[torch.Tensor] = None
    """Opt-in bf16 ``[N, K]`` copy beside the int4 planes, for ``x`` of at least
    ``dense_from_m`` rows (``prepare``'s ``batch_copy`` / ``dense_from_m``)."""
    dense_from_m: int = 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in
                   (self.packed, self.scales_zeros, self.dense, self.raw, self.batch_dense)
                   if t is not None)


# ------------------------------------------------------------------------------ public API

def supports(t: GgmlType, dtype: torch.dtype) -> bool:
    """Every type cvllm keeps quantized, with float32 / bf16 / f16 activations."""
    return t in QUANTIZED_TYPES and dtype in (torch.float32, torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=None)
def bf16_matmul_isa() -> Optional[str]:
    """How this CPU multiplies bf16 matrices (oneDNN): ``"amx"`` (AMX tiles), ``"avx512_bf16"``
    (AVX-512 BF16 dot products, e.g. AMD Zen 4), or None: converted to float32 FMAs, 3-4x
    slower than a float32 matmul."""
    for isa, probe in (("amx", "_is_amx_tile_supported"),
                       ("avx512_bf16", "_is_avx512_bf16_supported")):
        try:
            if getattr(torch.cpu, probe)():
                return isa
        except AttributeError:  # an older torch without the probe
            continue
    return None


def batch_copy_pays() -> bool:
    """Whether this CPU multiplies bf16 fast (``bf16_matmul_isa``), where a bf16 copy of a
    two-plane weight multiplies a decode batch faster than the int4 kernel
    (``BATCH_COPY_FROM_M``). Elsewhere the bf16 matmul runs
    on float32 FMAs at about the int4 kernel's speed, so a copy would cost memory for
    nothing."""
    return bf16_matmul_isa() is not None


def batch_copy_from_m() -> int:
    """Rows of ``x`` from which a weight with a bf16 batch copy multiplies the copy, on this
    CPU (``BATCH_COPY_FROM_M``)."""
    return BATCH_COPY_FROM_M.get(bf16_matmul_isa(), BATCH_COPY_FROM_M["amx"])


def dequant_dtype() -> torch.dtype:
    """What a prefill-sized ``x`` (``DEQUANT_MIN_M`` rows) and the weight dequantized for it
    are multiplied in: bf16 where AMX tiles multiply it (``bf16_matmul_isa``), else
    float32. Without AMX or AVX-512 BF16 a bf16 matmul runs 3-4x slower than float32; with
    AVX-512 BF16 alone the product is faster in bf16 but a whole prefill took the same
    either way, so float32 stays there (docs/kernels.md)."""
    return torch.bfloat16 if bf16_matmul_isa() == "amx" else torch.float32


def batch_copy_bytes(t: GgmlType, shape: Tuple[int, int]) -> int:
    """Bytes of the bf16 copy ``prepare(batch_copy=True)`` adds: none for ``DENSE_TYPES``
    (already dense) and ``ONE_PLANE_TYPES`` (``BATCH_COPY_FROM_M``: no gain)."""
    t = GgmlType(t)
    return 0 if t in DENSE_TYPES or t in ONE_PLANE_TYPES else 2 * shape[0] * shape[1]


def prepare(raw: torch.Tensor, t: GgmlType, dtype: torch.dtype,
            dense_from_m: Optional[int] = None, batch_copy: bool = False) -> CpuGgmlWeight:
    """GGUF's bytes ``raw uint8 [N, K / B * S]`` of type ``t`` -> the kernel's layout, for
    activations of ``dtype``. ``raw`` is not kept (except where this CPU's int4 packing
    is not the AVX-512 one, see ``TILE_N``).

    ``batch_copy``: also keep a bf16 copy (``batch_copy_bytes``: 2 bytes a weight more,
    none for the types it does not pay for) and multiply ``x`` of at least
    ``BATCH_COPY_FROM_M`` rows with it: the int4 kernel decodes the weight once per 4
    rows and once per plane. ``dense_from_m``: keep the copy whatever the type, from that
    many rows (tests, benchmarks). Neither (default): weights stay quantized only."""
    t = GgmlType(t)
    if not supports(t, dtype):
        raise ValueError(f"the CPU GGML kernels take no {t.name} weight with {dtype}")
    elems, nbytes = block_shape(t)
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % nbytes:
        raise ValueError(f"{t.name} weight must be uint8 [N, K / {elems} * {nbytes}], "
                         f"got {raw.dtype} {tuple(raw.shape)}")
    n, k = raw.shape[0], raw.shape[1] // nbytes * elems
    if t in DENSE_TYPES:
        return CpuGgmlWeight(t, (n, k), dtype, dense=_ref_dequantize(raw, t, dtype))
    n_pad = -(-n // TILE_N) * TILE_N
    if n_pad != n:  # padded rows: zero bytes decode to zero scales, so they add nothing
        raw = torch.cat([raw, raw.new_zeros(n_pad - n, raw.shape[1])])
    parts = [pack_rows(raw[i:i + _PREP_ROWS], t, k) for i in range(0, n_pad, _PREP_ROWS)]
    packed = torch.cat([p[0] for p in parts])  # [Np, P * K / 2]
    sz = torch.cat([p[1] for p in parts], dim=1)  # [P * K / G, Np, 2]
    w = CpuGgmlWeight(t, (n, k), dtype, planes=parts[0][2], packed=packed, scales_zeros=sz)
    if not _tiles_decodable():
        w.raw = raw[:n].clone()
    if dense_from_m is not None or (batch_copy and batch_copy_bytes(t, (n, k))):
        w.batch_dense = dequantize(w, torch.bfloat16)  # [N, K]
        w.dense_from_m = max(1, int(dense_from_m if dense_from_m is not None
                                    else batch_copy_from_m()))
    return w


def linear(x: torch.Tensor, w: CpuGgmlWeight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x [M, K] @ W.T (+ bias) -> [M, N]`` in x's dtype."""
    n, k = w.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}], got {tuple(x.shape)}")
    if w.dense is not None:
        if w.dense.dtype != x.dtype:
            return F.linear(x, w.dense.to(x.dtype), None if bias is None else bias.to(x.dtype))
        return F.linear(x, w.dense, bias)
    # A decode step calls this about 120 times (the default model): every torch op
    # skipped here (casts that are no-ops, copies of contiguous tensors) is ~1 us off it.
    m = x.shape[0]
    if w.batch_dense is not None and m >= w.dense_from_m:
        y = F.linear(x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16),
                     w.batch_dense)  # [M, N]
    elif m >= DEQUANT_MIN_M:
        dt = dequant_dtype()
        y = F.linear(x if x.dtype == dt else x.to(dt), dequantize(w, dt))  # [M, N]
    else:
        xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)  # contiguous
        if w.planes > 1:
            xb = xb.repeat(1, w.planes)  # [M, P * K]: one copy of x per plane
        elif not xb.is_contiguous():
            xb = xb.contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            xb, w.packed, GROUP, w.scales_zeros)  # [M, Np]
        if y.shape[1] != n:
            y = y[:, :n].contiguous()
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    if bias is not None:
        y = y + (bias if bias.dtype == x.dtype else bias.to(x.dtype))
    return y


def linear_fn(w: CpuGgmlWeight, bias: Optional[torch.Tensor] = None
              ) -> Callable[[torch.Tensor], torch.Tensor]:
    """``linear(., w, bias)`` as one callable. A one-plane weight without bias or
    padding calls the int4 kernel itself below the row counts where ``linear`` would
    switch to a dense product: a cast in and a cast out around one kernel call, the ops
    ``linear`` runs there, without its checks (the callers pass ``[M, K]``)."""
    n, k = w.shape
    if (w.dense is not None or bias is not None or w.planes != 1
            or w.scales_zeros.shape[1] != n):
        return functools.partial(linear, w=w, bias=bias)
    small = DEQUANT_MIN_M if w.batch_dense is None else min(DEQUANT_MIN_M, w.dense_from_m)
    packed, sz = w.packed, w.scales_zeros
    int4_mm = torch.ops.aten._weight_int4pack_mm_for_cpu

    def fn(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= small or x.dim() != 2 or x.shape[1] != k:
            return linear(x, w)
        xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
        if not xb.is_contiguous():
            xb = xb.contiguous()
        return int4_mm(xb, packed, GROUP, sz).to(x.dtype)  # [M, N]

    return fn


def _codes_of_rows(packed: torch.Tensor, cols: int,
                   rows: Optional[torch.Tensor]) -> torch.Tensor:
    """The 4-bit codes of ``rows [T]`` (all Np rows when None) of ``packed`` (``cols``
    codes a row) as uint8 ``[T, cols]``. The AVX-512 tile layout: bytes
    ``[Np / 64, cols, 32]``; row r of a tile is the low nibble of byte r (r < 32) or the
    high nibble of byte r - 32."""
    tiles = packed.view(-1, cols, 32)  # [Np / 64, cols, 32]
    if rows is None:
        both = torch.cat([tiles & 15, tiles >> 4], dim=-1)  # [Np / 64, P * K, 64]
        return both.transpose(1, 2).reshape(-1, tiles.shape[1])  # [Np, P * K]
    tile, r = rows // TILE_N, rows % TILE_N  # [T] each
    bytes_ = tiles[tile, :, r % 32]  # [T, cols]
    return torch.where((r < 32).unsqueeze(-1), bytes_ & 15, bytes_ >> 4)


@functools.lru_cache(maxsize=None)
def _tiles_decodable() -> bool:
    """Whether this process's int4 packing is the layout ``_codes_of_rows`` reads (torch
    picks the kernel by CPU capability at run time, so ask it with a probe)."""
    codes = torch.randint(0, 16, (2 * TILE_N, 64), dtype=torch.int32,
                          generator=torch.Generator().manual_seed(0))  # [128, 64]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    if packed.numel() * 2 != codes.numel():
        return False
    return torch.equal(_codes_of_rows(packed.contiguous(), 64, None), codes.to(torch.uint8))


def _dequant_rows(w: CpuGgmlWeight, rows: Optional[torch.Tensor], dtype: torch.dtype):
    """Rows of W from the packed codes with the kernel's own bf16 scales: ``[T, K]``
    (from GGUF's bytes where this CPU's packing is not readable)."""
    n, k = w.shape
    if w.raw is not None:
        return _ref_dequantize(w.raw if rows is None else w.raw[rows], w.ggml_type, dtype)
    codes = _codes_of_rows(w.packed, w.planes * k, rows)  # [T, P * K]
    sz = w.scales_zeros if rows is None else w.scales_zeros[:, rows]  # [P * K / G, T, 2]
    s, z = (sz[..., i].t().float().unsqueeze(-1) for i in (0, 1))  # [T, P * K / G, 1] each
    t = codes.shape[0]
    # in place on one float32 tensor: (c - 8) * s + z, the kernel's arithmetic
    vals = codes.view(t, -1, GROUP).float().sub_(8).mul_(s).add_(z)  # [T, PK/G, G]
    out = vals.view(t, k) if w.planes == 1 else vals.view(t, w.planes, k).sum(dim=1)  # [T, K]
    return out if out.dtype == dtype else out.to(dtype)


def dequantize(w: CpuGgmlWeight, dtype: torch.dtype) -> torch.Tensor:
    """The whole weight as ``[N, K]`` of ``dtype`` (the values the kernel multiplies by)."""
    if w.dense is not None:
        return w.dense.to(dtype, copy=True)
    return _dequant_rows(w, None, dtype)[:w.shape[0]]


def embedding(w: CpuGgmlWeight, ids: torch.Tensor,
              dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Rows ``ids [T]`` of the weight: ``[T, K]`` in ``dtype`` (default: the activation
    dtype it was prepared for)."""
    dtype = dtype or w.dtype
    ids = ids.reshape(-1).long()
    if w.dense is not None:
        return w.dense[ids].to(dtype)
    return _dequant_rows(w, ids, dtype)


def nbytes(w: CpuGgmlWeight) -> int:
    """Bytes the prepared weight holds."""
    return w.nbytes()


class CpuBackend(GgmlBackend):
    """``backend.GgmlBackend`` over this module's functions."""

    name = "cpu int4pack"

    def supports(self, t: GgmlType, dtype: torch.dtype) -> bool:
        return supports(t, dtype)

    def prepare(self, raw: torch.Tensor, t: GgmlType, dtype: torch.dtype,
                batch_copy: bool = False, exact: bool = False) -> CpuGgmlWeight:
        return prepare(raw, t, dtype, batch_copy=batch_copy)  # never exact: see exact()

    def batch_copy_bytes(self, t: GgmlType, shape: Tuple[int, int]) -> int:
        return batch_copy_bytes(t, shape)

    def linear(self, x: torch.Tensor, w: GgmlWeight,
               bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return linear(x, w, bias)

    def linear_fn(self, w: GgmlWeight,
                  bias: Optional[torch.Tensor] = None) -> Callable[[torch.Tensor], torch.Tensor]:
        return linear_fn(w, bias)

    def embedding(self, w: GgmlWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return embedding(w, ids, dtype)

    def exact(self, dtype: torch.dtype) -> bool:
        return False  # bf16 activations and bf16 block scales
