"""The batch-1 GEMV Triton kernel against its torch reference, and its use by the linear
layers.

On the CPU the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``, in a fresh
subprocess) with small shapes in float16, covering ragged N and K, a bias and explicit
configs; on a CUDA machine the ``gpu`` tests run it compiled at the 8B decoder's shapes
in bf16 and check the layers route a single row to it.
"""

from __future__ import annotations

import pytest
import torch

from cvllm.kernels.reference.linear import gemv_ref
from tests.interpreted import run_interpreted

CUDA = torch.cuda.is_available()


def _inputs(n, k, dtype, device, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=g)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    b = torch.randn(n, generator=g) if bias else None
    to = dict(dtype=dtype, device=device)
    return x.to(**to), w.to(**to), (b.to(**to) if bias else None)


def check_gemv(n, k, dtype=torch.float16, device="cpu", bias=False, config=None):
    from cvllm.kernels.gemv import gemv

    x, w, b = _inputs(n, k, dtype, device, bias=bias)
    got = gemv(x, w, b, config=config)
    want = gemv_ref(x, w, b)
    assert got.shape == (1, n) and got.dtype == dtype
    # One rounding of a float32 sum whose order differs: a unit in the last place of the
    # output, plus float32 summation noise on outputs of magnitude ~1.
    tol = 2e-3 if dtype == torch.float16 else 1.6e-2
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=tol, rtol=tol)
    # A 1-D x gives a 1-D y; a strided bias view reads right.
    assert gemv(x[0], w, b, config=config).shape == (n,)
    if b is not None:
        wide = torch.stack([b, torch.zeros_like(b)], dim=1)  # [n, 2]
        torch.testing.assert_close(gemv(x, w, wide[:, 0], config=config).float().cpu(),
                                   want.float().cpu(), atol=tol, rtol=tol)


CPU_CASES = [
    dict(n=64, k=128), dict(n=37, k=100), dict(n=5, k=300, bias=True),
    dict(n=64, k=256, config=(16, 64, 4)), dict(n=33, k=96, config=(4, 32, 1)),
]


def check_gated(n, k, act, dtype=torch.float16, device="cpu") -> None:
    """``gemv(x, w, act=a)`` over a ``[1, 2K]`` gate_up row equals the activation kernel
    followed by the GEMV bit for bit (the same roundings and summation order), and the
    reference within the GEMV tolerance."""
    from cvllm.kernels.activation import act_and_mul
    from cvllm.kernels.gemv import gemv
    from cvllm.kernels.reference.linear import act_and_mul_ref

    g = torch.Generator().manual_seed(n + k)
    x = (2 * torch.randn(1, 2 * k, generator=g)).to(dtype=dtype, device=device)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype=dtype, device=device)
    got = gemv(x, w, act=act)
    assert got.shape == (1, n)
    assert torch.equal(got, gemv(act_and_mul(x, act), w)), act
    tol = 2e-3 if dtype == torch.float16 else 1.6e-2
    torch.testing.assert_close(got.float().cpu(),
                               gemv_ref(act_and_mul_ref(x, act), w).float().cpu(),
                               atol=tol, rtol=tol)


def run_cpu_cases() -> None:
    """Entry point of the interpreter subprocess."""
    for case in CPU_CASES:
        check_gemv(**case)
    for n, k, act in [(16, 64, "silu"), (9, 100, "gelu"), (12, 40, "gelu_tanh")]:
        check_gated(n, k, act)


def test_kernel_interpreted_on_cpu():
    code = "from tests.kernels.test_gemv import run_cpu_cases; run_cpu_cases()"
    run_interpreted(code)


