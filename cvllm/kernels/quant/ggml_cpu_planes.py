"""GGML blocks in the integer form and the int4 planes of torch's CPU int4 kernel
(``aten._weight_int4pack_mm_for_cpu``), for ``ggml_cpu.prepare``.

The kernel multiplies by 4-bit codes ``v`` that stand for ``scale * (v - 8) + zero``
with a (scale, zero) pair per 32 inputs. Every GGML type is first written in an
*integer form*, ``w = s * c + z`` with an integer ``c`` and one (s, z) per 32 inputs
(``_INT_FORMS``), then ``c`` becomes int4 *planes* (``pack_rows``):

- ``c`` spans at most 16 values (Q4_0, Q4_1, Q4_K): one plane.
- ``c`` fits int8 (Q5_*, Q8_0, IQ4_*, Q3_K with its sub-block scale folded into ``c``):
  two planes, ``c = 16 * (c >> 4) + (c & 15)``; the high nibble gets scale ``16 s``.
- Q2_K: two planes for ``sc * q`` and one for the sub-block mins (``-dmin * m``).
- Q6_K (16-element sub-blocks with an 8-bit scale each, which no 32-group int4 plane can
  hold): no integer form (``DENSE_TYPES``); ``ggml_cpu`` keeps a dense copy.

The planes of one weight are laid side by side along K, so one kernel call multiplies
``[x, x, ..]`` (``P * K`` inputs) by all of them. Block fields are read with
``ggml_fields`` (as the reference dequantizer reads them). Scales are rounded to bf16
first (``_bf16``): the zeros are derived from the scale the kernel will use. No state.

Shapes: ``N`` output features, ``K`` input features, ``P`` planes, ``G`` = 32 inputs per
(scale, zero) group, ``R`` block rows.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch

from cvllm.kernels.quant.ggml_fields import (
    IQ4_LEVELS, f16, fields, k_scale_min, q3_k_scales, q5_low_high, signed,
)
from cvllm.kernels.quant.ggml_types import QK_K, QUANTIZED_TYPES, GgmlType, block_shape

GROUP = 32
"""Inputs per (scale, zero) pair: every supported type has 32-element (sub-)blocks."""

DENSE_TYPES = frozenset({GgmlType.Q6_K})
"""Types kept as a dense copy in the activation dtype (see the module docstring)."""

ONE_PLANE_TYPES = frozenset({GgmlType.Q4_0, GgmlType.Q4_1, GgmlType.Q4_K})
"""Types whose codes span 16 values: one int4 plane (the others take two, Q2_K three)."""

# An integer term: codes c [R, E] (int32), scale s and zero z [R, E / 32] (float32, z may
# be None), and the static range (lo, hi) of c for this type.
Term = Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], int, int]


# ------------------------------------------------------------------ integer forms per type

def _int_levels(device: torch.device) -> torch.Tensor:
    return torch.tensor(IQ4_LEVELS, dtype=torch.int32, device=device)  # [16]


def _int_q4_0(b: torch.Tensor) -> List[Term]:
    q = fields(b[:, 2:18], 4).reshape(-1, 32).int()  # [R, 32]
    return [(q - 8, f16(b, 0), None, -8, 7)]


def _int_q4_1(b: torch.Tensor) -> List[Term]:
    q = fields(b[:, 4:20], 4).reshape(-1, 32).int()  # [R, 32]
    return [(q, f16(b, 0), f16(b, 2), 0, 15)]


def _int_q5_0(b: torch.Tensor) -> List[Term]:
    q = q5_low_high(b[:, 6:22], b[:, 2:6]).int()  # [R, 32]
    return [(q - 16, f16(b, 0), None, -16, 15)]


def _int_q5_1(b: torch.Tensor) -> List[Term]:
    q = q5_low_high(b[:, 8:24], b[:, 4:8]).int()  # [R, 32]
    return [(q, f16(b, 0), f16(b, 2), 0, 31)]


def _int_q8_0(b: torch.Tensor) -> List[Term]:
    return [(signed(b[:, 2:34]).int(), f16(b, 0), None, -128, 127)]


def _int_iq4_nl(b: torch.Tensor) -> List[Term]:
    q = fields(b[:, 2:18], 4).reshape(-1, 32).long()  # [R, 32]
    return [(_int_levels(b.device)[q], f16(b, 0), None, -127, 113)]


def _int_q4_k(b: torch.Tensor) -> List[Term]:
    sc, mn = k_scale_min(b[:, 4:16])  # [R, 8, 1] each
    q = fields(b[:, 16:144].reshape(-1, 4, 32), 4).reshape(-1, QK_K).int()  # [R, 256]
    s = (f16(b, 0).unsqueeze(-1) * sc).squeeze(-1)  # [R, 8]
    z = -(f16(b, 2).unsqueeze(-1) * mn).squeeze(-1)  # [R, 8]
    return [(q, s, z, 0, 15)]


def _int_q5_k(b: torch.Tensor) -> List[Term]:
    sc, mn = k_scale_min(b[:, 4:16])  # [R, 8, 1] each
    low = fields(b[:, 48:176].reshape(-1, 4, 32), 4).reshape(-1, 8, 32)  # [R, 8, 32]
    high = fields(b[:, 16:48], 1)  # [R, 8, 32]
    q = (low | (high << 4)).reshape(-1, QK_K).int()  # [R, 256]
    s = (f16(b, 0).unsqueeze(-1) * sc).squeeze(-1)  # [R, 8]
    z = -(f16(b, 2).unsqueeze(-1) * mn).squeeze(-1)  # [R, 8]
    return [(q, s, z, 0, 31)]


def _int_iq4_xs(b: torch.Tensor) -> List[Term]:
    low = fields(b[:, 4:8], 4).transpose(-1, -2).reshape(-1, 8)  # [R, 8]
    high = fields(b[:, 2:4], 2).transpose(-1, -2).reshape(-1, 8)  # [R, 8]
    s = f16(b, 0) * ((low | (high << 4)).float() - 32)  # [R, 8]
    q = fields(b[:, 8:136].reshape(-1, 8, 16), 4).reshape(-1, QK_K).long()  # [R, 256]
    return [(_int_levels(b.device)[q], s, None, -127, 113)]


def _int_q3_k(b: torch.Tensor) -> List[Term]:
    # The 16-element sub-blocks' 6-bit scales are folded into the codes, leaving one f16
    # scale per 256; negated because (sc - 32) * q spans [-124, 128], one past int8.
    sc = q3_k_scales(b[:, 96:108]).unsqueeze(-1)  # [R, 16, 1]
    low = fields(b[:, 32:96].reshape(-1, 2, 32), 2).reshape(-1, 16, 16)  # [R, 16, 16]
    high = fields(b[:, 0:32], 1).reshape(-1, 16, 16)  # [R, 16, 16]
    q = low.int() - ((high ^ 1).int() << 2)  # [R, 16, 16]
    c = -(sc * q).reshape(-1, QK_K)  # [R, 256]
    return [(c, -f16(b, 108).expand(-1, 8), None, -128, 124)]


def _int_q2_k(b: torch.Tensor) -> List[Term]:
    # (d * sc) * q - dmin * m per 16 elements: sc * q is an integer (0..45) under one
    # scale d, and the mins m become a third plane of their own under -dmin.
    sc = b[:, 0:16].int().unsqueeze(-1)  # [R, 16, 1]
    q = fields(b[:, 16:80].reshape(-1, 2, 32), 2).reshape(-1, 16, 16).int()  # [R, 16, 16]
    c = ((sc & 0xF) * q).reshape(-1, QK_K)  # [R, 256]
    m = (sc >> 4).expand(-1, 16, 16).reshape(-1, QK_K)  # [R, 256]
    d, dmin = f16(b, 80).expand(-1, 8), f16(b, 82).expand(-1, 8)  # [R, 8]
    return [(c, d, None, 0, 45), (m, -dmin, None, 0, 15)]


_INT_FORMS: Dict[GgmlType, Callable[[torch.Tensor], List[Term]]] = {
    GgmlType.Q4_0: _int_q4_0, GgmlType.Q4_1: _int_q4_1, GgmlType.Q5_0: _int_q5_0,
    GgmlType.Q5_1: _int_q5_1, GgmlType.Q8_0: _int_q8_0, GgmlType.IQ4_NL: _int_iq4_nl,
    GgmlType.Q2_K: _int_q2_k, GgmlType.Q3_K: _int_q3_k, GgmlType.Q4_K: _int_q4_k,
    GgmlType.Q5_K: _int_q5_k, GgmlType.IQ4_XS: _int_iq4_xs,
}
assert set(_INT_FORMS) | DENSE_TYPES == set(QUANTIZED_TYPES)


# ------------------------------------------------------------------------ integer -> planes

def _bf16(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to bf16 and widened again, so zeros are derived from the scale the
    kernel will actually use (8 * bf16(d) is then exact, and Q8_0 stays bf16(d) * q)."""
    return t.to(torch.bfloat16).float()


