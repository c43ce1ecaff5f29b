"""The in-place rotary Triton kernel against its torch reference, and the reference
against the layer's torch path.

q and k are always strided views of one fused QKV buffer (as the models pass them), so
the tests also check that the kernel writes only the rotary dims of q and k: v, the
padding after it and the non-rotary dims stay bit-identical. On the CPU the kernel runs
under Triton's interpreter (``TRITON_INTERPRET=1``, in a fresh subprocess) with tiny
shapes in float32/float16 (the interpreter truncates to bfloat16 instead of rounding);
the ``gpu`` tests run it compiled with model-sized heads in bf16/fp16/fp32.
"""

from __future__ import annotations

import pytest
import torch

from cvllm.kernels.reference.paged_attention import write_kv_ref
from cvllm.kernels.reference.rotary import rotary_embedding_ref, rotary_write_kv_ref
from cvllm.layers.rotary import get_rope
from tests.interpreted import run_interpreted

CUDA = torch.cuda.is_available()
# (atol, rtol). The kernel rounds once where torch rounds each product and the sum: up to
# ~1.5 ulps of the products, absolute where the sum cancels (|x| < 8 here).
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (8e-3, 2e-3),
             torch.bfloat16: (6e-2, 2e-2)}


def _cache(max_pos, rot_dim, seed=0):
    """A cos/sin cache like the layer's: cos half | sin half of real angles."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot_dim, 2).float() / rot_dim))
    freqs = torch.arange(max_pos).float()[:, None] * inv_freq[None, :]  # [P, rot/2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [P, rot_dim]


def check_rotary(T=5, heads=(4, 2), D=16, rot_dim=None, neox=True, dtype=torch.float32,
                 device="cpu", three_d=False, with_key=True, seed=0, max_pos=64):
    from cvllm.kernels.rotary import rotary_embedding

    h, hkv = heads
    rot_dim = rot_dim or D
    g = torch.Generator().manual_seed(seed)
    width = (h + 2 * hkv) * D + 8  # q | k | v | padding
    qkv = torch.randn(T, width, generator=g).to(dtype=dtype, device=device)
    before = qkv.clone()
    q, k = qkv[:, : h * D], qkv[:, h * D : (h + hkv) * D]  # [T, H*D], [T, Hkv*D]
    if three_d:
        q, k = q.view(T, h, D), k.view(T, hkv, D)
    key = k if with_key else None
    cache = _cache(max_pos, rot_dim).to(device)
    positions = torch.randint(0, max_pos, (T,), generator=g).to(device)
    want_q, want_k = rotary_embedding_ref(positions, q, key, cache, D, neox)
    got_q, got_k = rotary_embedding(positions, q, key, cache, D, neox)
    assert got_q is q and got_k is key
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(q.float().cpu(), want_q.float().cpu(), atol=atol, rtol=rtol)
    if with_key:
        torch.testing.assert_close(k.float().cpu(), want_k.float().cpu(), atol=atol, rtol=rtol)
    untouched = torch.ones(width, dtype=torch.bool)
    per_head = torch.arange(width) % D >= rot_dim
    rotated_cols = (h + hkv if with_key else h) * D
    untouched[:rotated_cols] = per_head[:rotated_cols]
    assert torch.equal(qkv[:, untouched.to(device)], before[:, untouched.to(device)])


def check_mla_views(device="cpu", dtype=torch.float32, T=4, H=3, nope=8, rope=8, lora=12):
    """MLA's q_pe [T, H, P] (slice of each head) and k_pe [T, 1, P] (slice of the latent)."""
    from cvllm.kernels.rotary import rotary_embedding

    g = torch.Generator().manual_seed(2)
    q = torch.randn(T, H, nope + rope, generator=g).to(dtype=dtype, device=device)
    latent = torch.randn(T, lora + rope, generator=g).to(dtype=dtype, device=device)
    q_pe, k_pe = q[..., nope:], latent[:, lora:].unsqueeze(1)  # [T, H, P], [T, 1, P]
    cache = _cache(32, rope).to(device)
    positions = torch.tensor([0, 5, 31, 2][:T], device=device)
    want_q, want_k = rotary_embedding_ref(positions, q_pe, k_pe, cache, rope, False)
    q_nope, kv_c = q[..., :nope].clone(), latent[:, :lora].clone()
    rotary_embedding(positions, q_pe, k_pe, cache, rope, False)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(q_pe, want_q, atol=atol, rtol=rtol)
    torch.testing.assert_close(k_pe, want_k, atol=atol, rtol=rtol)
    assert torch.equal(q[..., :nope], q_nope) and torch.equal(latent[:, :lora], kv_c)


