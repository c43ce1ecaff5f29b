"""The GGUF LM head at one row on CUDA (``kernels/quant/ggml_head.py``): the int8 GEMV with
each row's 16 largest logits recomputed exactly, against the exact float GEMV
(``ggml_cuda.linear(path="gemv")``), and its top-k kernels against ``torch.topk``. On the
CPU under Triton's interpreter (a fresh process), on the GPU at an 8B vocabulary.

Tolerances: the recomputed logits are the float GEMV's own, bit for bit; the others carry
the int8 rounding of x (4e-2 of the RMS, as the int8 GEMV's own tests give it against the
unrounded product)."""

from __future__ import annotations

import pytest
import torch

from cvllm.utils import tuning
from tests.interpreted import run_interpreted
from tests.kernels.test_ggml_cuda import assert_close_rms, random_raw

HEAD_TYPES = ("Q6_K", "Q8_0")


def check_topk(device: str) -> None:
    from cvllm.kernels.quant.ggml_head import topk_rows

    g = torch.Generator(device="cpu").manual_seed(0)
    # one part (fewer parts than 16), three, a last part of 5 columns, whole parts
    for m, v, dtype in ((1, 1000, torch.float32), (2, 3000, torch.bfloat16),
                        (1, 1029, torch.float32), (1, 4096, torch.float16)):
        y = (torch.randn(m, v, generator=g) * 3).to(dtype).to(device)
        y[0, 7] = y[0, 11] = y.max() + 1  # a tie at the top: the higher column first
        if m > 1:  # row 1: its 16 largest in two neighbouring groups of one part, and
            # row 1's part maxima below row 0's (rows do not mix)
            y[1] = y[1] - 100
            y[1, 1024 + 40:1024 + 56] = torch.arange(16, dtype=torch.float32).to(dtype)
        if v == 1029:  # the largest in the 5-column last part
            y[0, 1026] = y.max() + 2
        idx = topk_rows(y)
        want = torch.topk(y.float(), 16, dim=1)
        torch.testing.assert_close(y.float().gather(1, idx), want.values)  # same values
        assert idx[0, int(v == 1029)] == 11 and idx[0, 1 + int(v == 1029)] == 7
        assert all(len(set(r.tolist())) == 16 for r in idx)
        if v == 1029:
            assert idx[0, 0] == 1026
        if m > 1:
            assert idx[1].tolist() == list(range(1024 + 55, 1024 + 39, -1))
    with pytest.raises(ValueError, match="power of two"):
        topk_rows(torch.zeros(1, 64, device=device), 12)


def check_head(t_name: str, n: int, k: int, device: str, dtype: torch.dtype) -> None:
    from cvllm.kernels.quant import ggml_cuda as gc
    from cvllm.kernels.quant import ggml_head as gh
    from cvllm.kernels.quant.ggml_types import GgmlType

    t = GgmlType[t_name]
    w = gc.prepare(random_raw(t, n, k, seed=3, device=device), t, exact=True)
    g = torch.Generator(device="cpu").manual_seed(k)
    x = torch.randn(1, k, generator=g).to(dtype).to(device)
    bias = torch.randn(n, generator=g).to(dtype).to(device)
    assert gh.takes_int8_head(x, w)
    for b in (None, bias):
        want = gc.linear(x, w, b, path="gemv").float()  # the exact float GEMV
        approx = gc.linear(x, w, b, path="gemv_i8")  # what the head starts from
        got = gh.head_linear(x, w, b).float()
        chosen = gh.topk_rows(approx)  # the logits it recomputes
        approx = approx.float()
        # recomputed by the float GEMV at the whole head's tiles: its values, bit for bit
        assert torch.equal(got.gather(1, chosen), want.gather(1, chosen))
        rest = torch.ones_like(got, dtype=torch.bool).scatter_(1, chosen, False)
        assert torch.equal(got[rest], approx[rest])  # the others as the int8 GEMV left them
        # the exact head's 8 largest are among them (its 16th and 17th may swap under the
        # int8 rounding: a tie within that error, not a miss)
        top = torch.topk(want, 8, dim=1).indices
        assert set(top[0].tolist()) <= set(chosen[0].tolist())
        assert int(got.argmax()) == int(want.argmax())
        assert_close_rms(got, want, 4e-2)  # as the int8 GEMV against the unrounded x
    # more rows, or the switch off: the exact float path itself
    x2 = torch.randn(2, k, generator=g).to(dtype).to(device)
    assert not gh.takes_int8_head(x2, w)
    assert torch.equal(gh.head_linear(x2, w), gc.linear(x2, w))
    with tuning.configure(ggml_int8_head=False):
        assert torch.equal(gh.head_linear(x, w, bias), gc.linear(x, w, bias))


