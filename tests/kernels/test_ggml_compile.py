"""The int8 GGUF kernels compiled for an H100/H200 (sm_90) on a machine without a GPU.

The interpreter (``TRITON_INTERPRET=1``, tests/kernels/test_ggml_cuda.py) runs a kernel as
Python, so it accepts what Triton's compiler refuses: a ``@triton.jit`` function with a
return in a constexpr branch and another after it (the compiler types every return
statement, and stores after such an early return are compiled too). The first Q8_0 build
of the int8 GEMV passed every interpreted test and failed to compile on 2 x H200. Here
each variant of ``ggml_gemv_i8_kernel`` and ``ggml_q8_kernel`` is compiled to PTX for
sm_90 by Triton's own compiler (its bundled ptxas), as the GPU would compile it."""

from __future__ import annotations

import itertools

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from cvllm.kernels.quant import ggml_kernels as gk  # noqa: E402

pytestmark = pytest.mark.slow


def _compile(fn, pointers, constexprs):
    names = fn.arg_names
    sig = {n: pointers.get(n, "constexpr" if n in constexprs else "i32") for n in names}
    src = ASTSource(fn=fn, signature=sig,
                    constexprs={(names.index(k),): v for k, v in constexprs.items()})
    try:
        return triton.compile(src, target=GPUTarget("cuda", 90, 32))
    except Exception as e:  # noqa: BLE001 - a backend missing here is not a kernel bug
        if "CompilationError" in type(e).__name__ or "TypeError" in repr(e):
            raise
        pytest.skip(f"Triton cannot compile for sm_90 here: {type(e).__name__}: {e}")


# (MODE, OFF, WPS): Q4_0, Q4_K and Q8_0
TYPES = [(0, -8, 4), (3, 0, 4), (0, -128, 8)]


@pytest.mark.parametrize("mode,off,wps", TYPES)
def test_gemv_i8_compiles_for_sm90(mode, off, wps):
    pointers = {"x_ptr": "*i32", "xs_ptr": "*fp32", "y_ptr": "*bf16", "b_ptr": "*bf16",
                "lo_ptr": "*i32", "d_ptr": "*fp16", "dm_ptr": "*fp16", "sc_ptr": "*u8",
                "mn_ptr": "*u8"}
    # (x pre-rounded, prefetch, K a whole number of steps, gated activation): each branch
    # of the kernel at least once (a pre-rounded x carries its activation already)
    for xq, prefetch, even_k, act in ((False, False, True, 0), (True, True, False, 0),
                                      (False, True, False, 1)):
        pointers["x_ptr"] = "*i32" if xq else "*bf16"
        compiled = _compile(gk.ggml_gemv_i8_kernel, pointers, dict(
            SUPER=256 if mode == 3 else 32, MODE=mode, OFF=off, BN=16, NSUB=2048 // 32 // (
                wps // 4), HAS_BIAS=False, EVEN_K=even_k, PREFETCH=prefetch, PDL=False,
            WIDE=False, ASM=True, ACT=act, XQ=xq, WPS=wps))
        assert "dp4a" in compiled.asm["ptx"]


@pytest.mark.parametrize("wps", [4, 8])
def test_q8_kernel_compiles_for_sm90(wps):
    for even_k, act in itertools.product((True, False), (0, 1)):
        compiled = _compile(gk.ggml_q8_kernel, {"x_ptr": "*bf16", "q_ptr": "*i32",
                                                "s_ptr": "*fp32"},
                            dict(NSUB=32, EVEN_K=even_k, ASM=True, ACT=act, PDL=False,
                                 WPS=wps))
        ptx = compiled.asm["ptx"]
        # the 8-bit form stores one run of words, the 4-bit form two (xe, then xd)
        assert "st.global" in ptx
