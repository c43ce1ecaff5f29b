"""The RMSNorm Triton kernel against its torch reference, and the reference against the
layers' torch path.

On the CPU the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``, in a fresh
subprocess so other tests' triton state is untouched) with tiny shapes in float32 and
float16 (the interpreter truncates float32 -> bfloat16 instead of rounding, so bfloat16
is checked on the GPU only); on a CUDA machine the ``gpu`` tests run it compiled with
model-sized rows in bf16/fp16/fp32, and through the layers.
"""

from __future__ import annotations

import pytest
import torch

from cvllm.kernels.reference.norms import rms_norm_ref
from cvllm.layers.layernorm import GemmaRMSNorm, RMSNorm
from tests.interpreted import run_interpreted

CUDA = torch.cuda.is_available()
# Outputs may differ by one rounding of the result (the sum's order differs).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _inputs(rows, hidden, dtype, device, seed=0, strided=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden + (7 if strided else 0), generator=g) * 3
    x = x[:, :hidden] if strided else x  # [R, N], rows not contiguous when strided
    r = torch.randn(rows, hidden, generator=g)
    w = torch.randn(hidden, generator=g) * 0.5 + 1.0
    return x.to(dtype=dtype, device=device), r.to(dtype=dtype, device=device), \
        w.to(dtype=dtype, device=device)


def assert_close(got, want, dtype):
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=tol, rtol=tol)


def check_rms_norm(rows=5, hidden=48, dtype=torch.float32, device="cpu", offset=False,
                   strided=False):
    from cvllm.kernels.rmsnorm import rms_norm

    x, r, w = _inputs(rows, hidden, dtype, device, strided=strided)
    assert_close(rms_norm(x, w, 1e-6, offset=offset), rms_norm_ref(x, w, 1e-6, offset=offset),
                 dtype)
    out, res = rms_norm(x, w, 1e-5, residual=r, offset=offset)
    want_out, want_res = rms_norm_ref(x, w, 1e-5, residual=r, offset=offset)
    assert torch.equal(res, want_res)  # the add rounds once either way
    assert_close(out, want_out, dtype)
    # In place, as a fused decoder layer would call it; x and r are not used again.
    x, r = x.contiguous(), r.clone()
    got = rms_norm(x, w, 1e-5, residual=r, offset=offset, out=x, residual_out=r)
    assert got[0] is x and got[1] is r
    assert torch.equal(r, want_res)
    assert_close(x, want_out, dtype)


def check_heads(device="cpu", dtype=torch.float32, T=3, H=4, D=16):
    """q/k-norm: [T, H, D] heads of a strided q view, as Qwen3 passes them."""
    from cvllm.kernels.rmsnorm import rms_norm

    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(T, 3 * H * D, generator=g).to(dtype=dtype, device=device)
    q = qkv[:, : H * D].view(T, H, D)  # [T, H, D], token stride 3*H*D
    w = torch.randn(D, generator=g).to(dtype=dtype, device=device)
    for offset in (False, True):
        assert_close(rms_norm(q, w, 1e-6, offset=offset), rms_norm_ref(q, w, 1e-6, offset=offset),
                     dtype)


CPU_CASES = [
    dict(), dict(offset=True), dict(rows=1, hidden=100, strided=True),
    dict(dtype=torch.float16, hidden=64), dict(dtype=torch.float16, offset=True, rows=3),
]


Q8_SIZES = ((256, 4, False), (96, 4, True), (256, 8, True), (160, 8, False))
"""(hidden, q8_wps, with a residual) of ``check_q8``."""


def check_q8(device="cpu", dtype=torch.float16, sizes=Q8_SIZES) -> None:
    """``q8_wps``: the output unchanged, and carrying the int8 form ``quantize_q8`` gives
    for it, bit for bit (4- and 8-bit word layouts, a row of whole and of masked
    sub-block runs, with and without the residual); a GGUF GEMV that takes the output
    equals the one that rounds it in its own kernel; the form is dropped once the output
    changes, and never made for two rows."""
    from cvllm.kernels.quant import ggml_cuda as gc
    from cvllm.kernels.quant import q8form as q8f
    from cvllm.kernels.quant.ggml_types import GgmlType
    from cvllm.kernels.rmsnorm import rms_norm
    from tests.kernels.test_ggml_cuda import random_raw

    for hidden, wps, res in sizes:
        x, r, w = _inputs(1, hidden, dtype, device, seed=hidden)
        plain = rms_norm(x, w, 1e-6, residual=r if res else None)
        got = rms_norm(x, w, 1e-6, residual=r if res else None, q8_wps=wps)
        out, plain = (got[0], plain[0]) if res else (got, plain)
        assert torch.equal(out, plain)
        words, steps = q8f.attached_q8(out, wps)
        want_w, want_s = q8f.quantize_q8(out, hidden, 0, wps)
        assert torch.equal(words, want_w) and torch.equal(steps, want_s)
        assert q8f.attached_q8(out, 12 - wps) is None  # the other layout: not this form
        t = GgmlType.Q8_0 if wps == 8 else GgmlType.Q4_K
        if hidden % 256 == 0 or t == GgmlType.Q8_0:
            wq = gc.prepare(random_raw(t, 24, hidden, device=device), t)
            # (the planned tiles differ with prequant: compared where the K order matches)
            for cfg in ((None,) if device == "cpu" else ()) + ((8, 64, 4, False, 2),):
                assert torch.equal(gc.linear(out, wq, config=cfg),
                                   gc.linear(out.clone(), wq, config=cfg, prequant=True))
            fake = out.clone()  # the GEMV reads the attached form, not the row: zeros in
            q8f.attach_q8(fake, wps, torch.zeros_like(words), torch.zeros_like(steps))
            assert not gc.linear(fake, wq).any() and gc.linear(out, wq).any()
        out.mul_(2)  # written in place: the form no longer describes it
        assert q8f.attached_q8(out, wps) is None
    x, r, w = _inputs(2, 64, dtype, device)
    assert q8f.attached_q8(rms_norm(x, w, 1e-6, q8_wps=4), 4) is None


