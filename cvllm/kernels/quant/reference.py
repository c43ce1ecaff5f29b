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

import functools
from typing import Callable, Dict, Optional, Tuple

import torch

from cvllm.kernels.quant.ggml_types import (
    FLOAT_TYPES, QK_K, QUANTIZED_TYPES, GgmlType, block_shape,
)

# The 16 non-uniform levels of IQ4_NL / IQ4_XS (ggml's kvalues_iq4nl).
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)

_FLOAT_VIEWS = {GgmlType.F32: torch.float32, GgmlType.F16: torch.float16,
                GgmlType.BF16: torch.bfloat16}


# ----------------------------------------------------------------------------- bit helpers

def _fields(b: torch.Tensor, width: int) -> torch.Tensor:
    """Split each byte of ``b [.., n]`` into its ``8 // width`` bit fields, lowest first:
    ``[.., 8 // width, n]`` uint8. ggml packs a block's elements field-major (all low
    nibbles, then all high nibbles), so the new axis sits before the byte axis."""
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=b.device)
    return (b.unsqueeze(-2) >> shifts.view(-1, 1)) & ((1 << width) - 1)  # [.., F, n]


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous at an aligned offset, so a dtype view of it is legal whatever slice
    of a larger buffer it came from."""
    if t.is_contiguous() and t.storage_offset() % 8 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The little-endian f16 at byte ``offset`` of each block of ``blocks [M, S]``, as
    float32 ``[M, 1]`` (ggml widens every f16 scale before multiplying)."""
    return _dense(blocks[:, offset:offset + 2]).view(torch.float16).float()  # [M, 1]


def _signed(b: torch.Tensor) -> torch.Tensor:
    """Reinterpret uint8 bytes as int8 (same element size: legal on any strides)."""
    return b.view(torch.int8)


@functools.lru_cache(maxsize=None)
def _iq4_levels(device: torch.device) -> torch.Tensor:
    """IQ4 levels as float32 ``[16]`` on ``device``; cached so a CUDA call copies it once."""
    return torch.tensor(IQ4_LEVELS, dtype=torch.float32, device=device)


# ----------------------------------------------------------------------- 32-element types

def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    """block_q4_0: d f16 | 16 B nibbles (low = elements 0..15, high = 16..31); (q - 8) * d."""
    d = _f16(blocks, 0)
    q = _fields(blocks[:, 2:18], 4).reshape(-1, 32)  # [M, 32]
    return (q.float() - 8) * d


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """block_q4_1: d f16 | m f16 | 16 B nibbles; d * q + m."""
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _fields(blocks[:, 4:20], 4).reshape(-1, 32)  # [M, 32]
    return d * q.float() + m


