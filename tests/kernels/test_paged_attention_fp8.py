"""FP8 (e4m3) KV caches through the paged-attention kernels (``--fp8-kvcache``).

Two questions, two tolerances:

- Kernel against reference, on the same FP8 cache and scales: both dequantize the same
  e4m3 bytes, so they agree to the dtype tolerance of ``test_paged_attention.py``. The
  write must produce the reference's bytes, except where the float32 ``x / scale``
  lands within an ulp of an e4m3 rounding boundary (GPU division is not IEEE-exact): at
  least 99% identical bytes, the rest within one e4m3 step (12.5%).
- FP8 attention against full-precision attention over the same K/V (unit-normal, scale
  1.0 as the engine uses): e4m3 keeps 3 mantissa bits, so the output error is bounded by
  ``FP8_ATOL`` elementwise and ``FP8_REL`` in relative Frobenius norm (measured: ~0.06
  and ~0.04 for d=64).

Scales other than 1.0 (0.5 for K, 0.25 for V) are used in the kernel-vs-reference cases so
a scale applied on the wrong side, or not at all, fails. The CPU cases run under
``TRITON_INTERPRET=1`` in a subprocess, as in ``test_paged_attention.py``.
"""

from __future__ import annotations

import pytest
import torch

from cvllm.kernels.reference import paged_attention as ref
from tests.interpreted import run_interpreted
from tests.kernels.test_paged_attention import assert_close, make_paged

CUDA = torch.cuda.is_available()
FP8 = torch.float8_e4m3fn
FP8_ATOL = 0.15
FP8_REL = 0.08


def _scales(device, k=0.5, v=0.25):
    return (torch.tensor([k], dtype=torch.float32, device=device),
            torch.tensor([v], dtype=torch.float32, device=device))


def _fp8_paged(seq_lens, bs, hkv, d, device, ks, vs, seed=0):
    """make_paged's caches quantized (NaN stays NaN: unwritten slots still poison)."""
    p = make_paged(seq_lens, bs, hkv, d, torch.float32, "cpu", seed)
    kq = ref.quantize_kv_ref(p.k_cache, FP8, ks.cpu()).to(device)
    vq = ref.quantize_kv_ref(p.v_cache, FP8, vs.cpu()).to(device)
    return p, kq, vq, p.block_tables.to(device), p.seq_lens.to(device)


