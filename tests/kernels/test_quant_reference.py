"""The torch GGML dequantizer (``cvllm/kernels/quant/reference.py``) against gguf-py.

Expectation: bit-exact equality with ``gguf.quants.dequantize`` (float32) for every
supported type, both on blocks gguf-py quantized itself and on random bytes whose f16
scale fields are overwritten with finite values (random f16 bits would give NaN / inf
scales). The float types are compared bitwise with NaN == NaN, since their random bytes
are not sanitized. ``ggml_linear_ref`` is checked against gguf dequantize + torch matmul
to float32 rounding. A meta-device run shows the dequantizer never reads tensor data on
the host (no syncs); the ``gpu`` test repeats the comparison on CUDA.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from cvllm.kernels.quant.ggml_types import BLOCK_SHAPES, FLOAT_TYPES, QUANTIZED_TYPES, GgmlType
from cvllm.kernels.quant.reference import dequantize, ggml_linear_ref

SUPPORTED = sorted(QUANTIZED_TYPES | FLOAT_TYPES)
GGUF_QUANTIZABLE = [GgmlType.Q4_0, GgmlType.Q4_1, GgmlType.Q5_0, GgmlType.Q5_1,
                    GgmlType.Q8_0, GgmlType.BF16, GgmlType.F16]
# Byte offsets of each block's f16 fields (d, and dmin / m where the type has one), from
# ggml-common.h's block structs.
F16_FIELDS = {
    GgmlType.Q4_0: (0,), GgmlType.Q4_1: (0, 2), GgmlType.Q5_0: (0,), GgmlType.Q5_1: (0, 2),
    GgmlType.Q8_0: (0,), GgmlType.Q2_K: (80, 82), GgmlType.Q3_K: (108,),
    GgmlType.Q4_K: (0, 2), GgmlType.Q5_K: (0, 2), GgmlType.Q6_K: (208,),
    GgmlType.IQ4_NL: (0,), GgmlType.IQ4_XS: (0,),
}
# Leading dims and blocks per row: one block, several rows of several blocks, 3-D.
SHAPES = [((1,), 1), ((4,), 3), ((2, 3), 2)]


def _random_blocks(t: GgmlType, lead, nb: int, seed: int = 0) -> np.ndarray:
    """Random uint8 ``[*lead, nb * S]`` of type ``t`` with finite, moderate f16 scales."""
    rng = np.random.default_rng(seed)
    nbytes = BLOCK_SHAPES[t][1]
    raw = rng.integers(0, 256, (*lead, nb * nbytes), dtype=np.uint8)
    blocks = raw.reshape(-1, nbytes)  # a view: writes land in raw
    for off in F16_FIELDS.get(t, ()):
        scale = rng.uniform(-2.0, 2.0, (blocks.shape[0], 1)).astype(np.float16)
        blocks[:, off:off + 2] = scale.view(np.uint8)
    return raw


def _gguf_quantized(t: GgmlType, lead, nb: int, seed: int = 0) -> np.ndarray:
    """Blocks ``[*lead, nb * S]`` made by gguf-py's own quantizer from random floats."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((*lead, nb * BLOCK_SHAPES[t][0])) * 3).astype(np.float32)
    return np.ascontiguousarray(gguf_quantize(x, gguf.GGMLQuantizationType(int(t)))).view(np.uint8)


def _reference(raw: np.ndarray, t: GgmlType) -> torch.Tensor:
    return torch.from_numpy(np.array(gguf_dequantize(raw, gguf.GGMLQuantizationType(int(t)))))