def _q5_low_high(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """5-bit values ``[M, 32]`` of a Q5_0 / Q5_1 block: nibbles ``low [M, 16]`` plus bit j
    of the little-endian u32 ``high [M, 4]`` as bit 4 of element j."""
    ql = _fields(low, 4).reshape(-1, 32)  # [M, 32]
    qh = _fields(high, 1).transpose(-1, -2).reshape(-1, 32)  # [M, 32], byte-major bits
    return ql | (qh << 4)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    """block_q5_0: d f16 | qh u32 | 16 B nibbles; (q - 16) * d."""
    d = _f16(blocks, 0)
    q = _q5_low_high(blocks[:, 6:22], blocks[:, 2:6])
    return (q.float() - 16) * d


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    """block_q5_1: d f16 | m f16 | qh u32 | 16 B nibbles; d * q + m."""
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _q5_low_high(blocks[:, 8:24], blocks[:, 4:8])
    return d * q.float() + m


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """block_q8_0: d f16 | 32 int8; q * d."""
    return _signed(blocks[:, 2:34]).float() * _f16(blocks, 0)


def _iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    """block_iq4_nl: Q4_0's layout, the nibble indexing a non-uniform level; d * level."""
    d = _f16(blocks, 0)
    q = _fields(blocks[:, 2:18], 4).reshape(-1, 32)  # [M, 32]
    return d * _iq4_levels(blocks.device)[q.long()]


# ------------------------------------------------------------- 256-element K-quants / IQ4_XS

def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    """block_q2_K: 16 B scales (low nibble scale, high nibble min, per 16 elements) |
    64 B 2-bit quants | d f16 | dmin f16; (d * sc) * q - (dmin * m)."""
    sc = blocks[:, 0:16]
    dl = (_f16(blocks, 80) * (sc & 0xF).float()).unsqueeze(-1)  # [M, 16, 1]
    ml = (_f16(blocks, 82) * (sc >> 4).float()).unsqueeze(-1)  # [M, 16, 1]
    # Each 32-byte half holds 128 elements, four 2-bit planes of 32.
    q = _fields(blocks[:, 16:80].reshape(-1, 2, 32), 2).reshape(-1, 16, 16)  # [M, 16, 16]
    return (dl * q.float() - ml).reshape(-1, QK_K)


def _q3_k_scales(sc: torch.Tensor) -> torch.Tensor:
    """Sixteen 6-bit scales of a Q3_K block from its 12 bytes ``sc [M, 12]``: low nibbles
    from bytes 0..7 (scales 0..7 low, 8..15 high), 2 high bits from bytes 8..11 (scale s at
    byte 8 + s % 4, bits 2 * (s // 4)); stored biased by 32. int ``[M, 16]``."""
    low = _fields(sc[:, 0:8], 4).reshape(-1, 16)  # [M, 16]
    high = _fields(sc[:, 8:12], 2).reshape(-1, 16)  # [M, 16]
    return (low | (high << 4)).to(torch.int32) - 32


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    """block_q3_K: 32 B hmask | 64 B 2-bit quants | 12 B scales | d f16;
    (d * (sc - 32)) * (q2 - (hbit ? 0 : 4))."""
    dl = (_f16(blocks, 108) * _q3_k_scales(blocks[:, 96:108]).float()).unsqueeze(-1)
    low = _fields(blocks[:, 32:96].reshape(-1, 2, 32), 2).reshape(-1, 16, 16)  # [M, 16, 16]
    # hmask bit i of byte j belongs to element 32 * i + j; a clear bit subtracts 4.
    high = _fields(blocks[:, 0:32], 1).reshape(-1, 16, 16)  # [M, 16, 16]
    q = low.to(torch.int32) - ((high ^ 1).to(torch.int32) << 2)
    return (dl * q.float()).reshape(-1, QK_K)


def _k_scale_min(sc: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Eight 6-bit (scale, min) pairs of a Q4_K / Q5_K block from ``sc [M, 12]``
    (ggml's get_scale_min_k4): pairs 0..3 in the low 6 bits of bytes 0..3 / 4..7, pairs
    4..7 from the nibbles of bytes 8..11 plus the top 2 bits of bytes 0..3 / 4..7.
    Two float32 ``[M, 8, 1]``."""
    a, b, c = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]  # [M, 4] each
    scale = torch.cat([a & 63, (c & 0xF) | ((a >> 6) << 4)], dim=-1)  # [M, 8]
    mins = torch.cat([b & 63, (c >> 4) | ((b >> 6) << 4)], dim=-1)  # [M, 8]
    return scale.float().unsqueeze(-1), mins.float().unsqueeze(-1)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """block_q4_K: d f16 | dmin f16 | 12 B scales | 128 B nibbles (32 bytes per pair of
    sub-blocks: low nibbles the first 32 elements); (d * sc) * q - (dmin * m)."""
    sc, mn = _k_scale_min(blocks[:, 4:16])
    dl, ml = _f16(blocks, 0).unsqueeze(-1) * sc, _f16(blocks, 2).unsqueeze(-1) * mn
    q = _fields(blocks[:, 16:144].reshape(-1, 4, 32), 4).reshape(-1, 8, 32)  # [M, 8, 32]
    return (dl * q.float() - ml).reshape(-1, QK_K)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    """block_q5_K: Q4_K plus 32 B qh before the nibbles (bit i of byte j is bit 4 of
    element 32 * i + j)."""
    sc, mn = _k_scale_min(blocks[:, 4:16])
    dl, ml = _f16(blocks, 0).unsqueeze(-1) * sc, _f16(blocks, 2).unsqueeze(-1) * mn
    low = _fields(blocks[:, 48:176].reshape(-1, 4, 32), 4).reshape(-1, 8, 32)  # [M, 8, 32]
    high = _fields(blocks[:, 16:48], 1)  # [M, 8, 32]
    return (dl * (low | (high << 4)).float() - ml).reshape(-1, QK_K)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """block_q6_K: 128 B low nibbles | 64 B 2-bit highs | 16 int8 scales | d f16;
    (d * sc) * (q - 32). Each 128-element half takes 64 B of nibbles (two planes of 64)
    and 32 B of highs (four planes of 32)."""
    dl = (_f16(blocks, 208) * _signed(blocks[:, 192:208]).float()).unsqueeze(-1)  # [M,16,1]
    low = _fields(blocks[:, 0:128].reshape(-1, 2, 64), 4).reshape(-1, QK_K)  # [M, 256]
    high = _fields(blocks[:, 128:192].reshape(-1, 2, 32), 2).reshape(-1, QK_K)  # [M, 256]
    q = (low | (high << 4)).to(torch.int32) - 32
    return (dl * q.float().reshape(-1, 16, 16)).reshape(-1, QK_K)


def _iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    """block_iq4_xs: d f16 | scales_h u16 | 4 B scales_l | 128 B nibbles; 6-bit sub-block
    scales (low nibble from scales_l, 2 bits from scales_h) biased by 32;
    (d * (ls - 32)) * level. Each sub-block of 32 is 16 bytes: low nibbles first."""
    low = _fields(blocks[:, 4:8], 4).transpose(-1, -2).reshape(-1, 8)  # [M, 8]
    high = _fields(blocks[:, 2:4], 2).transpose(-1, -2).reshape(-1, 8)  # [M, 8]
    ls = (low | (high << 4)).to(torch.int32) - 32
    dl = (_f16(blocks, 0) * ls.float()).unsqueeze(-1)  # [M, 8, 1]
    q = _fields(blocks[:, 8:136].reshape(-1, 8, 16), 4).reshape(-1, 8, 32)  # [M, 8, 32]
    return (dl * _iq4_levels(blocks.device)[q.long()]).reshape(-1, QK_K)


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
        out = _dense(raw).view(_FLOAT_VIEWS[t]).to(torch.float32)  # [.., cols]
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
