"""Plain-torch reference dequantizer of GGUF (GGML) block-quantized weights.

The oracle that cvllm's GGML kernels (Triton on the GPU, the CPU path) are tested
against, and the fallback that turns a block-quantized tensor into floats. Called by the
GGUF quantization method, the loader (types cvllm does not keep quantized are not handled
here) and the kernel tests. Stateless; runs on whatever device ``raw`` lives on, the same
on every rank.

Block layouts follow ggml's ``block_*`` structs (ggml-common.h); the arithmetic follows
``dequantize_row_*`` (ggml-quants.c): f16 scales widened to float32, then the same float32
products in the same order, so results equal ``gguf.quants.dequantize`` bit for bit. Every
function is vectorized over all blocks with pure torch ops: no numpy, no host syncs, no
Python loop over blocks or rows.

Shapes: ``M`` blocks, ``S`` bytes per block, ``B`` elements per block, ``N`` output
features, ``K`` input features.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

from cvllm.kernels.quant.ggml_fields import (
    dense, f16, fields, iq4_levels, k_scale_min, q3_k_scales, q5_low_high, signed,
)
from cvllm.kernels.quant.ggml_types import (
    FLOAT_TYPES, QK_K, QUANTIZED_TYPES, GgmlType, block_shape,
)

_FLOAT_VIEWS = {GgmlType.F32: torch.float32, GgmlType.F16: torch.float16,
                GgmlType.BF16: torch.bfloat16}


# ----------------------------------------------------------------------- 32-element types

def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    """block_q4_0: d f16 | 16 B nibbles (low = elements 0..15, high = 16..31); (q - 8) * d."""
    d = f16(blocks, 0)
    q = fields(blocks[:, 2:18], 4).reshape(-1, 32)  # [M, 32]
    return (q.float() - 8) * d


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """block_q4_1: d f16 | m f16 | 16 B nibbles; d * q + m."""
    d, m = f16(blocks, 0), f16(blocks, 2)
    q = fields(blocks[:, 4:20], 4).reshape(-1, 32)  # [M, 32]
    return d * q.float() + m


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    """block_q5_0: d f16 | qh u32 | 16 B nibbles; (q - 16) * d."""
    d = f16(blocks, 0)
    q = q5_low_high(blocks[:, 6:22], blocks[:, 2:6])
    return (q.float() - 16) * d


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    """block_q5_1: d f16 | m f16 | qh u32 | 16 B nibbles; d * q + m."""
    d, m = f16(blocks, 0), f16(blocks, 2)
    q = q5_low_high(blocks[:, 8:24], blocks[:, 4:8])
    return d * q.float() + m


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """block_q8_0: d f16 | 32 int8; q * d."""
    return signed(blocks[:, 2:34]).float() * f16(blocks, 0)


def _iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    """block_iq4_nl: Q4_0's layout, the nibble indexing a non-uniform level; d * level."""
    d = f16(blocks, 0)
    q = fields(blocks[:, 2:18], 4).reshape(-1, 32)  # [M, 32]
    return d * iq4_levels(blocks.device)[q.long()]


# ------------------------------------------------------------- 256-element K-quants / IQ4_XS

