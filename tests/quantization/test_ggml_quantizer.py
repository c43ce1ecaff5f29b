"""cvllm.quantization.ggml_quantizer: float -> GGUF blocks, checked through gguf-py's
dequantizer (an implementation independent of cvllm's) and against llama.cpp's reference
quantizers' bytes."""

import hashlib

import gguf
import numpy as np
import pytest
import torch

from cvllm.kernels.quant.ggml_types import BLOCK_SHAPES, ISQ_TYPES, GgmlType
from cvllm.quantization.ggml_quantizer import QUANTIZER_TYPES, quantize

PLAIN = [GgmlType.Q4_0, GgmlType.Q4_1, GgmlType.Q5_0, GgmlType.Q5_1, GgmlType.Q8_0]
K_TYPES = [GgmlType.Q2_K, GgmlType.Q3_K, GgmlType.Q4_K, GgmlType.Q5_K, GgmlType.Q6_K]

# RMS round-trip error / std on N(0, 1) weights (measured: tools/quant_error.py), ~10% slack.
RMS_BOUND = {
    GgmlType.Q2_K: 0.33, GgmlType.Q3_K: 0.166, GgmlType.Q4_0: 0.095, GgmlType.Q4_1: 0.087,
    GgmlType.Q4_K: 0.079, GgmlType.Q5_0: 0.047, GgmlType.Q5_1: 0.042, GgmlType.Q5_K: 0.040,
    GgmlType.Q6_K: 0.0195, GgmlType.Q8_0: 0.006,
}

# sha256 of llama.cpp's quantize_row_<type>_ref output on golden_weights() (from the
# functions in llama.cpp's ggml-quants.c, called through ctypes; not a test dependency).
LLAMA_CPP_SHA256 = {
    "Q4_0": "165719fb62b495f9078c904a6a8f1dbc8ad134e6288b071ec324003d1c295ad7",
    "Q4_1": "b94fc4cc98a628858d9a103ddfd3442d4c1aa8000a358974778b640f27c8878f",
    "Q5_0": "c218cc0d9abddf7e80286fd67bacb4aa7b3e94b6a6589c9a03475772700b14af",
    "Q5_1": "dea2f8e54463d1d9bee3f1df60d4b28c336f8bd339980e72b92e02a3d991c7ba",
    "Q8_0": "e1234eefcc30dfc4036062971c3fe71214d301ff64a87e39c718b414f397fe0d",
    "Q2_K": "e65cc28ad3af59c894dc71e3c5f10979306e25e91fb5e5ff18e0e27fe8de15e2",
    "Q3_K": "7357d32a982b4283bfd96014b03f83a093e16d0e99369084ddc470a1cfb2d0f5",
    "Q4_K": "40ec22cabbb5f9c432291fc527a34f649023a3c8aa417d450e89fd4213f18ce6",
    "Q5_K": "1ef24b9681a254e0fe672986f7a1985281db930b2bb1c2c92e46bb7b054e538b",
    "Q6_K": "2c647fe16ef0e3a6ca80845caed4970e184dc1d3b72647542ee6f91a68f71e3e",
}


def golden_weights(rows: int = 16, cols: int = 1024) -> np.ndarray:
    """Near-Gaussian weights from integer hashing (the same bits on every platform and
    torch version), plus rows that reach the quantizers' special cases: zeros, constants,
    spikes, a large scale and a third of the values exactly 0."""
    n = rows * cols * 4
    state = np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    state += np.uint64(0x2545F4914F6CDD1D)
    state ^= state >> np.uint64(33)
    state *= np.uint64(0xFF51AFD7ED558CCD)
    state ^= state >> np.uint64(33)
    u = (state >> np.uint64(40)).astype(np.float64) / float(1 << 24)
    x = (u.reshape(rows, cols, 4).sum(-1) - 2.0).astype(np.float32)  # Irwin-Hall, std 0.58
    x[1] = 0.0
    x[2] = 0.25
    x[3] = -0.75
    x[4, ::97] = 40.0
    x[5] *= 1000.0
    x[6, ::3] = 0.0
    return x


@pytest.fixture(scope="module")
def gaussian() -> torch.Tensor:
    return torch.randn(64, 1024, generator=torch.Generator().manual_seed(0))  # [N, K]


@pytest.fixture(scope="module")
def quantized(gaussian) -> dict:
    return {t: quantize(gaussian, t) for t in PLAIN + K_TYPES}


def dequantize(blocks: torch.Tensor, t: GgmlType) -> np.ndarray:
    return gguf.quants.dequantize(blocks.cpu().numpy(), gguf.GGMLQuantizationType(int(t)))


def rel_rms(blocks: torch.Tensor, w: torch.Tensor, t: GgmlType) -> float:
    ref = w.float().numpy()
    return float(np.sqrt(((dequantize(blocks, t) - ref) ** 2).mean()) / ref.std())


