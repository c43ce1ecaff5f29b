"""The plans of the GGUF GPU kernels (``kernels/quant/ggml_plan.py``), on the CPU without
Triton: the path each product takes and its tiles, K split and warps, for the sweeps'
shapes and for Llama 3 8B's projections and LM head at batch 1 and 64 (H100 / H200: 132
SMs). A plan that changes here changes a kernel's launch (and may change its summation
order): re-measure before updating these figures (docs/kernels.md)."""

import subprocess
import sys

import pytest

from cvllm.kernels.quant import ggml_plan as gp
from cvllm.kernels.quant.ggml_pack import SPECS
from cvllm.kernels.quant.ggml_plan import choose_path, mm_refusal, plan_gemv, plan_mm
from cvllm.kernels.quant.ggml_types import QUANTIZED_TYPES, GgmlType
from cvllm.utils import tuning

TYPES = sorted(QUANTIZED_TYPES)
HEAVY = (GgmlType.Q8_0, GgmlType.Q5_0, GgmlType.Q5_1, GgmlType.Q5_K, GgmlType.Q6_K)
"""The types whose 65-128-row tiles stay unswapped on Hopper (``plan_mm``)."""

LLAMA_8B = {"q": (4096, 4096), "kv": (2048, 4096), "qkv": (6144, 4096), "o": (4096, 4096),
            "gate_up": (28672, 4096), "down": (4096, 14336), "lm_head": (128256, 4096)}
"""``(N, K)`` of Llama 3 8B's projections (k and v fused: ``kv``; all three: ``qkv``, as
cvllm's QKV layer holds them) and its LM head."""

Q4K_BATCH1 = {  # (BN, BK, num_warps, prefetch, split, steps) of the int8 GEMV
    "q": (16, 4096, 4, False, 1, 1), "kv": (16, 4096, 4, False, 1, 1),
    "qkv": (32, 2048, 4, False, 2, 1), "o": (16, 4096, 4, False, 1, 1),
    "gate_up": (16, 2048, 4, False, 1, 2), "down": (16, 1024, 4, False, 4, 4),
    "lm_head": (16, 2048, 4, False, 1, 2),
}
Q4K_BATCH64 = {  # (BM, BN, BK, warps, stages, GROUP_M, SPLIT, SWAP) with wgmma; without
    "q": ((64, 64, 128, 4, 3, 8, 4, False), (64, 64, 128, 4, 3, 8, 4, False)),
    "kv": ((64, 64, 128, 4, 3, 8, 4, False), (64, 64, 128, 4, 3, 8, 4, False)),
    "qkv": ((64, 64, 128, 4, 3, 8, 4, False), (64, 64, 128, 4, 3, 8, 4, False)),
    "o": ((64, 64, 128, 4, 3, 8, 4, False), (64, 64, 128, 4, 3, 8, 4, False)),
    "gate_up": ((64, 128, 128, 4, 3, 8, 1, False), (64, 128, 64, 4, 3, 8, 1, False)),
    "down": ((64, 128, 64, 4, 3, 8, 8, True), (64, 64, 256, 4, 3, 8, 2, False)),
    "lm_head": ((64, 128, 128, 4, 3, 8, 1, False), (64, 128, 128, 4, 3, 8, 1, False)),
}


@pytest.mark.parametrize("name", sorted(LLAMA_8B))
def test_llama_8b_q4k_plans(name):
    n, k = LLAMA_8B[name]
    q4k = SPECS[GgmlType.Q4_K]
    assert choose_path(1, q4k, False, (n, k), 132) == "gemv_i8"
    assert gp.i8_config(None, n, k, 132, gp.prequant_default(0), gp.i8_plan_wps(q4k)) == \
        Q4K_BATCH1[name]
    # the down projection's gated input is rounded by a kernel of its own first
    assert gp.i8_config(None, n, k, 132, True, 4)[:5] == (4, 2048, 2, True, 1)
    assert choose_path(64, q4k, False, (n, k), 132) == "mm"
    assert (plan_mm(64, n, k, q4k, 132), plan_mm(64, n, k, q4k, 132, wgmma=False)) == \
        Q4K_BATCH64[name]


