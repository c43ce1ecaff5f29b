"""The int8 GGUF kernels compiled for an H100/H200 (sm_90) on a machine without a GPU.

The interpreter (``TRITON_INTERPRET=1``, tests/kernels/test_ggml_cuda.py) runs a kernel as
Python, so it accepts what Triton's compiler refuses: a ``@triton.jit`` function with a
return in a constexpr branch and another after it (the compiler types every return
statement, and stores after such an early return are compiled too). The first Q8_0 build
of the int8 GEMV passed every interpreted test and failed to compile on 2 x H200. Here
each variant of ``ggml_gemv_i8_kernel`` (and Q6_K's ``ggml_gemv_i8_q6_kernel``) and
``ggml_q8_kernel`` is compiled to PTX for
sm_90 by Triton's own compiler (its bundled ptxas), as the GPU would compile it; so are the
tiles ``plan_mm`` picks for the tensor-core ``ggml_mm_kernel`` (both products)."""

from __future__ import annotations

import functools
import itertools

import pytest

triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from cvllm.kernels.quant import ggml_i8_kernels as gi  # noqa: E402
from cvllm.kernels.quant import ggml_kernels as gk  # noqa: E402
from cvllm.kernels.quant.ggml_pack import SPECS  # noqa: E402
from cvllm.kernels.quant.ggml_q8 import ggml_q8_kernel  # noqa: E402
from cvllm.kernels.quant.ggml_types import GgmlType  # noqa: E402

pytestmark = pytest.mark.slow


@triton.jit
def _probe(x_ptr):
    tl.store(x_ptr, tl.load(x_ptr) + 1)


@functools.lru_cache(maxsize=None)
def _no_backend() -> str:
    """Why Triton cannot compile for sm_90 on this machine at all ('' when it can): probed
    once with a trivial kernel, so that a real kernel's failure is a failure, not a skip."""
    src = ASTSource(fn=_probe, signature={"x_ptr": "*fp32"}, constexprs={})
    try:
        triton.compile(src, target=GPUTarget("cuda", 90, 32))
    except Exception as e:  # noqa: BLE001 - no CUDA backend / ptxas here
        return f"{type(e).__name__}: {e}"
    return ""


def _compile(fn, pointers, constexprs, **options):
    if _no_backend():
        pytest.skip(f"Triton cannot compile for sm_90 here: {_no_backend()}")
    names = fn.arg_names
    sig = {n: pointers.get(n, "constexpr" if n in constexprs else "i32") for n in names}
    src = ASTSource(fn=fn, signature=sig,
                    constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options or None)


# (MODE, OFF, WPS): Q4_0, Q4_K and Q8_0
TYPES = [(0, -8, 4), (3, 0, 4), (0, -128, 8)]


@pytest.mark.parametrize("mode,off,wps", TYPES)
def test_gemv_i8_compiles_for_sm90(mode, off, wps):
    q4k = mode == 3  # PackSpec.dd / scm: packed (d, dm) words, (sc, mn) halfwords
    pointers = {"x_ptr": "*i32", "xs_ptr": "*fp32", "y_ptr": "*bf16", "b_ptr": "*bf16",
                "lo_ptr": "*i32", "d_ptr": "*i32" if q4k else "*fp16", "dm_ptr": "*fp16",
                "sc_ptr": "*i16" if q4k else "*u8", "ws_ptr": "*fp32", "sem_ptr": "*i32"}
    # (x pre-rounded, prefetch, K a whole number of steps, gated activation, K split):
    # each branch of the kernel at least once (a pre-rounded x carries its activation)
    for xq, prefetch, even_k, act, split in ((False, False, True, 0, 1),
                                             (True, True, False, 0, 1),
                                             (False, True, False, 1, 1),
                                             (False, False, True, 0, 4),
                                             (True, True, True, 0, 2)):
        pointers["x_ptr"] = "*i32" if xq else "*bf16"
        compiled = _compile(gi.ggml_gemv_i8_kernel, pointers, dict(
            SUPER=256 if mode == 3 else 32, MODE=mode, OFF=off, BN=16, NSUB=2048 // 32 // (
                wps // 4), HAS_BIAS=split == 2, EVEN_K=even_k, PREFETCH=prefetch, PDL=False,
            WIDE=False, ASM=True, ACT=act, XQ=xq, WPS=wps, SPLIT=split, STEPS=2))
        ptx = compiled.asm["ptx"]
        assert "dp4a" in ptx
        # a split program counts itself with one gpu-scope acq_rel atomic
        assert ("atom.global.gpu.acq_rel.add" in ptx) == (split > 1), split