def test_every_isq_type_has_a_quantizer():
    assert set(ISQ_TYPES.values()) == set(QUANTIZER_TYPES)


@pytest.mark.parametrize("t", PLAIN + K_TYPES, ids=lambda t: t.name)
def test_round_trip_rms_below_bound(gaussian, quantized, t):
    blocks = quantized[t]
    elems, nbytes = BLOCK_SHAPES[t]
    assert blocks.dtype == torch.uint8 and blocks.shape == (64, 1024 // elems * nbytes)
    assert rel_rms(blocks, gaussian, t) < RMS_BOUND[t]


@pytest.mark.parametrize("t", PLAIN, ids=lambda t: t.name)
def test_plain_types_are_gguf_py_bytes(gaussian, quantized, t):
    ours = quantized[t].numpy()
    theirs = gguf.quants.quantize(gaussian.numpy(), gguf.GGMLQuantizationType(int(t)))
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("name", sorted(LLAMA_CPP_SHA256))
def test_bytes_are_llama_cpp_reference(name):
    blocks = quantize(torch.from_numpy(golden_weights()), GgmlType[name])
    assert hashlib.sha256(blocks.numpy().tobytes()).hexdigest() == LLAMA_CPP_SHA256[name]


def test_error_falls_with_bits(gaussian, quantized):
    rms = {t: rel_rms(quantized[t], gaussian, t) for t in K_TYPES + [GgmlType.Q8_0]}
    order = [rms[t] for t in K_TYPES + [GgmlType.Q8_0]]
    assert order == sorted(order, reverse=True), rms
    assert rms[GgmlType.Q4_K] < 0.1 and rms[GgmlType.Q6_K] < rms[GgmlType.Q4_K] / 3


def edge_rows() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    rows = [torch.zeros(512), torch.full((512,), 0.3), torch.full((512,), -2.0),
            torch.randn(512, generator=g) * 1e4, torch.randn(512, generator=g) * 1e6,
            torch.randn(512, generator=g) * 1e-20,
            torch.zeros(512).index_fill_(0, torch.tensor([7]), 5.0)]
    return torch.stack(rows)  # [7, 512]


@pytest.mark.parametrize("t", PLAIN + K_TYPES, ids=lambda t: t.name)
def test_edge_rows_stay_finite(t):
    w = edge_rows()
    out = dequantize(quantize(w, t), t)  # [7, 512]
    assert np.isfinite(out).all()
    assert (out[0] == 0).all()
    np.testing.assert_allclose(out[1], 0.3, rtol=0.02)
    np.testing.assert_allclose(out[2], -2.0, rtol=0.02)
    big = w[3].numpy()
    assert np.sqrt(((out[3] - big) ** 2).mean()) < 0.5 * big.std()


def test_input_dtypes_and_leading_dims():
    w = torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(2)).bfloat16()
    blocks = quantize(w, GgmlType.Q4_K)
    assert blocks.shape == (2, 3, 144)
    assert torch.equal(blocks.view(6, 144), quantize(w.float().view(6, 256), GgmlType.Q4_K))
    flat = w.float().view(6, 256)
    transposed = flat.t().contiguous().t()  # [6, 256], not contiguous
    assert torch.equal(quantize(transposed, GgmlType.Q8_0), quantize(flat, GgmlType.Q8_0))
    assert quantize(torch.zeros(0, 256), GgmlType.Q6_K).shape == (0, 210)


@pytest.mark.parametrize("t,cols",
                         [(GgmlType.Q4_0, 48), (GgmlType.Q4_K, 576), (GgmlType.Q6_K, 128)])
def test_partial_block_raises_with_the_numbers(t, cols):
    message = rf"{t.name}.*blocks of {BLOCK_SHAPES[t][0]}.*row of {cols}"
    with pytest.raises(ValueError, match=message):
        quantize(torch.zeros(2, cols), t)


@pytest.mark.parametrize("t", [GgmlType.F32, GgmlType.F16, GgmlType.IQ4_NL, GgmlType.Q8_1])
def test_types_without_quantizer_raise(t):
    with pytest.raises(ValueError, match="no quantizer"):
        quantize(torch.zeros(2, 256), t)


def test_integer_input_raises():
    with pytest.raises(ValueError, match="float tensor"):
        quantize(torch.zeros(2, 256, dtype=torch.int32), GgmlType.Q8_0)


def test_chunks_do_not_change_bytes(monkeypatch):
    import cvllm.quantization.ggml_quantizer as gq

    w = torch.from_numpy(golden_weights(8, 512))
    whole = {t: quantize(w, t) for t in (GgmlType.Q4_0, GgmlType.Q5_K)}
    monkeypatch.setitem(gq.CHUNK_ELEMS, "cpu", 300)  # one block per chunk, several chunks
    for t, blocks in whole.items():
        assert torch.equal(quantize(w, t), blocks)
