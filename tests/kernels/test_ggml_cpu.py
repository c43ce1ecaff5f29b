"""The CPU GGML linears (``cvllm/kernels/quant/ggml_cpu.py``) against the torch reference.

Expectation, per supported type, on random blocks with finite f16 scales:

- ``linear`` equals ``x @ dequantize(raw).T`` in float32 within 1.5% of the output's
  largest magnitude (atol) plus 1.5% relative. The budget: bf16 group scales (2^-9
  relative), bf16 activations (2^-9 per element) and the bf16 output (2^-9); the
  measured worst case on these shapes is about 0.5%.
- ``dequantize`` / ``embedding`` give the reference's values within the bf16 rounding of
  the group scales and zeros (0.5% of the weight's largest magnitude), and ``embedding``
  equals the rows of ``dequantize`` exactly. (Under ``ATEN_CPU_CAPABILITY=avx2`` the
  int4 packing differs and both come from GGUF's kept bytes; the tests pass there too.)
- The output has x's dtype and shape ``[M, N]`` for any M (1, a partial 4-row tile, the
  dequantize-then-F.linear path from ``DEQUANT_MIN_M`` rows), N that is not a multiple of
  the kernel's 64-row tile, a bias, and through the ``CpuBackend`` wrapper.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cvllm.kernels.quant import ggml_cpu
from cvllm.kernels.quant.ggml_types import BLOCK_SHAPES, QUANTIZED_TYPES, GgmlType
from cvllm.kernels.quant.reference import dequantize as ref_dequantize

TYPES = sorted(QUANTIZED_TYPES)
# Byte offsets of each block's f16 fields (ggml-common.h), overwritten with sane scales.
F16_FIELDS = {
    GgmlType.Q4_0: (0,), GgmlType.Q4_1: (0, 2), GgmlType.Q5_0: (0,), GgmlType.Q5_1: (0, 2),
    GgmlType.Q8_0: (0,), GgmlType.Q2_K: (80, 82), GgmlType.Q3_K: (108,),
    GgmlType.Q4_K: (0, 2), GgmlType.Q5_K: (0, 2), GgmlType.Q6_K: (208,),
    GgmlType.IQ4_NL: (0,), GgmlType.IQ4_XS: (0,),
}
N, K = 100, 512  # N: one full 64-row tile and a padded one


def _random_raw(t: GgmlType, n: int, k: int, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    elems, nbytes = BLOCK_SHAPES[t]
    raw = rng.integers(0, 256, (n, k // elems * nbytes), dtype=np.uint8)
    blocks = raw.reshape(-1, nbytes)  # a view: writes land in raw
    for off in F16_FIELDS[t]:
        scale = rng.uniform(-0.05, 0.05, (blocks.shape[0], 1)).astype(np.float16)
        blocks[:, off:off + 2] = scale.view(np.uint8)
    return torch.from_numpy(raw)


def _close(out: torch.Tensor, ref: torch.Tensor, frac: float):
    atol = frac * ref.abs().max().item()
    torch.testing.assert_close(out.float(), ref, rtol=frac, atol=atol)


@pytest.fixture(scope="module", params=TYPES, ids=lambda t: t.name)
def prepared(request):
    t = request.param
    raw = _random_raw(t, N, K, seed=int(t))
    return t, raw, ggml_cpu.prepare(raw, t, torch.bfloat16), ref_dequantize(raw, t)


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear_matches_reference(prepared, m, dtype):
    t, raw, w, ref = prepared
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(m)).to(dtype)
    y = ggml_cpu.linear(x, w)
    assert y.dtype == dtype and y.shape == (m, N) and y.is_contiguous()
    _close(y, x.float() @ ref.t(), 0.015)


def test_dequantize_and_embedding(prepared):
    t, raw, w, ref = prepared
    dq = ggml_cpu.dequantize(w, torch.float32)
    assert dq.shape == (N, K)
    _close(dq, ref, 0.005)
    ids = torch.tensor([0, 5, 63, 64, 99, 37, 5])
    emb = ggml_cpu.embedding(w, ids, torch.float32)
    torch.testing.assert_close(emb, dq[ids], rtol=0, atol=0)
    assert ggml_cpu.embedding(w, ids).dtype == torch.bfloat16  # the prepared dtype


def test_nbytes_is_quantized(prepared):
    t, raw, w, ref = prepared
    planes = {GgmlType.Q4_0: 1, GgmlType.Q4_1: 1, GgmlType.Q4_K: 1, GgmlType.Q2_K: 3}
    if t in ggml_cpu.DENSE_TYPES:
        assert w.planes == 0 and ggml_cpu.nbytes(w) == N * K * 2
    else:
        assert w.planes == planes.get(t, 2)
        # P planes of 4 bits plus a bf16 (scale, zero) per 32, on N padded to 128 rows
        # (+ GGUF's bytes on CPUs whose int4 packing is not the AVX-512 one)
        kept = raw.numel() if w.raw is not None else 0
        assert ggml_cpu.nbytes(w) == 128 * K * w.planes // 2 + 128 * K // 32 * w.planes * 4 + kept


def test_large_m_dequantize_path_and_bias():
    t = GgmlType.Q4_1
    raw = _random_raw(t, N, K, seed=7)
    w = ggml_cpu.prepare(raw, t, torch.float32)
    ref = ref_dequantize(raw, t)
    m = ggml_cpu.DEQUANT_MIN_M
    x = torch.randn(m, K)
    bias = torch.randn(N)
    y = ggml_cpu.linear(x, w, bias)
    assert y.shape == (m, N) and y.dtype == torch.float32
    _close(y, x @ ref.t() + bias, 0.015)


@pytest.mark.parametrize("isa", [None, "avx512_bf16", "amx"])
def test_large_m_multiplies_in_float32_without_amx(monkeypatch, isa):
    """Without AMX the dequantized weight multiplies x in float32 (a bf16 matmul is 3-4x
    slower there, and with AVX-512 BF16 alone a prefill was no faster in bf16); with AMX,
    in bf16: exactly ``F.linear`` on that dtype's dequantized weight, whatever x's dtype.
    Batch copies pay with either (``batch_copy_pays``)."""
    monkeypatch.setattr(ggml_cpu, "bf16_matmul_isa", lambda: isa)
    assert ggml_cpu.batch_copy_pays() == (isa is not None)
    assert ggml_cpu.batch_copy_from_m() == {"avx512_bf16": 8}.get(isa, 3)
    dt = torch.bfloat16 if isa == "amx" else torch.float32
    assert ggml_cpu.dequant_dtype() == dt
    t = GgmlType.Q4_K
    w = ggml_cpu.prepare(_random_raw(t, N, K, seed=5), t, torch.float32)
    for x_dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(ggml_cpu.DEQUANT_MIN_M, K).to(x_dtype)
        want = torch.nn.functional.linear(x.to(dt), ggml_cpu.dequantize(w, dt)).to(x_dtype)
        torch.testing.assert_close(ggml_cpu.linear(x, w), want, rtol=0, atol=0)


def test_dense_from_m_keeps_a_bf16_copy_for_batches():
    t = GgmlType.Q8_0
    raw = _random_raw(t, N, K, seed=3)
    w = ggml_cpu.prepare(raw, t, torch.bfloat16, dense_from_m=8)
    plain = ggml_cpu.prepare(raw, t, torch.bfloat16)
    assert ggml_cpu.nbytes(w) == ggml_cpu.nbytes(plain) + N * K * 2  # the bf16 copy
    ref = ref_dequantize(raw, t)
    for m in (1, 8):  # the int4 kernel, then the copy
        x = torch.randn(m, K, dtype=torch.bfloat16)
        _close(ggml_cpu.linear(x, w), x.float() @ ref.t(), 0.015)
    x = torch.randn(2, K, dtype=torch.bfloat16)
    torch.testing.assert_close(ggml_cpu.linear(x, w), ggml_cpu.linear(x, plain), rtol=0, atol=0)


@pytest.mark.parametrize("n", [N, 128], ids=["padded-n", "whole-tiles"])
def test_linear_fn_equals_linear(prepared, n):
    """``linear_fn`` (the flat decode loop's callable) gives ``linear``'s bits for every
    type, row count (int4 kernel, the batch copy from ``dense_from_m``, the dequantized
    product from ``DEQUANT_MIN_M``), activation dtype and bias; a one-plane weight whose
    rows fill whole 64-row tiles takes its direct kernel call (``n=128``)."""
    t = prepared[0]
    raw = _random_raw(t, n, K, seed=11)
    bias = torch.randn(n)
    for w in (ggml_cpu.prepare(raw, t, torch.float32),
              ggml_cpu.prepare(raw, t, torch.float32, dense_from_m=8)):
        for m in (1, 3, 8, ggml_cpu.DEQUANT_MIN_M):
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(m, K, generator=torch.Generator().manual_seed(m)).to(dtype)
                for b in (None, bias):
                    assert torch.equal(ggml_cpu.linear_fn(w, b)(x), ggml_cpu.linear(x, w, b))
    with pytest.raises(ValueError, match="x must be"):
        ggml_cpu.linear_fn(w)(torch.randn(1, K + 32))


def test_one_plane_types_are_the_ones_that_pack_into_one_plane():
    for t in TYPES:
        if t in ggml_cpu.DENSE_TYPES:
            continue
        w = ggml_cpu.prepare(_random_raw(t, 64, 256, seed=int(t)), t, torch.bfloat16)
        assert (w.planes == 1) == (t in ggml_cpu.ONE_PLANE_TYPES), (t.name, w.planes)


def test_batch_copy_only_for_types_it_pays_for():
    """``batch_copy``: a two-plane type keeps a bf16 copy and multiplies batches of
    ``BATCH_COPY_FROM_M`` rows and more with it (the same values as the planes, within
    bf16; ``batch_copy_from_m``: 3 rows on AMX, 8 with AVX-512 BF16); a one-plane type and
    Q6_K (already dense) keep none."""
    m0 = ggml_cpu.batch_copy_from_m()
    assert m0 == ggml_cpu.BATCH_COPY_FROM_M.get(ggml_cpu.bf16_matmul_isa(), 3)
    for t, copies in ((GgmlType.Q8_0, True), (GgmlType.Q5_K, True), (GgmlType.Q4_K, False),
                      (GgmlType.Q6_K, False)):
        raw = _random_raw(t, N, 256, seed=5)
        w = ggml_cpu.prepare(raw, t, torch.float32, batch_copy=True)
        plain = ggml_cpu.prepare(raw, t, torch.float32)
        extra = ggml_cpu.nbytes(w) - ggml_cpu.nbytes(plain)
        assert extra == ggml_cpu.batch_copy_bytes(t, (N, 256)) == (N * 256 * 2 if copies else 0)
        assert ggml_cpu.CpuBackend().batch_copy_bytes(t, (N, 256)) == extra
        ref = ref_dequantize(raw, t)
        for m in (m0 - 1, m0, 16):
            x = torch.randn(m, 256)
            _close(ggml_cpu.linear(x, w), x @ ref.t(), 0.015)
        if copies:  # below the threshold the int4 kernel, from it the copy
            x = torch.randn(m0 - 1, 256)
            torch.testing.assert_close(ggml_cpu.linear(x, w), ggml_cpu.linear(x, plain),
                                       rtol=0, atol=0)
            x = torch.randn(m0, 256)
            torch.testing.assert_close(ggml_cpu.linear(x, w),
                                       F.linear(x.bfloat16(), w.batch_dense).float(),
                                       rtol=0, atol=0)


def test_cpu_backend_wraps_the_module():
    backend = ggml_cpu.CpuBackend()
    assert backend.supports(GgmlType.Q4_1, torch.float32)
    assert not backend.supports(GgmlType.IQ2_XXS, torch.float32)
    raw = _random_raw(GgmlType.Q4_1, 64, 64)
    w = backend.prepare(raw, GgmlType.Q4_1, torch.bfloat16)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(backend.linear(x, w), ggml_cpu.linear(x, w), rtol=0, atol=0)
    ids = torch.tensor([3])
    assert backend.embedding(w, ids, torch.float32).shape == (1, 64)


def test_rejects_bad_input():
    raw = _random_raw(GgmlType.Q4_0, 4, 64)
    with pytest.raises(ValueError):
        ggml_cpu.prepare(raw[:, :-1], GgmlType.Q4_0, torch.float32)  # not whole blocks
    with pytest.raises(ValueError):
        ggml_cpu.prepare(raw, GgmlType.F16, torch.float32)  # not a quantized type
    w = ggml_cpu.prepare(raw, GgmlType.Q4_0, torch.float32)
    with pytest.raises(ValueError):
        ggml_cpu.linear(torch.randn(1, 32), w)