def _term_planes(term: Term, rows: int, cols: int):
    """One integer term -> its int4 planes: a list of (codes int32 [rows, cols] in 0..15,
    scale, zero float32 [rows, cols / 32])."""
    c, s, z, lo, hi = term
    c = c.reshape(rows, cols)  # [N, K]
    s = _bf16(s.reshape(rows, cols // GROUP))  # [N, K / G]
    z = torch.zeros_like(s) if z is None else z.reshape(rows, cols // GROUP)
    if hi - lo < 16:
        # w = s * c + z = s * ((c - lo) - 8) + (z + s * (lo + 8))
        return [(c - lo, s, z + s * (lo + 8))]
    assert -128 <= lo and hi <= 127, (lo, hi)
    # c = 16 * (c >> 4) + (c & 15), high nibble signed in [-8, 7]: codes (c >> 4) + 8
    # under 16 s, and (c & 15) under s with zero z + 8 s.
    return [((c >> 4) + 8, 16 * s, torch.zeros_like(s)), (c & 15, s, z + 8 * s)]


def pack_rows(raw: torch.Tensor, t: GgmlType, k: int):
    """``raw uint8 [n, K / B * S]`` (n a multiple of 64) -> (packed uint8 [n, P * K / 2],
    scales_zeros bf16 [P * K / 32, n, 2], P)."""
    n = raw.shape[0]
    elems, nbytes = block_shape(t)
    terms = _INT_FORMS[t](raw.reshape(-1, nbytes))  # blocks [n * K / B, S]
    planes = [p for term in terms for p in _term_planes(term, n, k)]
    codes = torch.cat([p[0] for p in planes], dim=1)  # [n, P * K] int32
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)
    scales = torch.cat([p[1] for p in planes], dim=1)  # [n, P * K / G]
    zeros = torch.cat([p[2] for p in planes], dim=1)  # [n, P * K / G]
    sz = torch.stack([scales, zeros], dim=-1).transpose(0, 1)  # [P * K / G, n, 2]
    return packed, sz.to(torch.bfloat16).contiguous(), len(planes)
