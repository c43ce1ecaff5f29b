"""The GGML (GGUF) weight types: ids, block shapes, and which ones cvllm keeps quantized.

Read by the GGUF loader, the GGUF quantization config and method, the quantizers
(``quantization/ggml_quantizer.py``), the torch references (``kernels/quant/reference.py``)
and the Triton / CPU kernels. No torch here: a plain table, the same on every rank.

A quantized weight ``[N, K]`` is stored as GGUF stores it: ``uint8 [N, K // B * S]``,
each row a run of ``K // B`` blocks of ``S`` bytes, a block holding ``B`` consecutive
elements of the row (``B`` = ``block_elems``, ``S`` = ``block_bytes``). Rows are
independent, so a split of the output features is any row range, and a split of the input
features must fall on a block boundary (``K / tp`` a multiple of ``B``).
"""

from __future__ import annotations

from enum import IntEnum
from typing import Dict, Tuple


class GgmlType(IntEnum):
    """GGML tensor type ids, as written in GGUF files (ggml.h)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39


QK_K = 256
"""Elements of a K-quant super-block."""

BLOCK_SHAPES: Dict[GgmlType, Tuple[int, int]] = {
    GgmlType.F32: (1, 4), GgmlType.F16: (1, 2), GgmlType.BF16: (1, 2),
    GgmlType.Q4_0: (32, 18), GgmlType.Q4_1: (32, 20), GgmlType.Q5_0: (32, 22),
    GgmlType.Q5_1: (32, 24), GgmlType.Q8_0: (32, 34), GgmlType.Q8_1: (32, 40),
    GgmlType.Q2_K: (256, 84), GgmlType.Q3_K: (256, 110), GgmlType.Q4_K: (256, 144),
    GgmlType.Q5_K: (256, 176), GgmlType.Q6_K: (256, 210), GgmlType.Q8_K: (256, 292),
    GgmlType.IQ2_XXS: (256, 66), GgmlType.IQ2_XS: (256, 74), GgmlType.IQ3_XXS: (256, 98),
    GgmlType.IQ1_S: (256, 50), GgmlType.IQ4_NL: (32, 18), GgmlType.IQ3_S: (256, 110),
    GgmlType.IQ2_S: (256, 82), GgmlType.IQ4_XS: (256, 136), GgmlType.I8: (1, 1),
    GgmlType.I16: (1, 2), GgmlType.I32: (1, 4), GgmlType.I64: (1, 8), GgmlType.F64: (1, 8),
    GgmlType.IQ1_M: (256, 56), GgmlType.TQ1_0: (256, 54), GgmlType.TQ2_0: (256, 66),
    GgmlType.MXFP4: (32, 17),
}
"""``type -> (block_elems, block_bytes)``."""

FLOAT_TYPES = frozenset({GgmlType.F32, GgmlType.F16, GgmlType.BF16})
"""Plain float tensors: loaded into an unquantized parameter in the model dtype."""

QUANTIZED_TYPES = frozenset({
    GgmlType.Q4_0, GgmlType.Q4_1, GgmlType.Q5_0, GgmlType.Q5_1, GgmlType.Q8_0,
    GgmlType.Q2_K, GgmlType.Q3_K, GgmlType.Q4_K, GgmlType.Q5_K, GgmlType.Q6_K,
    GgmlType.IQ4_NL, GgmlType.IQ4_XS,
})
"""Block-quantized types kept as blocks on the device and multiplied by cvllm's kernels.
Any other type is dequantized at load (one warning per type)."""

ISQ_TYPES: Dict[str, GgmlType] = {
    "q4_0": GgmlType.Q4_0, "q4_1": GgmlType.Q4_1, "q5_0": GgmlType.Q5_0,
    "q5_1": GgmlType.Q5_1, "q8_0": GgmlType.Q8_0, "q2k": GgmlType.Q2_K,
    "q3k": GgmlType.Q3_K, "q4k": GgmlType.Q4_K, "q5k": GgmlType.Q5_K, "q6k": GgmlType.Q6_K,
}
"""``--isq`` names (candle-vllm's) -> the type the float weights are quantized to."""


def block_shape(t: GgmlType) -> Tuple[int, int]:
    """``(block_elems, block_bytes)`` of ``t``; ValueError for an unknown id."""
    try:
        return BLOCK_SHAPES[GgmlType(t)]
    except (ValueError, KeyError):
        raise ValueError(f"unknown GGML type id {int(t)}") from None


def row_bytes(t: GgmlType, cols: int) -> int:
    """Bytes of one row of ``cols`` elements; ValueError when ``cols`` is not whole blocks."""
    elems, nbytes = block_shape(t)
    if cols % elems:
        raise ValueError(f"a row of {cols} elements is not a whole number of {GgmlType(t).name} "
                         f"blocks of {elems}")
    return cols // elems * nbytes


def parse_isq(name: str) -> GgmlType:
    """The type of an ``--isq`` name (case-insensitive; ``q4_k`` is taken for ``q4k``)."""
    key = name.strip().lower()
    key = {"q2_k": "q2k", "q3_k": "q3k", "q4_k": "q4k", "q5_k": "q5k", "q6_k": "q6k"}.get(key, key)
    if key not in ISQ_TYPES:
        raise ValueError(f"unknown --isq type {name!r}; choose one of {', '.join(ISQ_TYPES)}")
    return ISQ_TYPES[key]