def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    """block_q2_K: 16 B scales (low nibble scale, high nibble min, per 16 elements) |
    64 B 2-bit quants | d f16 | dmin f16; (d * sc) * q - (dmin * m)."""
    sc = blocks[:, 0:16]
    dl = (f16(blocks, 80) * (sc & 0xF).float()).unsqueeze(-1)  # [M, 16, 1]
    ml = (f16(blocks, 82) * (sc >> 4).float()).unsqueeze(-1)  # [M, 16, 1]
    # Each 32-byte half holds 128 elements, four 2-bit planes of 32.
    q = fields(blocks[:, 16:80].reshape(-1, 2, 32), 2).reshape(-1, 16, 16)  # [M, 16, 16]
    return (dl * q.float() - ml).reshape(-1, QK_K)


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    """block_q3_K: 32 B hmask | 64 B 2-bit quants | 12 B scales | d f16;
    (d * (sc - 32)) * (q2 - (hbit ? 0 : 4))."""
    dl = (f16(blocks, 108) * q3_k_scales(blocks[:, 96:108]).float()).unsqueeze(-1)
    low = fields(blocks[:, 32:96].reshape(-1, 2, 32), 2).reshape(-1, 16, 16)  # [M, 16, 16]
    # hmask bit i of byte j belongs to element 32 * i + j; a clear bit subtracts 4.
    high = fields(blocks[:, 0:32], 1).reshape(-1, 16, 16)  # [M, 16, 16]
    q = low.to(torch.int32) - ((high ^ 1).to(torch.int32) << 2)
    return (dl * q.float()).reshape(-1, QK_K)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """block_q4_K: d f16 | dmin f16 | 12 B scales | 128 B nibbles (32 bytes per pair of
    sub-blocks: low nibbles the first 32 elements); (d * sc) * q - (dmin * m)."""
    sc, mn = k_scale_min(blocks[:, 4:16])
    dl, ml = f16(blocks, 0).unsqueeze(-1) * sc, f16(blocks, 2).unsqueeze(-1) * mn
    q = fields(blocks[:, 16:144].reshape(-1, 4, 32), 4).reshape(-1, 8, 32)  # [M, 8, 32]
    return (dl * q.float() - ml).reshape(-1, QK_K)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    """block_q5_K: Q4_K plus 32 B qh before the nibbles (bit i of byte j is bit 4 of
    element 32 * i + j)."""
    sc, mn = k_scale_min(blocks[:, 4:16])
    dl, ml = f16(blocks, 0).unsqueeze(-1) * sc, f16(blocks, 2).unsqueeze(-1) * mn
    low = fields(blocks[:, 48:176].reshape(-1, 4, 32), 4).reshape(-1, 8, 32)  # [M, 8, 32]
    high = fields(blocks[:, 16:48], 1)  # [M, 8, 32]
    return (dl * (low | (high << 4)).float() - ml).reshape(-1, QK_K)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """block_q6_K: 128 B low nibbles | 64 B 2-bit highs | 16 int8 scales | d f16;
    (d * sc) * (q - 32). Each 128-element half takes 64 B of nibbles (two planes of 64)
    and 32 B of highs (four planes of 32)."""
    dl = (f16(blocks, 208) * signed(blocks[:, 192:208]).float()).unsqueeze(-1)  # [M,16,1]
    low = fields(blocks[:, 0:128].reshape(-1, 2, 64), 4).reshape(-1, QK_K)  # [M, 256]
    high = fields(blocks[:, 128:192].reshape(-1, 2, 32), 2).reshape(-1, QK_K)  # [M, 256]
    q = (low | (high << 4)).to(torch.int32) - 32
    return (dl * q.float().reshape(-1, 16, 16)).reshape(-1, QK_K)


def _iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    """block_iq4_xs: d f16 | scales_h u16 | 4 B scales_l | 128 B nibbles; 6-bit sub-block
    scales (low nibble from scales_l, 2 bits from scales_h) biased by 32;
    (d * (ls - 32)) * level. Each sub-block of 32 is 16 bytes: low nibbles first."""
    low = fields(blocks[:, 4:8], 4).transpose(-1, -2).reshape(-1, 8)  # [M, 8]
    high = fields(blocks[:, 2:4], 2).transpose(-1, -2).reshape(-1, 8)  # [M, 8]
    ls = (low | (high << 4)).to(torch.int32) - 32
    dl = (f16(blocks, 0) * ls.float()).unsqueeze(-1)  # [M, 8, 1]
    q = fields(blocks[:, 8:136].reshape(-1, 8, 16), 4).reshape(-1, 8, 32)  # [M, 8, 32]
    return (dl * iq4_levels(blocks.device)[q.long()]).reshape(-1, QK_K)