def test_llama_8b_q6k_and_exact_lm_head_plans():
    """The Q6_K LM head (the usual Q4_K_M file's): the int8 GEMV at one row (its largest
    logits then recomputed by the float GEMV: ``ggml_head``), the float GEMV's many-wave
    plan for an exact head; a Q6_K down projection keeps the float GEMV."""
    q6k = SPECS[GgmlType.Q6_K]
    n, k = LLAMA_8B["lm_head"]
    assert choose_path(1, q6k, False, (n, k), 132) == "gemv_i8"
    assert gp.i8_config(None, n, k, 132, False, gp.i8_plan_wps(q6k)) == (16, 1024, 4, False, 1, 4)
    assert choose_path(1, q6k, True, (n, k), 132) == "gemv"
    assert plan_gemv(1, n, k, q6k, 132) == (8, 1024, 2, True)
    assert choose_path(64, q6k, True, (n, k), 132) == "mm"
    assert plan_mm(64, n, k, q6k, 132) == (64, 128, 128, 4, 3, 8, 1, False)
    assert choose_path(1, q6k, False, LLAMA_8B["down"], 132) == "gemv"
    assert plan_gemv(1, *LLAMA_8B["down"], q6k, 132) == (8, 2048, 4, True)
    assert [choose_path(m, q6k, False, LLAMA_8B["qkv"], 132) for m in (1, 2, 64, 128, 129)] \
        == ["gemv_i8", "gemv", "mm", "mm", "dense"]


def test_switches_change_the_plans():
    q4k = SPECS[GgmlType.Q4_K]
    with tuning.configure(ggml_int8_gemv=False):
        assert choose_path(1, q4k, False, LLAMA_8B["qkv"], 132) == "gemv"
    with tuning.configure(ggml_i8_split=False):
        assert gp.plan_gemv_i8(*LLAMA_8B["qkv"], 132) == (8, 2048, 4, False, 1)
    for mode, plain, gated in (("gated", False, True), ("all", True, True), ("0", False, False)):
        with tuning.configure(ggml_q8_x=mode):
            assert (gp.prequant_default(0), gp.prequant_default(1)) == (plain, gated)


def test_integer_helpers_match_triton():
    triton = pytest.importorskip("triton")
    for n in list(range(0, 70)) + [4095, 4096, 4097, 14336, 128256]:
        assert gp.next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 7, 16, 132):
            assert gp.cdiv(n, d) == triton.cdiv(n, d)