def run_cpu_cases() -> None:
    check_topk("cpu")
    for t_name in HEAD_TYPES:
        check_head(t_name, 1024, 256, "cpu", torch.float16)


def test_head_interpreted_on_cpu():
    run_interpreted("from tests.kernels.test_ggml_head import run_cpu_cases; run_cpu_cases()")


def test_cpu_backend_head_is_its_linear():
    """Backends without a head product of their own multiply an LM head as any weight."""
    from cvllm.kernels.quant.backend import ReferenceBackend
    from cvllm.kernels.quant.ggml_types import GgmlType

    be = ReferenceBackend()
    w = be.prepare(random_raw(GgmlType.Q8_0, 32, 64), GgmlType.Q8_0, torch.float32)
    x = torch.randn(1, 64)
    assert torch.equal(be.linear_head(x, w), be.linear(x, w))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("t_name", HEAD_TYPES)
def test_head_8b_vocab_gpu(t_name):
    """An 8B head's shape (128256 x 4096) in bf16, eagerly and replayed from a CUDA graph
    (fixed shapes: the same logits)."""
    check_topk("cuda")
    check_head(t_name, 128256, 4096, "cuda", torch.bfloat16)
    from cvllm.kernels.quant import ggml_cuda as gc
    from cvllm.kernels.quant import ggml_head as gh
    from cvllm.kernels.quant.ggml_types import GgmlType

    t = GgmlType[t_name]
    w = gc.prepare(random_raw(t, 128256, 4096, seed=5, device="cuda"), t, exact=True)
    x = torch.randn(1, 4096, device="cuda").to(torch.bfloat16)
    eager = gh.head_linear(x, w)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        gh.head_linear(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gh.head_linear(x, w)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.slow
def test_topk_kernels_compile_for_sm90():
    """The two top-k kernels through Triton's own sm_90 compiler (the interpreter accepts
    what the compiler may refuse), at the 8B vocabulary's merge width (126 parts)."""
    from cvllm.kernels.quant import ggml_head as gh
    from tests.kernels.test_ggml_compile import _compile

    part = _compile(gh._topk_part_kernel, {"y_ptr": "*bf16", "part_ptr": "*i64"},
                    dict(R=16, BLOCK=gh._BLOCK, G=gh._GROUP))
    merge = _compile(gh._topk_merge_kernel, {"part_ptr": "*i64", "idx_ptr": "*i64"},
                     dict(R=16, PARTS=128, BLOCK=gh._BLOCK))
    for compiled in (part, merge):
        assert "st.global" in compiled.asm["ptx"]
    # the float GEMV on chosen rows (IDS), Q6_K's head tiles (bk 1024, 2 warps) and Q8_0's
    from cvllm.kernels.quant import ggml_cuda as gc
    from cvllm.kernels.quant import ggml_kernels as gk
    from cvllm.kernels.quant.ggml_pack import SPECS
    from cvllm.kernels.quant.ggml_plan import plan_gemv
    from cvllm.kernels.quant.ggml_types import GgmlType

    for t in (GgmlType.Q6_K, GgmlType.Q8_0):
        spec = SPECS[t]
        bn, bk, warps, prefetch = plan_gemv(1, 128256, 4096, spec, 132)
        pointers = {"x_ptr": "*bf16", "y_ptr": "*bf16", "b_ptr": "*bf16", "lo_ptr": "*i32",
                    "hi_ptr": "*i32", "d_ptr": "*i32" if spec.dd else "*fp16",
                    "dm_ptr": "*fp16", "sc_ptr": "*i8", "ids_ptr": "*i64"}
        compiled = _compile(gk.ggml_gemv_kernel, pointers, dict(
            **gc.type_consts(spec), BM=1, BN=bn, NSUB=bk // spec.sb, HAS_BIAS=True,
            EVEN_K=True, PREFETCH=prefetch, PDL=True, WARPS=warps, IDS=True), num_warps=warps)
        assert "griddepcontrol.wait" in compiled.asm["ptx"]