def check_rotary_write_kv(T=6, heads=(4, 2), D=16, rot_dim=None, neox=True,
                          dtype=torch.float32, device="cpu", three_d=False, num_writes=None,
                          cache_dtype=None, bs=4, seed=3, max_pos=64):
    """The fused kernel against the two kernels it replaces (bit-equal, on a copy of the
    same buffers) and against the torch references. The caches start as NaN, a slot of
    -1 and the rows past ``num_writes`` must write nothing, and q / k / v are views of
    one QKV buffer whose other columns must stay as they were."""
    from cvllm.kernels.paged_attention import write_kv
    from cvllm.kernels.rotary import rotary_embedding, rotary_write_kv

    h, hkv = heads
    rot_dim = rot_dim or D
    n = T if num_writes is None else num_writes
    g = torch.Generator().manual_seed(seed)
    width = (h + 2 * hkv) * D + 8  # q | k | v | padding
    qkv = torch.randn(T, width, generator=g).to(dtype=dtype, device=device)
    cache_dtype = cache_dtype or dtype
    fp8 = cache_dtype == torch.float8_e4m3fn
    num_blocks = -(-T // bs) + 2
    kc = torch.full((num_blocks, bs, hkv, D), float("nan"), device=device).to(cache_dtype)
    vc = kc.clone()
    slots = torch.randperm(num_blocks * bs, generator=g)[:T]
    if T > 2:
        slots[T // 2] = -1  # padding inside the batch
    slots = slots.to(device)
    scales = dict(k_scale=torch.tensor([0.02], device=device),
                  v_scale=torch.tensor([0.03], device=device)) if fp8 else {}
    cache = _cache(max_pos, rot_dim).to(device)
    positions = torch.randint(0, max_pos, (T,), generator=g).to(device)

    def views(buf):
        q, k = buf[:, : h * D], buf[:, h * D : (h + hkv) * D]
        v = buf[:, (h + hkv) * D : (h + 2 * hkv) * D]
        if three_d:
            q, k, v = q.view(T, h, D), k.view(T, hkv, D), v.view(T, hkv, D)
        return q, k, v

    two, kc2, vc2 = qkv.clone(), kc.clone(), vc.clone()
    before = qkv.clone()
    q, k, v = views(qkv)
    ref_kc, ref_vc = kc2.clone(), vc2.clone()
    want_q, want_k = rotary_write_kv_ref(positions, q.clone(), k.clone(), v, cache, D, neox,
                                         ref_kc, ref_vc, slots, n, **scales)
    got = rotary_write_kv(positions, q, k, v, cache, D, neox, kc, vc, slots, num_writes, **scales)
    assert got[0] is q and got[1] is k
    q2, k2, v2 = views(two)
    rotary_embedding(positions, q2, k2, cache, D, neox)
    write_kv(k2.reshape(T, hkv, D)[:n], v2.reshape(T, hkv, D)[:n], kc2, vc2, slots[:n], **scales)
    assert torch.equal(qkv, two), "q / k differ from the rotary kernel's"
    for got_c, want_c in ((kc, kc2), (vc, vc2)):
        assert torch.equal(got_c.float().isnan(), want_c.float().isnan()), "written slots differ"
        assert torch.equal(got_c.float().nan_to_num(), want_c.float().nan_to_num())
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(q.float().cpu(), want_q.float().cpu(), atol=atol, rtol=rtol)
    torch.testing.assert_close(k.float().cpu(), want_k.float().cpu(), atol=atol, rtol=rtol)
    # The reference wrote the same slots, with values as close as its rotation. FP8 holds
    # x / scale on the e4m3 grid, so the rotation's tolerance is divided by the scale (bf16:
    # where x1*c - x2*s cancels, torch's bf16 products leave up to 2**-5 on a key, 1.6 e4m3
    # units at k_scale 0.02, against a grid step of 2**-9..2**-4 below 1), plus one e4m3
    # step where the two straddle a grid point: 1/8 relative, 2**-9 (subnormal) near 0.
    for got_c, want_c, name in ((kc, ref_kc, "k_scale"), (vc, ref_vc, "v_scale")):
        if fp8:
            atol, rtol = TOLERANCE[dtype]
            atol, rtol = atol / scales[name].item() + 2**-9, rtol + 1 / 8
        assert torch.equal(got_c.float().isnan(), want_c.float().isnan())
        torch.testing.assert_close(got_c.float().nan_to_num().cpu(),
                                   want_c.float().nan_to_num().cpu(), atol=atol, rtol=rtol)
    # The cache holds exactly the kernel's rotated keys and the values, quantized as
    # write_kv_ref does.
    kc3, vc3 = torch.full_like(kc, float("nan")), torch.full_like(vc, float("nan"))
    write_kv_ref(k.reshape(T, hkv, D)[:n], v.reshape(T, hkv, D)[:n], kc3, vc3, slots[:n],
                 **scales)
    assert torch.equal(kc.float().nan_to_num(), kc3.float().nan_to_num())
    assert torch.equal(vc.float().nan_to_num(), vc3.float().nan_to_num())
    untouched = torch.ones(width, dtype=torch.bool)
    per_head = torch.arange(width) % D >= rot_dim
    untouched[: (h + hkv) * D] = per_head[: (h + hkv) * D]
    assert torch.equal(qkv[:, untouched.to(device)], before[:, untouched.to(device)])


WRITE_CASES = [
    dict(), dict(neox=False, three_d=True), dict(rot_dim=6, D=16, num_writes=4),
    dict(rot_dim=8, neox=False, heads=(6, 3), D=24), dict(T=1, heads=(8, 1), D=32),
    dict(dtype=torch.float16, heads=(2, 2), num_writes=0),
    dict(cache_dtype=torch.float8_e4m3fn), dict(rot_dim=8, cache_dtype=torch.float8_e4m3fn,
                                                 dtype=torch.float16),
]


CPU_CASES = [
    dict(), dict(neox=False), dict(rot_dim=6, D=16), dict(rot_dim=8, neox=False, three_d=True),
    dict(T=1, heads=(8, 1), D=24, with_key=False), dict(dtype=torch.float16, heads=(2, 2)),
]


def run_cpu_cases() -> None:
    """Entry point of the interpreter subprocess."""
    for case in CPU_CASES:
        check_rotary(**case)
    check_mla_views()
    for case in WRITE_CASES:
        check_rotary_write_kv(**case)


def test_kernel_interpreted_on_cpu():
    code = "from tests.kernels.test_rotary import run_cpu_cases; run_cpu_cases()"
    run_interpreted(code)


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_layers_torch_path(neox, dtype):
    """Bit-equal to RotaryEmbedding on the CPU, partial rotary included."""
    rope = get_rope(16, 64, {"rope_type": "default", "rope_theta": 500.0,
                             "partial_rotary_factor": 0.75}, 64, is_neox_style=neox)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(6, 3 * 16, generator=g).to(dtype)
    k = torch.randn(6, 16, generator=g).to(dtype)
    positions = torch.randint(0, 64, (6,), generator=g)
    got = rope(positions, q, k)
    want = rotary_embedding_ref(positions, q, k, rope.cos_sin_cache, 16, neox)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_wrapper_rejects_bad_inputs():
    from cvllm.kernels.rotary import rotary_embedding

    cache, pos = _cache(16, 8), torch.tensor([1, 2])
    q, k = torch.randn(2, 16), torch.randn(2, 8)
    with pytest.raises(ValueError, match="positions"):
        rotary_embedding(pos.float(), q, k, cache, 8)
    with pytest.raises(ValueError, match="query must be"):
        rotary_embedding(pos, torch.randn(3, 16), k, cache, 8)
    with pytest.raises(ValueError, match="unit stride"):
        rotary_embedding(pos, torch.randn(16, 2).t(), k, cache, 8)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        rotary_embedding(pos, q, k, cache.double(), 8)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        rotary_embedding(pos, q, k, _cache(16, 16), 8)
    with pytest.raises(ValueError, match="share"):
        rotary_embedding(pos, q, k.half(), cache, 8)


def test_rotary_write_kv_rejects_bad_inputs():
    from cvllm.kernels.rotary import rotary_write_kv

    cache, pos = _cache(16, 8), torch.tensor([1, 2])
    q, k, v = torch.randn(2, 16), torch.randn(2, 8), torch.randn(2, 8)
    kc, vc = torch.zeros(3, 4, 1, 8), torch.zeros(3, 4, 1, 8)
    slots = torch.tensor([0, 5])
    with pytest.raises(ValueError, match="num_writes"):
        rotary_write_kv(pos, q, k, v, cache, 8, True, kc, vc, slots, num_writes=3)
    with pytest.raises(ValueError, match="slot_mapping"):
        rotary_write_kv(pos, q, k, v, cache, 8, True, kc, vc, slots[:1])
    with pytest.raises(ValueError, match="does not fit"):
        rotary_write_kv(pos, q, k, v, cache, 8, True, torch.zeros(3, 4, 2, 8),
                        torch.zeros(3, 4, 2, 8), slots)
    with pytest.raises(ValueError, match="must match key"):
        rotary_write_kv(pos, q, k, torch.randn(2, 16), cache, 8, True, kc, vc, slots)
    with pytest.raises(ValueError, match="FP8 cache needs"):
        fp8 = kc.to(torch.float8_e4m3fn)
        rotary_write_kv(pos, q, k, v, cache, 8, True, fp8, fp8.clone(), slots)
    with pytest.raises(ValueError, match="positions"):
        rotary_write_kv(pos.float(), q, k, v, cache, 8, True, kc, vc, slots)


# ----- GPU: compiled, model-sized ---------------------------------------------------------------

gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


# bf16 for every head shape (Llama-3 8B, Gemma MQA 256, Phi-2 partial 32 of 80, a
# half-rotary GQA, a non-power-of-2 dim); fp16 and fp32 for the 8B shape.
GPU_CASES = ([(torch.bfloat16, heads, d, rot) for heads, d, rot in
              [((32, 8), 128, None), ((8, 1), 256, None), ((32, 32), 80, 32),
               ((40, 8), 128, 64), ((12, 4), 96, None)]]
             + [(torch.float16, (32, 8), 128, None), (torch.float32, (32, 8), 128, None)])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype,heads,D,rot_dim", GPU_CASES)
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("T", [1, 777])
def test_rotary_cuda(dtype, heads, D, rot_dim, neox, T):
    check_rotary(T, heads, D, rot_dim, neox, dtype, "cuda", three_d=T == 1, max_pos=8192)


@pytest.mark.gpu
@gpu
def test_mla_views_cuda():
    check_mla_views("cuda", torch.bfloat16, T=4, H=16, nope=128, rope=64, lora=512)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("params", [
    {"rope_type": "default", "rope_theta": 5e5},
    {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
    {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
     "original_max_position_embeddings": 1024},
])
def test_layer_dispatch_on_cuda(params):
    """RotaryEmbedding on CUDA (Triton, in place) agrees with itself on the CPU (torch)."""
    rope = get_rope(128, 4096, params, 4096)
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(100, 48 * 128, generator=g).to(torch.bfloat16)
    q, k = qkv[:, : 32 * 128], qkv[:, 32 * 128 : 40 * 128]
    positions = torch.randint(0, 4096, (100,), generator=g)
    want_q, want_k = rope(positions, q, k)
    qkv = qkv.cuda()
    got_q, got_k = rope(positions.cuda(), qkv[:, : 32 * 128], qkv[:, 32 * 128 : 40 * 128])
    atol, rtol = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(got_q.float().cpu(), want_q.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(got_k.float().cpu(), want_k.float(), atol=atol, rtol=rtol)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype,heads,D,rot_dim", GPU_CASES)
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("T", [1, 300])
def test_rotary_write_kv_cuda(dtype, heads, D, rot_dim, neox, T):
    check_rotary_write_kv(T, heads, D, rot_dim, neox, dtype, "cuda", three_d=T == 1,
                          num_writes=T - 7 if T > 7 else None, bs=16, max_pos=8192)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("T", [1, 300])
def test_rotary_write_kv_fp8_cuda(T):
    check_rotary_write_kv(T, (32, 8), 128, None, True, torch.bfloat16, "cuda",
                          cache_dtype=torch.float8_e4m3fn, bs=16, max_pos=8192)