def test_the_plans_need_no_triton():
    code = ("import sys, cvllm.kernels.quant.ggml_plan as p; "
            "assert 'triton' not in sys.modules, 'ggml_plan imported triton'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_plans_cover_the_sms_and_split_small_grids():
    for t in TYPES:
        spec = SPECS[t]
        for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (64, 512)]:
            for m in (1, 2):
                bn, bk, warps, _ = plan_gemv(m, n, k, spec, 132)
                assert bn & (bn - 1) == 0 and bk % spec.sb == 0 and bk & (bk - 1) == 0
                assert -(-n // bn) >= 132 or bn == 1
            for m in (3, 16, 64, 128, 700):
                plan = plan_mm(m, n, k, spec, 132)
                assert mm_refusal(spec, *plan) is None  # launched unchecked
                bm, bn, bk, warps, stages, group, split, swap = plan
                assert bk % spec.sb == 0 and split in (1, 2, 4, 8) and bm >= min(m, 128)
                assert split == 1 or k // (bk * split) >= 2
                q4k_down = t == GgmlType.Q4_K and m == 64 and k >= 8192 and split > 1
                assert swap == (m <= 32 or (m > 64 and t not in HEAVY) or q4k_down)
                old = plan_mm(m, n, k, spec, 132, wgmma=False)  # no wgmma: never swapped
                assert not old[7] and old[0] >= min(m, 128) and old[2] % spec.sb == 0
                if swap and k // (bk * split) >= 4:  # the split fills the SMs, if K allows
                    assert -(-m // bm) * -(-n // bn) * split >= 132 or split == 8
    # The H100 / H200 sweeps' choices (tools/bench_ggml.py).
    assert plan_gemv(1, 4096, 4096, SPECS[GgmlType.Q4_K], 132) == (8, 4096, 4, False)
    assert plan_gemv(2, 4096, 4096, SPECS[GgmlType.Q4_K], 132)[0] == 16
    assert plan_gemv(1, 6144, 4096, SPECS[GgmlType.Q6_K], 132) == (8, 2048, 4, True)
    q4k, q6k = SPECS[GgmlType.Q4_K], SPECS[GgmlType.Q6_K]
    assert plan_mm(16, 4096, 4096, q4k, 132) == (16, 64, 256, 4, 3, 8, 4, True)
    assert plan_mm(16, 6144, 4096, q4k, 132)[6] == 2
    assert plan_mm(32, 28672, 4096, q4k, 132) == (32, 64, 128, 4, 3, 8, 1, True)
    assert plan_mm(32, 4096, 14336, q4k, 132) == (32, 64, 256, 4, 3, 8, 4, True)
    assert plan_mm(128, 4096, 4096, q4k, 132) == (128, 64, 128, 8, 3, 8, 4, True)
    assert plan_mm(128, 4096, 4096, q6k, 132) == (128, 64, 128, 8, 3, 8, 4, False)
    assert plan_mm(64, 28672, 4096, q4k, 132)[1::5] == (128, 1)
    assert plan_gemv(1, 6144, 4096, q4k, 132) == (8, 2048, 4, False)
    assert plan_gemv(1, 28672, 4096, q4k, 132) == (8, 4096, 4, False)
    assert plan_gemv(1, 128256, 4096, q6k, 132) == (8, 1024, 2, True)
    assert plan_mm(64, 28672, 4096, q4k, 132)[1:3] == (128, 128)
    assert plan_mm(64, 28672, 4096, q4k, 132, wgmma=False)[1:3] == (128, 64)
    assert plan_mm(64, 128256, 4096, q4k, 132)[1:3] == (128, 128)
    assert plan_mm(64, 4096, 14336, q4k, 132) == (64, 128, 64, 4, 3, 8, 8, True)
    assert plan_mm(64, 4096, 14336, q4k, 132, wgmma=False)[:7] == (64, 64, 256, 4, 3, 8, 2)
    assert plan_mm(64, 4096, 14336, q6k, 132)[2::4] == (128, 4)
    # without wgmma (sm_80 / sm_89) the H100 sweep's mma.sync plan, as before
    assert plan_mm(16, 4096, 4096, q4k, 132, wgmma=False) == (16, 64, 256, 4, 3, 8, 4, False)
    assert plan_mm(32, 28672, 4096, q4k, 132, wgmma=False)[:7] == (32, 64, 128, 4, 3, 8, 4)
    assert plan_mm(64, 4096, 14336, q4k, 132, wgmma=False)[1::5] == (64, 2)
    assert plan_mm(128, 4096, 4096, q4k, 132, wgmma=False)[:7] == (128, 64, 128, 4, 3, 8, 4)
    assert [choose_path(m) for m in (1, 2, 3, 128, 129)] == ["gemv"] * 2 + ["mm"] * 2 + [
        "dense"]
    # The int8 GEMV: one row of the plain 4-bit types, Q8_0 and Q6_K, unless turned off.
    assert [choose_path(1, SPECS[t]) for t in (GgmlType.Q4_0, GgmlType.Q4_1, GgmlType.Q4_K,
                                               GgmlType.Q8_0, GgmlType.Q6_K, GgmlType.Q5_K,
                                               GgmlType.IQ4_NL)] == ["gemv_i8"] * 5 + ["gemv"] * 2
    assert choose_path(2, q4k) == "gemv"
    # Q6_K keeps the float GEMV where its int8 plan would split K in four (the 8B down
    # projection: 41.9 against 23.3 us on an H200), the int8 one elsewhere.
    q6k = SPECS[GgmlType.Q6_K]
    assert choose_path(1, q6k, shape=(4096, 14336), num_sms=132) == "gemv"
    assert [choose_path(1, q6k, shape=s, num_sms=132) for s in (
        (28672, 4096), (128256, 4096), (4096, 4096), (6144, 4096))] == ["gemv_i8"] * 4
    assert choose_path(1, q4k, shape=(4096, 14336), num_sms=132) == "gemv_i8"
    assert choose_path(1, q6k, exact=True, shape=(128256, 4096), num_sms=132) == "gemv"
    with tuning.configure(ggml_int8_gemv=False):
        assert choose_path(1, q4k) == "gemv"


def test_int8_gemv_plans_and_splits():
    # The H200 sweep's int8 plans (BN, BK, warps, prefetch, split): gate_up, qkv (K split
    # in two, 32 rows a program for 4-bit weights), o_proj, down (split in four); a gated
    # down projection's x rounded first.
    assert gp.plan_gemv_i8(28672, 4096, 132) == (16, 2048, 4, False, 1)
    assert gp.plan_gemv_i8(6144, 4096, 132) == (32, 2048, 4, False, 2)
    assert gp.plan_gemv_i8(6144, 4096, 132, wps=8) == (16, 1024, 4, False, 2)
    assert gp.plan_gemv_i8(4096, 4096, 132) == (16, 4096, 4, False, 1)
    assert gp.plan_gemv_i8(4096, 14336, 132) == (16, 1024, 4, False, 4)
    assert gp.plan_gemv_i8(4096, 14336, 132, prequant=True) == (4, 2048, 2, True, 1)
    assert gp.plan_gemv_i8(64, 512, 132) == (16, 512, 4, False, 1)
    # Q8_0 (8 words a sub-block): half the K step, the same words a program
    assert gp.plan_gemv_i8(28672, 4096, 132, wps=8) == (16, 1024, 4, False, 1)
    assert gp.plan_gemv_i8(4096, 4096, 132, wps=8) == (16, 2048, 4, False, 1)
    assert gp.i8_config(None, 4096, 14336, 132, False, 8) == (16, 512, 4, False, 4, 7)
    # a split is trimmed so that no run is empty: 5 steps asked in 4 runs go in 3 of 2
    assert gp.i8_config((16, 1024, 4, False, 4), 4096, 5120, 132, False, 4)[4:] == (3, 2)
    assert gp.i8_config((16, 2048, 4, False, 8), 4096, 4096, 132, False, 4)[4:] == (2, 1)
    assert gp.i8_config((16, 2048, 4, False), 4096, 4096, 132, False, 4)[4:] == (1, 2)
    for bad in ((16, 2048, 4, False, 0), (2, 2048, 4, False, 2), (16, 2048, 4)):
        with pytest.raises(ValueError):
            gp.i8_config(bad, 4096, 4096, 132, False, 4)
    # CVLLM_GGML_I8_SPLIT=0: the plan before the split
    with tuning.configure(ggml_i8_split=False):
        assert gp.plan_gemv_i8(6144, 4096, 132) == (8, 2048, 4, False, 1)
        assert gp.plan_gemv_i8(4096, 14336, 132) == (16, 4096, 4, False, 1)
        assert gp.plan_gemv_i8(4096, 14336, 132, prequant=True) == (8, 2048, 4, False, 1)
    assert gp.prequant_default(1) and not gp.prequant_default(0)