def test_gemv_i8_q6_compiles_for_sm90():
    """Q6_K's int8 GEMV (``ggml_gemv_i8_q6_kernel``), each branch at least once: K whole or
    masked, a gated row, K split (with a bias)."""
    pointers = {"x_ptr": "*bf16", "y_ptr": "*bf16", "b_ptr": "*bf16", "lo_ptr": "*i32",
                "hi_ptr": "*i32", "d_ptr": "*i32", "sc_ptr": "*i8", "ws_ptr": "*fp32",
                "sem_ptr": "*i32"}
    for even_k, act, split in ((True, 0, 1), (False, 1, 1), (True, 0, 4), (False, 0, 2)):
        compiled = _compile(gi.ggml_gemv_i8_q6_kernel, pointers, dict(
            BN=16, NSUB=64, HAS_BIAS=split == 4, EVEN_K=even_k, PDL=False, WIDE=False,
            ASM=True, ACT=act, SPLIT=split, STEPS=2))
        ptx = compiled.asm["ptx"]
        assert "dp4a" in ptx
        assert ("atom.global.gpu.acq_rel.add" in ptx) == (split > 1), split


@pytest.mark.parametrize("wps", [4, 8])
def test_q8_kernel_compiles_for_sm90(wps):
    for even_k, act in itertools.product((True, False), (0, 1)):
        compiled = _compile(ggml_q8_kernel, {"x_ptr": "*bf16", "q_ptr": "*i32",
                                             "s_ptr": "*fp32"},
                            dict(NSUB=32, EVEN_K=even_k, ASM=True, ACT=act, PDL=False,
                                 WPS=wps, EARLY=False))
        ptx = compiled.asm["ptx"]
        # the 8-bit form stores one run of words, the 4-bit form two (xe, then xd)
        assert "st.global" in ptx


@pytest.mark.parametrize("wps", [4, 8])
def test_rms_norm_with_int8_form_compiles_for_sm90(wps):
    """The RMSNorm kernel writing its row's int8 form too (``kernels/rmsnorm.py``,
    ``Q8_WPS``): an 8B row (4096, whole sub-block runs) and SmolLM2's (576, masked)."""
    from cvllm.kernels.rmsnorm import _rms_norm_kernel

    pointers = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
                "res_out_ptr": "*bf16", "q_ptr": "*i32", "s_ptr": "*fp32", "eps": "fp32"}
    for block, nsub in ((4096, 128), (1024, 32)):
        compiled = _compile(_rms_norm_kernel, pointers, dict(
            HAS_RESIDUAL=True, OFFSET=False, BLOCK=block, PDL=False, Q8_WPS=wps,
            Q8_NSUB=nsub, ASM=True, EARLY=False), num_warps=8)
        ptx = compiled.asm["ptx"]
        assert "dp4a" in ptx and "bar.sync" in ptx


@pytest.mark.parametrize("early", [False, True])
def test_small_pdl_kernels_trigger_where_told(early):
    """``EARLY`` (``kernels/pdl.early_trigger``): the RMSNorm and the int8 rounding kernel
    trigger their dependents before their own wait, else after it; the rounding kernel
    reads nothing before its wait (the norm reads its weight)."""
    from cvllm.kernels.rmsnorm import _rms_norm_kernel

    pointers = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
                "res_out_ptr": "*bf16", "q_ptr": "*i32", "s_ptr": "*fp32", "eps": "fp32"}
    norm = _compile(_rms_norm_kernel, pointers, dict(
        HAS_RESIDUAL=True, OFFSET=False, BLOCK=4096, PDL=True, Q8_WPS=4, Q8_NSUB=128,
        ASM=True, EARLY=early), num_warps=8, launch_pdl=True)
    q8 = _compile(ggml_q8_kernel, {"x_ptr": "*bf16", "q_ptr": "*i32", "s_ptr": "*fp32"},
                  dict(NSUB=32, EVEN_K=True, ASM=True, ACT=1, PDL=True, WPS=4, EARLY=early),
                  launch_pdl=True)
    for compiled in (norm, q8):
        ptx = compiled.asm["ptx"]
        trigger, wait = ptx.find("griddepcontrol.launch_dependents"), ptx.find(
            "griddepcontrol.wait")
        assert trigger >= 0 and wait >= 0
        assert (trigger < wait) == early
    ptx = q8.asm["ptx"]
    assert ptx.find("ld.global") > ptx.find("griddepcontrol.wait")