def test_plan_covers_the_sms_and_bounds_the_tile():
    from cvllm.kernels.gemv import plan

    for n, k in [(4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336), (128256, 4096),
                 (576, 576), (7, 9)]:
        bn, bk, warps = plan(n, k, 132)
        assert bn >= 1 and bk >= 64 and bn * bk <= 16384 and warps in (1, 2, 4, 8)
        assert -(-n // bn) >= 132 or bn == 1
    assert plan(4096, 4096, 132) == plan(4096, 4096, 132)  # deterministic
    # The sweeps' choices: wide K steps for large weights, 1024 under 64 MiB (TP halves).
    assert plan(28672, 4096, 132) == (4, 2048, 4)
    assert plan(4096, 14336, 132) == (4, 2048, 4)
    assert plan(4096, 2048, 132) == (8, 1024, 4)
    assert plan(4096, 7168, 132) == (8, 1024, 4)


def test_wrapper_rejects_bad_inputs():
    from cvllm.kernels.gemv import gemv

    x, w, _ = _inputs(8, 16, torch.float16, "cpu")
    with pytest.raises(ValueError, match="disagree"):
        gemv(x, w[:, :8])
    with pytest.raises(ValueError, match="one row"):
        gemv(torch.cat([x, x]), w)
    with pytest.raises(ValueError, match="dtype"):
        gemv(x.float(), w.float())
    with pytest.raises(ValueError, match="contiguous"):
        gemv(x, torch.randn(16, 8, dtype=torch.float16).t())
    with pytest.raises(ValueError, match="bias"):
        gemv(x, w, torch.zeros(3, dtype=torch.float16))
    with pytest.raises(ValueError, match="activation"):
        gemv(torch.cat([x, x], dim=-1), w, act="relu2")
    with pytest.raises(ValueError, match="2K"):  # a gated row is twice as wide as K
        gemv(x, w, act="silu")
    from cvllm.kernels.allreduce import PushTarget

    target = PushTarget([torch.zeros(64, dtype=torch.int16)], torch.zeros(8, dtype=torch.int32),
                        0, 1, slot_bytes=8)
    with pytest.raises(ValueError, match="slot"):  # 8 outputs of 2 bytes exceed 8 bytes
        gemv(x, w, push=target)
    with pytest.raises(ValueError, match="bias"):
        gemv(x, w, torch.zeros(8, dtype=torch.float16), push=target._replace(slot_bytes=64))
    with pytest.raises(ValueError, match="one buffer per rank"):
        gemv(x, w, push=target._replace(slot_bytes=64, world=2))
    with pytest.raises(ValueError, match="one buffer per rank"):  # int32 bufs: 4-byte payload
        gemv(x, w, push=target._replace(slot_bytes=64,
                                        bufs=[torch.zeros(64, dtype=torch.int32)]))


def test_use_gemv_only_for_a_large_single_cuda_row():
    from cvllm.kernels.gemv import use_gemv

    x, w, _ = _inputs(8, 16, torch.float16, "cpu")
    assert not use_gemv(x, w)  # not CUDA


# ----- GPU: compiled, model-sized ---------------------------------------------------------------

gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

GPU_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096),
              (3072, 4096), (4096, 2048), (1000, 4000), (4099, 4096)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n,k", GPU_SHAPES)
def test_gemv_gpu_matches_reference(n, k):
    check_gemv(n, k, dtype=torch.bfloat16, device="cuda", bias=(n == 1000))


@pytest.mark.gpu
@gpu
def test_linear_layer_routes_one_row_to_gemv(monkeypatch):
    """A single CUDA row goes through ``gemv`` and equals the cuBLAS path within the stated
    tolerance; two rows stay with cuBLAS."""
    from cvllm.kernels import gemv as g
    from cvllm.layers.linear import ReplicatedLinear

    layer = ReplicatedLinear(4096, 2048, bias=False, params_dtype=torch.bfloat16).cuda()
    layer.weight.data.normal_(0, 0.02)
    calls = []
    real = g.gemv
    monkeypatch.setattr(g, "gemv", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    got = layer(x)
    assert calls, "one row did not reach the GEMV kernel"
    torch.testing.assert_close(got.float(), gemv_ref(x, layer.weight).float(), atol=1.6e-2,
                               rtol=1.6e-2)
    calls.clear()
    layer(torch.cat([x, x]))
    assert not calls


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("act,bias", [("silu", False), ("gelu_tanh", False), ("silu", True)])
def test_gated_gemv_gpu_and_the_mlp_route(act, bias, monkeypatch):
    """The gated GEMV at the 8B down shape equals act_and_mul + GEMV bit for bit; a
    RowParallelLinear (with or without a bias) given the activation routes one row to
    it, two rows to the plain path, with the same values."""
    from cvllm.kernels import gemv as g
    from cvllm.layers.activation import get_act_and_mul_fn
    from cvllm.layers.linear import RowParallelLinear

    check_gated(4096, 14336, act, dtype=torch.bfloat16, device="cuda")
    layer = RowParallelLinear(4096, 1024, bias=bias, params_dtype=torch.bfloat16).cuda()
    layer.weight.data.normal_(0, 0.03)
    if bias:
        layer.bias.data.normal_(0, 0.5)
    act_fn = get_act_and_mul_fn("silu" if act == "silu" else "gelu_pytorch_tanh")
    seen = []
    real = g.gemv
    monkeypatch.setattr(g, "gemv", lambda *a, **kw: seen.append(kw.get("act")) or real(*a, **kw))
    x = torch.randn(2, 8192, device="cuda", dtype=torch.bfloat16)
    one = layer(x[:1], act_fn=act_fn)
    assert seen == [act]
    both = layer(x, act_fn=act_fn)
    assert seen == [act], "two rows stay with the plain path"
    assert torch.equal(one, layer(act_fn(x[:1])))  # the unfused GEMV
    torch.testing.assert_close(both[:1].float(), one.float(), atol=1.6e-2, rtol=1.6e-2)
