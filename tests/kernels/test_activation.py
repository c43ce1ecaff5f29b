"""The gated-activation Triton kernel against its torch reference, and the reference
against the layers' torch path.

On the CPU the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``, in a fresh
subprocess) with tiny shapes in float32/float16 (the interpreter truncates to bfloat16
instead of rounding); the ``gpu`` tests run it compiled with model-sized rows in
bf16/fp16/fp32 and through the layers.
"""

from __future__ import annotations

import pytest
import torch

from cvllm.kernels.reference.linear import ACT_AND_MUL, act_and_mul_ref
from cvllm.layers.activation import get_act_and_mul_fn
from tests.interpreted import run_interpreted

CUDA = torch.cuda.is_available()
# act(gate) is rounded like torch's; the activation's last bit may differ: ~1 ulp.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def check_act_and_mul(activation="silu", rows=3, inter=40, dtype=torch.float32, device="cpu",
                      strided=False, seed=0):
    from cvllm.kernels.activation import act_and_mul

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 2 * inter + (5 if strided else 0), generator=g) * 4  # gelu tails
    x = (x[:, : 2 * inter] if strided else x).to(dtype=dtype, device=device)  # [R, 2I]
    got, want = act_and_mul(x, activation), act_and_mul_ref(x, activation)
    assert got.dtype == dtype and got.shape == want.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=tol, rtol=tol)


def run_cpu_cases() -> None:
    """Entry point of the interpreter subprocess."""
    for act in ACT_AND_MUL:
        check_act_and_mul(act)
        check_act_and_mul(act, rows=2, inter=33, dtype=torch.float16, strided=True)
    from cvllm.kernels.activation import act_and_mul

    x = torch.randn(2, 3, 16)  # leading dims are kept
    assert act_and_mul(x).shape == (2, 3, 8)
    torch.testing.assert_close(act_and_mul(x), act_and_mul_ref(x))


def test_kernel_interpreted_on_cpu():
    code = "from tests.kernels.test_activation import run_cpu_cases; run_cpu_cases()"
    run_interpreted(code)


@pytest.mark.parametrize("hidden_act,activation", [
    ("silu", "silu"), ("gelu", "gelu"), ("gelu_pytorch_tanh", "gelu_tanh")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_layers_torch_path(hidden_act, activation, dtype):
    x = (torch.randn(4, 2 * 24) * 3).to(dtype)
    assert torch.equal(get_act_and_mul_fn(hidden_act)(x), act_and_mul_ref(x, activation))


def test_wrapper_rejects_bad_inputs():
    from cvllm.kernels.activation import act_and_mul

    with pytest.raises(ValueError, match="unsupported"):
        act_and_mul(torch.randn(2, 8), "relu")
    with pytest.raises(ValueError, match="2I"):
        act_and_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match="dtype"):
        act_and_mul(torch.randn(2, 8).double())


# ----- GPU: compiled, model-sized ---------------------------------------------------------------

gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("activation", ACT_AND_MUL)
@pytest.mark.parametrize("dtype,rows,inter", [
    (torch.bfloat16, 1, 14336), (torch.bfloat16, 300, 14336), (torch.bfloat16, 64, 6912),
    (torch.bfloat16, 5, 1000), (torch.float16, 300, 14336), (torch.float32, 300, 14336)])
def test_act_and_mul_cuda(activation, dtype, rows, inter):
    check_act_and_mul(activation, rows, inter, dtype, "cuda", strided=rows == 5)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("hidden_act", ["silu", "gelu", "gelu_pytorch_tanh"])
def test_layers_dispatch_on_cuda(hidden_act):
    """The layers on CUDA (Triton) agree with themselves on the CPU (torch)."""
    x = (torch.randn(33, 2 * 4096) * 3).to(torch.bfloat16)
    act = get_act_and_mul_fn(hidden_act)
    got = act(x.cuda())
    torch.testing.assert_close(got.float().cpu(), act(x).float(), atol=1.6e-2, rtol=1.6e-2)