def _assert_bit_exact(out: torch.Tensor, ref: torch.Tensor):
    assert out.dtype == torch.float32 and out.shape == ref.shape
    torch.testing.assert_close(out, ref.float(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("lead,nb", SHAPES)
@pytest.mark.parametrize("t", GGUF_QUANTIZABLE, ids=lambda t: t.name)
def test_exact_on_gguf_quantized_blocks(t, lead, nb):
    raw = _gguf_quantized(t, lead, nb)
    out = dequantize(torch.from_numpy(raw), t)
    assert out.shape == (*lead, nb * BLOCK_SHAPES[t][0])
    _assert_bit_exact(out, _reference(raw, t))


@pytest.mark.parametrize("lead,nb", SHAPES)
@pytest.mark.parametrize("t", SUPPORTED, ids=lambda t: t.name)
def test_exact_on_random_blocks(t, lead, nb):
    raw = _random_blocks(t, lead, nb, seed=nb)
    ref = _reference(raw, t)
    if t in QUANTIZED_TYPES:  # every f16 field was found and sanitized
        assert torch.isfinite(ref).all()
    _assert_bit_exact(dequantize(torch.from_numpy(raw), t), ref)


@pytest.mark.parametrize("t", [GgmlType.Q5_0, GgmlType.Q4_K, GgmlType.IQ4_XS, GgmlType.F16],
                         ids=lambda t: t.name)
def test_strided_and_unaligned_input(t):
    """Column slices of a bigger buffer: strided rows, and a contiguous row at an odd byte
    offset (a dtype view of the f16 fields needs alignment)."""
    raw = _random_blocks(t, (3,), 2)
    ref = _reference(raw, t)
    width = raw.shape[1]
    padded = torch.zeros(3, width + 5, dtype=torch.uint8)
    padded[:, 1:1 + width] = torch.from_numpy(raw)
    _assert_bit_exact(dequantize(padded[:, 1:1 + width], t), ref)
    flat = torch.zeros(width + 3, dtype=torch.uint8)
    flat[3:] = torch.from_numpy(raw[1])
    _assert_bit_exact(dequantize(flat[3:], t), ref[1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t", [GgmlType.Q6_K, GgmlType.Q4_1, GgmlType.BF16], ids=lambda t: t.name)
def test_output_dtype_is_one_cast_of_float32(t, dtype):
    raw = torch.from_numpy(_random_blocks(t, (2,), 2))
    out = dequantize(raw, t, dtype)
    assert out.dtype == dtype
    torch.testing.assert_close(out, dequantize(raw, t).to(dtype), rtol=0, atol=0,
                               equal_nan=True)


def test_f32_returns_a_copy():
    raw = torch.from_numpy(np.arange(8, dtype=np.float32).view(np.uint8).copy())
    out = dequantize(raw, GgmlType.F32)
    raw.zero_()
    assert out.tolist() == list(range(8))


@pytest.mark.parametrize("t", SUPPORTED, ids=lambda t: t.name)
def test_meta_device_needs_no_data(t):
    """On the meta device any host read of tensor data would raise: the dequantizer is
    shape-only Python around device ops, so it cannot sync a CUDA stream either."""
    elems, nbytes = BLOCK_SHAPES[t]
    raw = torch.empty(2, 3, 2 * nbytes, dtype=torch.uint8, device="meta")
    out = dequantize(raw, t, torch.bfloat16)
    assert out.device.type == "meta" and out.dtype == torch.bfloat16
    assert out.shape == (2, 3, 2 * elems)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t", SUPPORTED, ids=lambda t: t.name)
def test_exact_on_cuda(t):
    raw = _random_blocks(t, (2, 3), 2)
    out = dequantize(torch.from_numpy(raw).cuda(), t)
    assert out.is_cuda
    _assert_bit_exact(out.cpu(), _reference(raw, t))


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [GgmlType.Q4_0, GgmlType.Q8_0, GgmlType.Q3_K, GgmlType.Q5_K,
                               GgmlType.IQ4_NL, GgmlType.F16], ids=lambda t: t.name)
def test_linear_ref_matches_gguf_dequantize_matmul(t, x_dtype):
    n, nb = 5, 2
    k = nb * BLOCK_SHAPES[t][0]
    raw = _random_blocks(t, (n,), nb)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, k, generator=g).to(x_dtype)  # [2, 3, K]
    bias = torch.randn(n, generator=g).to(x_dtype)
    w = _reference(raw, t)  # [N, K] float32
    out = ggml_linear_ref(x, torch.from_numpy(raw), t, bias)
    assert out.shape == (2, 3, n) and out.dtype == x_dtype
    want = (x.float() @ w.t() + bias.float()).to(x_dtype)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert ggml_linear_ref(x, torch.from_numpy(raw), t).shape == (2, 3, n)


def test_linear_ref_rejects_mismatched_k():
    raw = torch.from_numpy(_random_blocks(GgmlType.Q8_0, (4,), 2))
    with pytest.raises(ValueError, match="input features"):
        ggml_linear_ref(torch.randn(3, 32), raw, GgmlType.Q8_0)


@pytest.mark.parametrize("t", [GgmlType.Q8_1, GgmlType.IQ2_XXS, GgmlType.TQ1_0,
                               GgmlType.I32, GgmlType.MXFP4], ids=lambda t: t.name)
def test_unsupported_type_is_named(t):
    raw = torch.zeros(2, BLOCK_SHAPES[t][1], dtype=torch.uint8)
    with pytest.raises(ValueError, match=t.name):
        dequantize(raw, t)


def test_unknown_type_id():
    with pytest.raises(ValueError, match="99"):
        dequantize(torch.zeros(2, 18, dtype=torch.uint8), 99)


@pytest.mark.parametrize("t", [GgmlType.Q4_0, GgmlType.Q6_K, GgmlType.F16], ids=lambda t: t.name)
def test_partial_block_is_refused(t):
    raw = torch.zeros(2, BLOCK_SHAPES[t][1] * 2 + 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match="whole number"):
        dequantize(raw, t)


def test_non_uint8_is_refused():
    with pytest.raises(ValueError, match="uint8"):
        dequantize(torch.zeros(2, 18, dtype=torch.int8), GgmlType.Q4_0)