def _compile_mm(t, bm, bn, bk, warps, stages, split, swap):
    """``ggml_mm_kernel`` for type ``t`` with a bf16 x and these tiles."""
    spec = SPECS[t]
    signed_sc = t in (GgmlType.Q3_K, GgmlType.Q6_K, GgmlType.IQ4_XS)
    pointers = {"x_ptr": "*bf16", "y_ptr": "*bf16", "b_ptr": "*bf16", "ws_ptr": "*fp32",
                "lo_ptr": "*i32", "hi_ptr": "*i16" if t == GgmlType.Q3_K else "*i32",
                "d_ptr": "*i32" if spec.dd else "*fp16", "dm_ptr": "*fp16",
                "sc_ptr": "*i16" if spec.scm else "*i8" if signed_sc else "*u8"}
    return _compile(gk.ggml_mm_kernel, pointers, dict(
        SB=spec.sb, LB=spec.lb, HB=spec.hb, SUPER=spec.superblock, MODE=spec.mode,
        OFF=spec.off, LUT=spec.lut, DD=spec.dd, BM=bm, BN=bn, NSUB=bk // spec.sb, GROUP_M=8,
        HAS_BIAS=False, EVEN_K=True, EVICT_FIRST=True, SPLIT=split, UPCAST=False, SWAP=swap),
        num_warps=warps, num_stages=stages)


SM89_SMEM = 101376
"""Shared memory a block may take on sm_86 / sm_89 (RTX 30xx / 40xx, L40S): the smallest
of the GPUs the plans may meet."""


@pytest.mark.parametrize("t", [GgmlType.Q4_K, GgmlType.Q6_K, GgmlType.Q8_0, GgmlType.Q2_K,
                               GgmlType.IQ4_XS], ids=lambda t: t.name)
def test_mm_plans_compile_for_sm90(t):
    """Every tile ``plan_mm`` picks for the 8B shapes at 16, 32, 64 and 128 rows (both
    products, split K or not) compiles to a wgmma (``SWAP``: the weight from registers)
    and fits the shared memory of the smaller GPUs. About a second a compile."""
    from cvllm.kernels.quant.ggml_plan import plan_mm

    plans = {plan_mm(m, n, k, SPECS[t], 132) for m in (16, 32, 64, 128)
             for n, k in [(4096, 4096), (28672, 4096), (4096, 14336)]}
    assert any(p[7] for p in plans) and (t != GgmlType.Q4_K or any(not p[7] for p in plans))
    for bm, bn, bk, warps, stages, _, split, swap in sorted(plans):
        compiled = _compile_mm(t, bm, bn, bk, warps, stages, split, swap)
        assert "wgmma.mma_async" in compiled.asm["ptx"], (bm, bn, bk, split, swap)
        assert compiled.metadata.shared <= SM89_SMEM, (bm, bn, bk, compiled.metadata.shared)


def test_mm_swap_takes_wgmma_at_16_rows():
    """At 16 rows the planned kernel's dot is 16 x 64 (mma.sync: wgmma's M is 64); swapped
    it is 64 x 16, a wgmma with the weight from registers."""
    plain = _compile_mm(GgmlType.Q4_K, 16, 64, 256, 4, 3, 4, False).asm["ptx"]
    swapped = _compile_mm(GgmlType.Q4_K, 16, 64, 256, 4, 3, 4, True).asm["ptx"]
    assert "mma.sync" in plain and "wgmma" not in plain
    assert "wgmma.mma_async" in swapped and "m64n16k16" in swapped