_DEQUANT: Dict[GgmlType, Callable[[torch.Tensor], torch.Tensor]] = {
    GgmlType.Q4_0: _q4_0, GgmlType.Q4_1: _q4_1, GgmlType.Q5_0: _q5_0,
    GgmlType.Q5_1: _q5_1, GgmlType.Q8_0: _q8_0, GgmlType.Q2_K: _q2_k,
    GgmlType.Q3_K: _q3_k, GgmlType.Q4_K: _q4_k, GgmlType.Q5_K: _q5_k,
    GgmlType.Q6_K: _q6_k, GgmlType.IQ4_NL: _iq4_nl, GgmlType.IQ4_XS: _iq4_xs,
}
assert set(_DEQUANT) == set(QUANTIZED_TYPES) and set(_FLOAT_VIEWS) == set(FLOAT_TYPES)


# ----------------------------------------------------------------------------- public API

def _check_type(t) -> GgmlType:
    """``t`` as a GgmlType this module handles; ValueError naming it otherwise."""
    try:
        t = GgmlType(t)
    except ValueError:
        raise ValueError(f"unknown GGML type id {int(t)}") from None
    if t not in _DEQUANT and t not in _FLOAT_VIEWS:
        raise ValueError(f"GGML type {t.name} is not supported by the reference dequantizer")
    return t


def dequantize(raw: torch.Tensor, t: GgmlType, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize GGUF blocks ``raw`` (uint8 ``[.., nb * S]``, each row a run of blocks in
    GGUF's byte layout) of type ``t`` into ``[.., nb * B]`` of ``dtype`` on raw's device.

    Float32 arithmetic as ggml does it, then one cast to ``dtype``. F32 / F16 / BF16 are
    bit reinterpretations. ValueError for an unsupported type, a non-uint8 ``raw`` or a last
    dim that is not a whole number of blocks. Always returns a new tensor."""
    t = _check_type(t)
    elems, nbytes = block_shape(t)
    if raw.dtype != torch.uint8 or raw.dim() == 0:
        raise ValueError(f"raw {t.name} data must be a uint8 tensor with at least one dim, "
                         f"got {raw.dtype} {tuple(raw.shape)}")
    if raw.shape[-1] % nbytes:
        raise ValueError(f"last dim of {raw.shape[-1]} bytes is not a whole number of "
                         f"{t.name} blocks of {nbytes} bytes")
    lead = raw.shape[:-1]
    cols = raw.shape[-1] // nbytes * elems
    if t in _FLOAT_VIEWS:
        out = dense(raw).view(_FLOAT_VIEWS[t]).to(torch.float32)  # [.., cols]
        return out.to(dtype, copy=True) if t == GgmlType.F32 else out.to(dtype)
    blocks = raw.reshape(-1, nbytes)  # [M, S]
    out = _DEQUANT[t](blocks)  # [M, B] float32
    return out.reshape(*lead, cols).to(dtype)  # [.., nb * B]


def ggml_linear_ref(x: torch.Tensor, raw: torch.Tensor, t: GgmlType,
                    bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for a GGUF weight ``W [N, K]`` stored as ``raw [N, K / B * S]``:
    dequantize to float32, multiply and add in float32, cast to x's dtype. ``x [.., K]`` ->
    ``[.., N]``. The oracle of the GGML matmul kernels."""
    if raw.dim() != 2:
        raise ValueError(f"raw weight must be 2-D [N, bytes], got {tuple(raw.shape)}")
    w = dequantize(raw, t)  # [N, K] float32
    if x.shape[-1] != w.shape[-1]:
        raise ValueError(f"x has {x.shape[-1]} input features, the {GgmlType(t).name} "
                         f"weight has {w.shape[-1]}")
    y = x.float() @ w.t()  # [.., N]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