def run_cpu_cases() -> None:
    """Entry point of the interpreter subprocess."""
    for case in CPU_CASES:
        check_rms_norm(**case)
    check_heads()
    check_heads(dtype=torch.float16)
    check_q8()


def test_kernel_interpreted_on_cpu():
    code = "from tests.kernels.test_rmsnorm import run_cpu_cases; run_cpu_cases()"
    run_interpreted(code)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reference_is_the_layers_torch_path(dtype):
    """Bit-equal to RMSNorm / GemmaRMSNorm on the CPU, with and without a residual."""
    x, r, w = _inputs(4, 32, dtype, "cpu")
    for layer, offset in ((RMSNorm(32, 1e-6, dtype), False), (GemmaRMSNorm(32, 1e-6, dtype), True)):
        layer.weight.data.copy_(w)
        assert torch.equal(layer(x), rms_norm_ref(x, w, 1e-6, offset=offset))
        got, want = layer(x, r), rms_norm_ref(x, w, 1e-6, residual=r, offset=offset)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_wrapper_rejects_bad_inputs():
    from cvllm.kernels.rmsnorm import rms_norm

    x, r, w = _inputs(2, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="disagree"):
        rms_norm(x, w[:4], 1e-6)
    with pytest.raises(ValueError, match="dtype"):
        rms_norm(x.double(), w, 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, w, 1e-6, residual=r.half())
    with pytest.raises(ValueError, match="residual_out needs"):
        rms_norm(x, w, 1e-6, residual_out=r)
    with pytest.raises(ValueError, match="viewable"):
        rms_norm(x, w, 1e-6, out=torch.empty(8, 2).t())
    with pytest.raises(ValueError, match="contiguous"):
        rms_norm(x, torch.randn(8, 2)[:, 0], 1e-6)


# ----- GPU: compiled, model-sized ---------------------------------------------------------------

gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


# bf16 over model widths (Llama-8B, Gemma-3-27B, DeepSeek, 405B, a q/k-norm head, an odd
# one; odd row counts use strided rows); fp16 and fp32 for the 8B width. Kept lean: each
# combination compiles its own kernel.
GPU_CASES = ([(torch.bfloat16, rows, hidden) for rows, hidden in
              [(1, 4096), (257, 4096), (33, 5376), (7, 7168), (2, 16384), (1000, 128), (3, 100)]]
             + [(torch.float16, 257, 4096), (torch.float32, 257, 4096)])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype,rows,hidden", GPU_CASES)
@pytest.mark.parametrize("offset", [False, True])
def test_rms_norm_cuda(dtype, rows, hidden, offset):
    check_rms_norm(rows, hidden, dtype, "cuda", offset=offset, strided=rows % 2 == 1)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_heads_cuda(dtype):
    check_heads("cuda", dtype, T=300, H=32, D=128)


@pytest.mark.gpu
@gpu
def test_q8_form_cuda():
    check_q8("cuda", torch.bfloat16, sizes=((4096, 4, True), (4096, 8, False), (576, 4, True)))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("cls", [RMSNorm, GemmaRMSNorm])
def test_layers_dispatch_on_cuda(cls):
    """The layers on CUDA (Triton) agree with themselves on the CPU (torch)."""
    x, r, w = _inputs(64, 4096, torch.bfloat16, "cpu", seed=5)
    layer = cls(4096, 1e-6, torch.bfloat16)
    layer.weight.data.copy_(w)
    want_out, want_res = layer(x, r)
    layer = layer.cuda()
    out, res = layer(x.cuda(), r.cuda())
    assert torch.equal(res.cpu(), want_res)
    assert_close(out, want_out, torch.bfloat16)
    assert_close(layer(x.cuda()), layer.cpu()(x), torch.bfloat16)
