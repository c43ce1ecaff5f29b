"""FP8 KV caches through the two attention backends (``--fp8-kvcache``).

Two steps over fresh FP8 caches allocated by ``attention/kv_cache.py``: a prefill of
three sequences, then one decode token each. The torch reference backend must calibrate
each cache's scale at its first write (``2 x max|x| / 448``), keep it afterwards, and
attend exactly like ``kernels/reference/paged_attention.py`` over the same e4m3 bytes and scales. The
Triton backend, from its own fresh caches, must write the same bytes (its float32
rounding onto the e4m3 grid is exact; on the GPU at least 99% identical, see
tests/kernels/test_paged_attention_fp8.py) and give the same output (float32:
``atol`` 2e-5 on the CPU, 2e-4 on CUDA, where the reference backend's SDPA differed from
the einsum oracle by 1e-4 on outputs of magnitude ~10 on an H100; bf16: 2e-2).
CPU: under ``TRITON_INTERPRET=1`` in a subprocess.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch

from cvllm.attention.backends import torch_ref
from cvllm.attention.interface import AttentionParams
from cvllm.attention.kv_cache import (
    FP8_KV_MARGIN,
    KVCache,
    KVCacheSpec,
    allocate_kv_cache,
    reset_kv_scales,
)
from cvllm.attention.metadata import AttentionMetadata
from cvllm.kernels.reference import paged_attention as ref
from tests.interpreted import run_interpreted

FP8 = torch.float8_e4m3fn
BS = 16
SEQS = [13, 1, 20]
"""Prompt lengths of the prefill step."""


def _steps(heads, d, dtype, seed=0):
    """(q, k, v, slots, query_start_loc, seq_lens) of the prefill and the decode step,
    and the block tables: sequence b owns blocks 1 + 3b .. 3 + 3b."""
    g = torch.Generator().manual_seed(seed)
    h, hkv = heads
    tables = np.array([[1 + 3 * b + j for j in range(3)] for b in range(len(SEQS))], np.int32)
    steps = []
    for starts, lens in ((np.zeros(len(SEQS), int), np.array(SEQS)),
                         (np.array(SEQS), np.ones(len(SEQS), int))):
        pos = [np.arange(s, s + n) for s, n in zip(starts, lens)]
        slots = np.concatenate([tables[b][p // BS].astype(np.int64) * BS + p % BS
                                for b, p in enumerate(pos)])
        T = int(lens.sum())
        qkv = [(torch.randn(T, n, d, generator=g) * 4).to(dtype) for n in (h, hkv, hkv)]
        qsl = np.concatenate([[0], np.cumsum(lens)])
        steps.append((*qkv, slots, qsl, starts + lens))
    return steps, tables


def _meta(slots, qsl, seq_lens, tables, device):
    return AttentionMetadata.build(slot_mapping=slots, query_start_loc=qsl, seq_lens=seq_lens,
                                   block_tables=tables, device=device)


def run_fp8_case(device="cpu", dtype=torch.float32, heads=(4, 2), d=16, atol=2e-5):
    from cvllm.attention.backends import triton_backend

    steps, tables = _steps(heads, d, dtype)
    spec = KVCacheSpec(num_layers=2, num_kv_heads=heads[1], head_dim=d, block_size=BS, dtype=FP8)
    rc, tc = allocate_kv_cache(spec, 1 + 3 * len(SEQS), device)  # reference's, Triton's
    first_k = None
    for q, k, v, slots, qsl, seq_lens in steps:
        q, k, v = q.to(device), k.to(device), v.to(device)
        meta = _meta(slots, qsl, seq_lens, tables, device)
        want = torch_ref.forward(q, k, v, rc, meta, AttentionParams(d**-0.5))
        got = triton_backend.forward(q, k, v, tc, meta, AttentionParams(d**-0.5))
        first_k = k if first_k is None else first_k
        expected_scale = first_k.abs().amax().float() * FP8_KV_MARGIN / 448
        torch.testing.assert_close(rc.k_scale[0], expected_scale)  # kept after step 1
        torch.testing.assert_close(tc.k_scale, rc.k_scale)
        oracle = ref.prefill_attention_ref(
            q, rc.k, rc.v, meta.block_tables, meta.query_start_loc, meta.seq_lens, d**-0.5,
            k_scale=rc.k_scale, v_scale=rc.v_scale)
        torch.testing.assert_close(want.float(), oracle.float(), atol=atol, rtol=atol)
        torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=atol, rtol=atol)
        for tri, r in ((tc.k, rc.k), (tc.v, rc.v)):
            same = (tri.view(torch.uint8) == r.view(torch.uint8)).float().mean().item()
            assert same == 1.0 if device == "cpu" else same >= 0.99, same


def run_fp8_rope_case(device="cpu", dtype=torch.float32, heads=(4, 2), d=16):
    """The Triton backend given ``rope`` (its first write rotates, then calibrates on the
    rotated keys; later writes run the fused kernel) against the rotary kernel followed
    by the plain backend, from fresh caches: the same scales, cache bytes, outputs and
    rotated q / k, step after step."""
    from cvllm.attention.backends import triton_backend
    from cvllm.attention.metadata import RopeInputs
    from cvllm.kernels.rotary import rotary_embedding

    steps, tables = _steps(heads, d, dtype, seed=5)
    spec = KVCacheSpec(num_layers=2, num_kv_heads=heads[1], head_dim=d, block_size=BS, dtype=FP8)
    fc, uc = allocate_kv_cache(spec, 1 + 3 * len(SEQS), device)  # fused, unfused
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    angles = torch.arange(64).float()[:, None] * inv_freq[None, :]  # [64, d/2]
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1).to(device)  # [64, d]
    for q, k, v, slots, qsl, seq_lens in steps:
        meta = _meta(slots, qsl, seq_lens, tables, device)
        positions = torch.randint(0, 64, (q.shape[0],)).to(device)
        q, k, v = q.to(device), k.to(device), v.to(device)
        q2, k2 = q.clone(), k.clone()
        got = triton_backend.forward(q, k, v, fc, meta, AttentionParams(d**-0.5),
                                     rope=RopeInputs(positions, cache, d, True))
        rotary_embedding(positions, q2, k2, cache, d, True)
        want = triton_backend.forward(q2, k2, v, uc, meta, AttentionParams(d**-0.5))
        assert not fc.scales_pending and fc.k_scale.item() != 1.0
        for a, b in ((got, want), (q, q2), (k, k2), (fc.k_scale, uc.k_scale),
                     (fc.v_scale, uc.v_scale), (fc.k.view(torch.uint8), uc.k.view(torch.uint8)),
                     (fc.v.view(torch.uint8), uc.v.view(torch.uint8))):
            assert torch.equal(a, b)


def test_fp8_backends_interpreted_on_cpu():
    code = ("from tests.attention.test_fp8_backends import run_fp8_case, run_fp8_rope_case; "
            "run_fp8_case(); run_fp8_rope_case()")
    run_interpreted(code)


def test_torch_ref_calibrates_once_and_reset_rearms():
    spec = KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=8, block_size=BS, dtype=FP8)
    [c] = allocate_kv_cache(spec, 2, "cpu")
    assert c.scales_pending and c.k_scale.item() == 1.0
    x = torch.full((3, 2, 8), 7.0)
    torch_ref.write_kv(x, x * 0, c, torch.tensor([0, 1, 2]))
    assert c.k_scale.item() == pytest.approx(7.0 * FP8_KV_MARGIN / 448)
    assert c.v_scale.item() == 1.0  # all-zero first write: the neutral scale
    assert c.k.float().abs().max().item() == 224.0  # 7 / scale, half the range: the margin
    torch_ref.write_kv(x * 100, x, c, torch.tensor([3, 4, 5]))
    assert c.k_scale.item() == pytest.approx(7.0 * FP8_KV_MARGIN / 448)  # unchanged
    assert c.k.float().abs().max().item() == 448.0  # saturated, not NaN
    reset_kv_scales([c])
    torch_ref.write_kv(x * 2, x, c, torch.tensor([6, 7, 8]))
    assert c.k_scale.item() == pytest.approx(14.0 * FP8_KV_MARGIN / 448)


def test_fp8_cache_needs_its_scale():
    bare = torch.zeros(2, BS, 2, 8, dtype=FP8)
    with pytest.raises(ValueError, match="scales"):
        KVCache(bare, bare.clone())
    assert KVCache(torch.zeros(1), torch.zeros(1)).k_scale is None
    fresh = KVCache.fp8(bare, bare.clone())
    assert fresh.scales_pending and fresh.k_scale.item() == fresh.v_scale.item() == 1.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 2e-2), (torch.float32, 2e-4)])
@pytest.mark.parametrize("heads,d", [((32, 8), 128), ((8, 1), 256)])
def test_fp8_backends_cuda(dtype, atol, heads, d):
    run_fp8_case("cuda", dtype, heads, d, atol)