def check_write_kv_fp8(device="cpu", dtype=torch.float32, T=9, hkv=2, d=16, bs=16):
    from cvllm.kernels import paged_attention as pa

    g = torch.Generator().manual_seed(3)
    n_blocks = -(-T // bs) + 2
    kc = torch.zeros(n_blocks, bs, hkv, d, dtype=FP8, device=device)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(n_blocks * bs, generator=g)[:T]
    if T >= 3:
        slots[1] = -1  # padding
    k = (torch.randn(T, hkv, d, generator=g) * 3).to(dtype=dtype, device=device)
    v = (torch.randn(T, hkv, d, generator=g) * 3).to(dtype=dtype, device=device)
    k[0, 0, :2] = torch.tensor([1e4, -1e4], dtype=dtype)  # saturates at +-448, never NaN
    ks, vs = _scales(device)
    want_k, want_v = kc.cpu().clone(), vc.cpu().clone()
    ref.write_kv_ref(k.cpu(), v.cpu(), want_k, want_v, slots, ks.cpu(), vs.cpu())
    pa.write_kv(k, v, kc, vc, slots.to(device), k_scale=ks, v_scale=vs)
    for got, want in ((kc.cpu(), want_k), (vc.cpu(), want_v)):
        assert not torch.isnan(got.float()).any()
        same = (got.view(torch.uint8) == want.view(torch.uint8)).float().mean().item()
        assert same >= 0.99, same
        torch.testing.assert_close(got.float(), want.float(), rtol=0.125, atol=2**-9)
    assert kc.cpu()[slots[0] // bs, slots[0] % bs, 0, :2].float().tolist() == [448.0, -448.0]


def check_decode_fp8(seq_lens, heads, d, bs=16, device="cpu", dtype=torch.float32,
                     num_splits=None, **opts):
    from cvllm.kernels import paged_attention as pa

    h, hkv = heads
    ks, vs = _scales(device)
    _, kq, vq, bt, sl = _fp8_paged(seq_lens, bs, hkv, d, device, ks, vs)
    q = torch.randn(len(seq_lens), h, d, generator=torch.Generator().manual_seed(5))
    q = q.to(dtype=dtype, device=device)  # [B, H, D]
    want = ref.decode_attention_ref(q, kq, vq, bt, sl, d**-0.5, k_scale=ks, v_scale=vs, **opts)
    got = pa.decode_attention(q, kq, vq, bt, sl, d**-0.5, max_seq_len=max(seq_lens),
                              num_splits=num_splits, k_scale=ks, v_scale=vs, **opts)
    assert_close(got, want, dtype)


def check_prefill_fp8(seqs, heads, d, bs=16, device="cpu", dtype=torch.float32, **opts):
    from cvllm.kernels import paged_attention as pa

    h, hkv = heads
    ks, vs = _scales(device)
    seq_lens = [c + n for c, n in seqs]
    _, kq, vq, bt, sl = _fp8_paged(seq_lens, bs, hkv, d, device, ks, vs)
    qsl = torch.tensor([0] + [sum(n for _, n in seqs[: i + 1]) for i in range(len(seqs))],
                       dtype=torch.int32, device=device)  # [B+1]
    q = torch.randn(int(qsl[-1]), h, d, generator=torch.Generator().manual_seed(6))
    q = q.to(dtype=dtype, device=device)  # [T, H, D]
    want = ref.prefill_attention_ref(q, kq, vq, bt, qsl, sl, d**-0.5, k_scale=ks, v_scale=vs,
                                     **opts)
    got = pa.prefill_attention(q, kq, vq, bt, qsl, sl, max(n for _, n in seqs), d**-0.5,
                               k_scale=ks, v_scale=vs, **opts)
    assert_close(got, want, dtype)


def check_fp8_close_to_full_precision(seq_lens, heads, d, device="cpu", dtype=torch.float32):
    """FP8 decode (scale 1.0, as the engine uses) against the unquantized reference."""
    from cvllm.kernels import paged_attention as pa

    h, hkv = heads
    ones = _scales(device, 1.0, 1.0)
    p, kq, vq, bt, sl = _fp8_paged(seq_lens, 16, hkv, d, device, *ones)
    q = torch.randn(len(seq_lens), h, d, generator=torch.Generator().manual_seed(7))
    exact = ref.decode_attention_ref(q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, d**-0.5)
    got = pa.decode_attention(q.to(dtype=dtype, device=device), kq, vq, bt, sl, d**-0.5,
                              max_seq_len=max(seq_lens), k_scale=ones[0], v_scale=ones[1])
    err = got.float().cpu() - exact
    assert err.abs().max().item() < FP8_ATOL, err.abs().max()
    assert (err.norm() / exact.norm()).item() < FP8_REL


def run_cpu_cases() -> None:
    """Entry point of the interpreter subprocess."""
    check_write_kv_fp8()
    check_write_kv_fp8(dtype=torch.bfloat16)
    check_decode_fp8([1, 17, 40], (4, 2), 16)
    check_decode_fp8([5, 40, 33], (4, 2), 16, num_splits=3, sliding_window=7, softcap=3.0)
    check_prefill_fp8([(0, 20), (16, 1), (9, 7)], (4, 2), 16)
    check_prefill_fp8([(3, 5), (0, 1)], (2, 2), 24, dtype=torch.float16, sliding_window=4)
    check_fp8_close_to_full_precision([40, 17], (4, 2), 64)


def test_fp8_kernels_interpreted_on_cpu():
    code = "from tests.kernels.test_paged_attention_fp8 import run_cpu_cases; run_cpu_cases()"
    run_interpreted(code)


def test_reference_quantize_saturates_and_round_trips():
    s = torch.tensor([0.5])
    x = torch.tensor([0.0, 1.0, -3.0, 1e6, -1e6])
    q = ref.quantize_kv_ref(x, FP8, s)
    assert q.dtype == FP8
    assert ref.dequantize_kv_ref(q, s).tolist() == [0.0, 1.0, -3.0, 224.0, -224.0]
    assert ref.quantize_kv_ref(x, torch.bfloat16).dtype == torch.bfloat16  # no scale needed


def test_wrappers_check_fp8_scales():
    from cvllm.kernels import paged_attention as pa

    p = make_paged([5], 16, 2, 16)
    kq, vq = p.k_cache.to(FP8), p.v_cache.to(FP8)
    q = torch.randn(1, 4, 16)
    ks, vs = _scales("cpu")
    with pytest.raises(ValueError, match="k_scale"):
        pa.decode_attention(q, kq, vq, p.block_tables, p.seq_lens, 0.25)
    with pytest.raises(ValueError, match="v_scale"):
        pa.decode_attention(q, kq, vq, p.block_tables, p.seq_lens, 0.25, k_scale=ks,
                            v_scale=vs.double())
    with pytest.raises(ValueError, match="FP8 caches"):
        pa.decode_attention(q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, 0.25,
                            k_scale=ks, v_scale=vs)
    with pytest.raises(ValueError, match="differ in dtype"):
        pa.write_kv(q[:, :2], q[:, :2], kq, p.v_cache, torch.tensor([0]), k_scale=ks,
                    v_scale=vs)


# ----- GPU: compiled, model-sized ---------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,d", [((32, 8), 128), ((8, 1), 256), ((12, 4), 80)])
@pytest.mark.parametrize("opts", [{}, {"sliding_window": 700, "softcap": 30.0}])
def test_fp8_attention_cuda(dtype, heads, d, opts):
    check_decode_fp8([1, 17, 300, 4000, 2049], heads, d, device="cuda", dtype=dtype, **opts)
    check_decode_fp8([3000, 1], heads, d, device="cuda", dtype=dtype, num_splits=1, **opts)
    check_prefill_fp8([(0, 300), (1000, 129), (17, 1), (0, 5)], heads, d, device="cuda",
                      dtype=dtype, **opts)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("T,hkv,d", [(1, 8, 128), (4097, 8, 128), (300, 4, 80)])
def test_fp8_write_kv_cuda(dtype, T, hkv, d):
    check_write_kv_fp8("cuda", dtype, T=T, hkv=hkv, d=d)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("d", [64, 128])
def test_fp8_close_to_bf16_reference_cuda(d):
    check_fp8_close_to_full_precision([1, 300, 2049, 4000], (32, 8), d, device="cuda",
                                      dtype=torch.bfloat16)
