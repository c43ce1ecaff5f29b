"""GGUF block-quantized linears on the GPU (``kernels/quant/ggml_cuda.py``) against the
reference: the blocks dequantized (``kernels/quant/reference.dequantize`` when present,
else ``gguf.quants.dequantize``) and multiplied in float32/float64.

On the CPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, in a fresh
subprocess) with small shapes for every type and every path (the FMA GEMV at 1 and 2
rows, the tensor-core kernel with and without split K, the dequantize + matmul path,
dequantize, embedding); the layout itself (``ggml_pack``) and the wrappers' input checks
run without Triton. On a CUDA machine the ``gpu`` tests run the compiled kernels at the
8B Llama shapes.

Tolerances (relative to the output's RMS; float32 accumulation throughout): the GEMV keeps
the weights in float32, so its error is the output's rounding (bf16: 2**-9 relative);
the tensor-core and dense paths also round each weight to x's dtype, which adds about
2**-9 of the output's RMS (random-walk over K); 2e-2 of the RMS covers both with margin
for float32 summation order. The int8 GEMV (``gemv_i8``: one row of Q4_0 / Q4_1 / Q4_K /
Q8_0) is the exact product with x rounded to int8 per 32 elements (``int8_rounded``, emulated
here in torch; its inputs are ``tie_free``), held to ``I8_TOL`` against that product; against the
unrounded x its error is that rounding's, 0.5-1% of the output's RMS on these random
weights (each element off by up to half of 1/127 of its block's largest |x|), checked at
4e-2 (relative L2 under 2e-2).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cvllm.kernels.quant import ggml_plan as gp
from cvllm.kernels.quant.ggml_types import QUANTIZED_TYPES, GgmlType, block_shape
from tests.interpreted import run_interpreted

CUDA = torch.cuda.is_available()
TYPES = sorted(QUANTIZED_TYPES)

_F16_FIELDS = {  # byte offsets of each type's fp16 scale fields in its block
    GgmlType.Q4_0: (0,), GgmlType.Q4_1: (0, 2), GgmlType.Q5_0: (0,), GgmlType.Q5_1: (0, 2),
    GgmlType.Q8_0: (0,), GgmlType.IQ4_NL: (0,), GgmlType.Q2_K: (80, 82),
    GgmlType.Q3_K: (108,), GgmlType.Q4_K: (0, 2), GgmlType.Q5_K: (0, 2),
    GgmlType.Q6_K: (208,), GgmlType.IQ4_XS: (0,),
}
_GGUF_QUANTIZE = (GgmlType.Q4_0, GgmlType.Q4_1, GgmlType.Q5_0, GgmlType.Q5_1, GgmlType.Q8_0)


def random_raw(t: GgmlType, n: int, k: int, seed: int = 0, device="cpu") -> torch.Tensor:
    """uint8 ``[n, k / B * S]``: gguf-quantized Gaussian weights where gguf can quantize
    the type (small shapes), else random bytes with random fp16 scales in a sane range
    (the kernels must decode any bit pattern)."""
    elems, nbytes = block_shape(t)
    if t in _GGUF_QUANTIZE and n * k <= 1 << 16 and str(device) == "cpu":
        import gguf

        w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
        raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType(int(t)))
        return torch.from_numpy(raw).to(device)
    g = torch.Generator(device=device).manual_seed(seed)
    raw = torch.randint(0, 256, (n, k // elems, nbytes), generator=g, dtype=torch.uint8,
                        device=device)  # [n, nb, S]
    for off in _F16_FIELDS[t]:
        scale = torch.rand(n, k // elems, generator=g, device=device) * 0.01 + 0.001
        raw[..., off:off + 2] = scale.to(torch.float16).view(torch.uint8).view(n, -1, 2)
    return raw.reshape(n, -1)


def oracle(raw: torch.Tensor, t: GgmlType) -> torch.Tensor:
    """The reference dequantization ``[N, K]`` float32 on raw's device."""
    try:
        from cvllm.kernels.quant.reference import dequantize
    except ImportError:
        import gguf

        out = gguf.quants.dequantize(raw.cpu().numpy(), gguf.GGMLQuantizationType(int(t)))
        return torch.from_numpy(np.ascontiguousarray(out)).to(raw.device)
    return dequantize(raw, t, torch.float32)


def assert_close_rms(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """Every element within ``tol`` of want's RMS plus the output dtype's rounding of it
    (half an ulp is up to 2**-8 of the value in bf16, 2**-11 in fp16), none unwritten
    (NaN); and the relative L2 distance to want rounded to the output dtype under
    ``tol / 2``. The rounding is left out of the L2 term because in bf16 it alone is
    about 1.7e-3 of the norm (a uniform error of a 2**-7-relative ulp over
    log-uniform mantissas), which left an exact int8 GEMV only 0.3e-3 of room under
    I8_TOL / 2 (2 x H200: 2.02e-3 > 2e-3 at 8B shapes)."""
    ulp = 2.0 ** -8 if got.dtype == torch.bfloat16 else 2.0 ** -10
    rounded = want.to(got.dtype).double().cpu()
    got, want = got.double().cpu(), want.double().cpu()
    assert torch.isfinite(got).all(), "non-finite output (an unwritten element?)"
    rms = want.pow(2).mean().sqrt().item() or 1.0
    err = ((got - want).abs() - ulp * want.abs()).max().item()
    assert err <= tol * rms, f"max error {err:.3g} (past rounding) > {tol} x RMS {rms:.3g}"
    rel = ((got - rounded).norm() / want.norm()).item()
    assert rel <= tol / 2, f"relative L2 error (past rounding) {rel:.3g} > {tol / 2}"


I8_TOL = 4e-3
"""``gemv_i8`` against the product with x rounded as it rounds it (on ``tie_free`` x):
float32 scaling and integer sums leave only the output's own rounding, which
``assert_close_rms`` allows separately; a wrong scale (amax / 128 for / 127) is 8e-3 off."""


def _ties(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """``[M, K]`` bool: elements at exactly half their block's largest |x| (blocks of
    ``group``: 32, or Q6_K's 16)."""
    xf = x.float().reshape(x.shape[0], -1, group)
    amax = xf.abs().amax(-1, keepdim=True)
    return ((xf.abs() * 2 == amax) & (amax > 0)).reshape(x.shape)


def tie_free(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """``x`` with no element at exactly half its block's largest |x| (each such one
    moved a step toward zero). There ``x * 127 / amax`` is 63.5 but for the rounding of
    ``127 / amax``, and whether the int8 GEMV rounds it to 63 or 64 depends on whether
    the compiler fused its multiply with the add that rounds (an FMA on the GPU, where
    the exact product is rounded once; not under the interpreter or in torch): both are
    roundings of x. In bf16 about 0.3% of Gaussian elements sit there; each one decided
    the other way moves every output by one int8 step times a weight (2 x H200: relative
    L2 2.0-2.3e-3 and one element 5e-3 of the RMS off ``int8_rounded``'s product)."""
    x = x.clone()
    for _ in range(8):
        ties = _ties(x, group)
        if not ties.any():
            return x
        x[ties] = (x[ties].float() * (1 - 2.0 ** -6)).to(x.dtype)
    raise AssertionError("could not move x off its ties")


def int8_rounded(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """``x [M, K]`` as ``gemv_i8`` rounds it, float64: per ``group`` elements (32; Q6_K's
    16, ``ggml_plan.i8_group``) ``round(x * (127 / amax)) * amax / 127`` (half to even,
    float32 products)."""
    xf = x.float().reshape(x.shape[0], -1, group)
    amax = xf.abs().amax(-1, keepdim=True)
    q = torch.round(xf * torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax)))
    return (q.double() * (amax.double() / 127)).reshape(x.shape)


def check_linear(t: GgmlType, n: int, k: int, m: int, path=None, config=None,
                 dtype=torch.float16, device="cpu", bias=False, raw=None, want_w=None,
                 x=None):
    """``linear`` on ``m`` rows against the float64 product with the oracle's weights (and,
    on the int8 path, with x as that path rounds it)."""
    from cvllm.kernels.quant import ggml_cuda as gc

    raw = random_raw(t, n, k, seed=n + k + m, device=device) if raw is None else raw
    w = gc.prepare(raw, t)
    want_w = oracle(raw, t) if want_w is None else want_w  # [N, K]
    g = torch.Generator(device=device).manual_seed(m)
    gaussian = x is None
    if gaussian:
        x = torch.randn(m, k, generator=g, device=device).to(dtype)
    group = gp.i8_group(w.spec)
    x = tie_free(x, group)
    b = (torch.randn(n, generator=g, device=device) * 0.1).to(dtype) if bias else None
    y = gc.linear(x, w, b, path=path, config=config)
    want = x.double() @ want_w.double().T + (b.double() if bias else 0)
    assert y.shape == (m, n) and y.dtype == dtype
    if (path or gp.choose_path(m, w.spec)) == "gemv_i8":
        # The interpreter truncates where it rounds to bf16 (up to an ulp, one-sided).
        tol = 1e-2 if device == "cpu" and dtype == torch.bfloat16 else I8_TOL
        want_i8 = int8_rounded(x, group) @ want_w.double().T + (b.double() if bias else 0)
        assert_close_rms(y, want_i8, tol)
        # x rounded by its own kernel first, or by each GEMV program: the same rounding
        other = gc.linear(x, w, b, path=path, config=config, prequant=True)
        assert_close_rms(other, want_i8, tol)
        if device == "cpu":  # (on the GPU the two compiles may place an FMA differently)
            assert torch.equal(other, y)
        if gaussian:  # (an outlier makes its block's rounding coarse: a property of x)
            assert_close_rms(y, want, 4e-2)
    else:
        assert_close_rms(y, want, 2e-2)
    return w, want_w


def check_gated(w, want_w: torch.Tensor, device: str, dtype: torch.dtype,
                configs=(None,)) -> None:
    """The int8 GEMV with the gated activation applied on load: the product with
    ``act_and_mul_ref`` of the gate_up row (the activation kernel's roundings), rounded
    to int8 as ``gemv_i8`` rounds it, for each tile config (None: planned); through the
    backend too, which declines two rows."""
    from cvllm.kernels.quant import ggml_cuda as gc
    from cvllm.kernels.quant.cuda_backend import CudaBackend
    from cvllm.kernels.reference.linear import act_and_mul_ref

    k = w.shape[1]
    group = gp.i8_group(w.spec)
    for act in ("silu", "gelu_tanh"):
        gate_up = (torch.randn(1, 2 * k, device=device) * 2).to(dtype)
        x = act_and_mul_ref(gate_up, act)  # [1, K] in dtype
        for _ in range(8):  # the kernel computes x itself: move its up values off the ties
            ties = _ties(x, group)
            if not ties.any():
                break
            up = gate_up[:, k:]
            up[ties] = (up[ties].float() * (1 - 2.0 ** -6)).to(dtype)
            x = act_and_mul_ref(gate_up, act)
        assert not _ties(x, group).any()
        want = int8_rounded(x, group) @ want_w.double().T
        for cfg in configs:
            for prequant in (False, True):
                assert_close_rms(gc.linear(gate_up, w, act=act, config=cfg, prequant=prequant),
                                 want, I8_TOL)
        assert_close_rms(CudaBackend().linear_gated(gate_up, w, act), want, I8_TOL)
    assert CudaBackend().linear_gated(torch.randn(2, 2 * k, device=device).to(dtype), w,
                                         "silu") is None


MM_SWAPPED = [(3, (16, 64, 256, 4, 2, 8, 1, True)), (17, (32, 64, 256, 4, 2, 8, 2, True))]
"""(M, config) at N = 40, K = 512, bias on: unsplit and split K."""
MM_SWAPPED_MORE = [(64, (64, 32, 256, 4, 2, 8, 1, True)), (17, (32, 64, 128, 4, 2, 8, 4, True))]
SWAP_TYPES = (GgmlType.Q4_0, GgmlType.Q4_K, GgmlType.Q5_K, GgmlType.Q6_K, GgmlType.Q8_0,
              GgmlType.IQ4_XS, GgmlType.Q2_K)
"""The tensor-core kernel's transposed product (``ggml_kernels.ggml_mm_kernel``, ``SWAP``)
against the reference: split K and not for every type, more shapes for ``SWAP_TYPES`` (one
of each layout: 4-bit / 8-bit / 2-bit quants, 16- and 32-element sub-blocks, a high plane,
the IQ4 table). Few, small programs: the interpreter's time grows with the programs."""
HEAVY = (GgmlType.Q8_0, GgmlType.Q5_0, GgmlType.Q5_1, GgmlType.Q5_K, GgmlType.Q6_K)
"""The types whose 65-128-row tiles stay unswapped on Hopper (``ggml_plan.plan_mm``)."""


def check_type(t: GgmlType, device="cpu", dtype=torch.float16) -> None:
    """Every path of one type at small, ragged shapes (N not a multiple of the row block)."""
    from cvllm.kernels.quant import ggml_cuda as gc
    from cvllm.kernels.quant.cuda_backend import CudaBackend

    n, k = 40, 512
    raw = random_raw(t, n, k, device=device)
    want_w = oracle(raw, t)
    w = gc.prepare(raw, t)
    assert w.nbytes() <= 1.05 * raw.numel(), "the split layout exceeds 1.05x the blocks"
    torch.testing.assert_close(gc.dequantize(w, torch.float32), want_w, rtol=1e-6,
                               atol=1e-6 * want_w.abs().max().item())
    ids = torch.tensor([3, 0, n - 1, 3], device=device)
    torch.testing.assert_close(gc.embedding(w, ids, torch.float32), want_w[ids], rtol=1e-6,
                               atol=1e-6 * want_w.abs().max().item())
    common = dict(raw=raw, want_w=want_w, dtype=dtype, device=device)
    check_linear(t, n, k, 1, path="gemv", bias=True, **common)
    check_linear(t, n, k, 2, path="gemv", **common)
    check_linear(t, n, k, 1, path="gemv", config=(4, 256, 2, True), **common)  # 2 K steps
    check_linear(t, n, k, 3, path="mm", bias=True, **common)
    check_linear(t, n, k, 17, path="mm", config=(32, 32, 256, 4, 2, 8, 2), **common)
    check_linear(t, n, k, 5, path="dense", bias=True, **common)
    for m, cfg in MM_SWAPPED + (MM_SWAPPED_MORE if t in SWAP_TYPES else []):
        check_linear(t, n, k, m, path="mm", config=cfg, bias=(m, cfg) in MM_SWAPPED, **common)
    if gp.takes_int8_gemv(w.spec):  # the int8 GEMV: planned, 2 K steps (prefetched or not), masked
        check_linear(t, n, k, 1, path="gemv_i8", bias=True, **common)
        check_linear(t, n, k, 1, path="gemv_i8", config=(4, 256, 2, True), **common)
        check_linear(t, n, k, 1, path="gemv_i8", config=(16, 256, 4, False), **common)
        check_linear(t, n, k, 1, path="gemv_i8", config=(8, 1024, 4, False), **common)
        # K split over programs (the last to arrive adds the runs): 3 asked of 4 steps
        # is trimmed to 2 runs of 2; one step a run, prefetched runs of two
        check_linear(t, n, k, 1, path="gemv_i8", config=(4, 128, 2, False, 3), bias=True,
                     **common)
        check_linear(t, n, k, 1, path="gemv_i8", config=(8, 256, 4, False, 2), **common)
        w4, _ = check_linear(t, n, k, 1, path="gemv_i8", config=(16, 64, 4, True, 4), **common)
        assert not w4.sem.any()  # every count back at zero for the next call
        g = torch.Generator(device=device).manual_seed(k)  # seeded: a tolerance, not luck
        x = torch.randn(1, k, generator=g, device=device).to(dtype)
        x[0, 64:96] = 0  # a block of zeros (no scale) and a lone large value
        x[0, 7] = 300.0
        check_linear(t, n, k, 1, path="gemv_i8", x=x, **common)
        if device != "cpu" or dtype != torch.bfloat16:  # the interpreter truncates to bf16
            check_gated(w, want_w, device, dtype)
            # several K steps, the last one masked (768 = 3 x 256; 768 < 1024), prefetched
            raw3 = random_raw(t, 24, 768, device=device)
            check_gated(gc.prepare(raw3, t), oracle(raw3, t), device, dtype,
                        configs=((16, 256, 4, True), (8, 512, 4, False), (8, 1024, 4, False),
                                 (8, 512, 4, False, 2), (4, 256, 4, True, 2)))
        # An exact weight (an LM head) keeps the float path: the same bits as asking for it.
        w_exact = gc.prepare(raw, t, exact=True)
        x = torch.randn(1, k, generator=g, device=device).to(dtype)
        assert gp.choose_path(1, w_exact.spec, w_exact.exact) == "gemv"
        assert torch.equal(gc.linear(x, w_exact), gc.linear(x, w, path="gemv"))
        assert CudaBackend().linear_gated(torch.randn(1, 2 * k, device=device).to(dtype),
                                             w_exact, "silu") is None


def run_cpu_cases() -> None:
    """Entry point of the interpreter subprocess: every type, every path (inputs seeded:
    the interpreter's one-sided bf16 truncation leaves the tolerances little room)."""
    torch.manual_seed(0)
    for t in TYPES:
        check_type(t)
    check_type(GgmlType.Q4_K, dtype=torch.bfloat16)
    # K not a whole number of tiles: masked K steps in every kernel.
    raw = random_raw(GgmlType.Q6_K, 24, 768)
    for m, path, cfg in [(1, "gemv", (8, 512, 4, False)), (1, "gemv", (8, 512, 4, True)),
                         (9, "mm", (16, 16, 512, 4, 2, 8, 1)),
                         (9, "mm", (16, 16, 512, 4, 2, 8, 1, True)),
                         (9, "mm", (16, 32, 512, 4, 2, 8, 2, True))]:
        check_linear(GgmlType.Q6_K, 24, 768, m, path, cfg, raw=raw)
    # plan-driven dispatch and a 3-D input
    from cvllm.kernels.quant import ggml_cuda as gc

    w = gc.prepare(raw, GgmlType.Q6_K)
    x = torch.randn(2, 3, 768).half()
    want = x.double() @ oracle(raw, GgmlType.Q6_K).double().T
    assert_close_rms(gc.linear(x, w), want, 2e-2)


def test_kernels_interpreted_on_cpu():
    code = "from tests.kernels.test_ggml_cuda import run_cpu_cases; run_cpu_cases()"
    run_interpreted(code)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_split_layout_decodes_to_the_reference(t):
    """``ggml_pack.repack`` loses nothing: its plain-torch decoding equals the oracle."""
    from cvllm.kernels.quant import ggml_pack

    raw = random_raw(t, 6, 768, seed=int(t))
    fields = ggml_pack.repack(raw, t)
    torch.testing.assert_close(ggml_pack.unpack_ref(fields, t), oracle(raw, t), rtol=0, atol=0)
    assert sum(v.numel() * v.element_size() for v in fields.values()) <= 1.05 * raw.numel()


def test_supports_every_quantized_type():
    from cvllm.kernels.quant.ggml_cuda import supports

    assert all(supports(t) for t in QUANTIZED_TYPES)
    assert not supports(GgmlType.F16) and not supports(GgmlType.IQ2_XXS)


def test_wrappers_reject_bad_inputs():
    from cvllm.kernels.quant import ggml_cuda as gc

    raw = random_raw(GgmlType.Q4_K, 8, 256)
    with pytest.raises(ValueError, match="no GPU kernels"):
        gc.prepare(raw, GgmlType.IQ2_XXS)
    with pytest.raises(ValueError, match="uint8"):
        gc.prepare(raw[:, :100], GgmlType.Q4_K)
    with pytest.raises(ValueError, match="uint8"):
        gc.prepare(raw.to(torch.int8), GgmlType.Q4_K)
    w = gc.prepare(raw, GgmlType.Q4_K)
    x = torch.randn(2, 256).half()
    with pytest.raises(ValueError, match="disagree"):
        gc.linear(x[:, :128], w)
    with pytest.raises(ValueError, match="must be one of"):
        gc.linear(x.float(), w)
    with pytest.raises(ValueError, match="bias"):
        gc.linear(x, w, torch.zeros(7, dtype=torch.float16))
    with pytest.raises(ValueError, match="bias"):
        gc.linear(x, w, torch.zeros(8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="unknown path"):
        gc.linear(x, w, path="fast")
    with pytest.raises(ValueError, match="at most 16"):
        gc.linear(torch.randn(17, 256).half(), w, path="gemv")
    with pytest.raises(ValueError, match="one row of Q4_0"):
        gc.linear(x, w, path="gemv_i8")
    with pytest.raises(ValueError, match="one row of Q4_0"):
        gc.linear(x[:1], gc.prepare(random_raw(GgmlType.Q5_K, 8, 256), GgmlType.Q5_K),
                  path="gemv_i8")
    gate_up = torch.randn(2, 512).half()
    with pytest.raises(ValueError, match="gated input needs one row"):
        gc.linear(gate_up, w, act="silu")
    with pytest.raises(ValueError, match="gated input needs one row"):
        gc.linear(gate_up[:1], w, act="silu", path="gemv")
    with pytest.raises(ValueError, match="unsupported activation"):
        gc.linear(gate_up[:1], w, act="relu")
    with pytest.raises(ValueError, match="disagree"):
        gc.linear(x[:1], w, act="silu")
    for cfg, why in [((16, 64, 256, 4, 3, 8), "an mm config is"),
                     ((8, 64, 256, 4, 3, 8, 1), "BM=8 must be"),
                     ((16, 48, 256, 4, 3, 8, 1), "BN=48 must be"),
                     ((16, 64, 256, 4, 3, 8, 1, True, 0), "an mm config is"),
                     ((16, 64, 16, 4, 3, 8, 1), "sub-blocks"),
                     ((16, 64, 256, 3, 3, 8, 1), "num_warps=3"),
                     ((16, 64, 256, 4, 3, 8, 0), "SPLIT=0"),
                     ((16, 64, 256, 4, 0, 8, 1), "num_stages=0"),
                     ((16, 64, 256, 4, 3, 8, 1, "False"), "SWAP='False'")]:
        with pytest.raises(ValueError, match=why):
            gc.linear(x, w, path="mm", config=cfg)
    with pytest.raises(ValueError, match="field lo"):
        gc.linear(x, gc.CudaGgmlWeight(w.ggml_type, w.shape, w.lo[:, :8].contiguous(), w.d,
                                       dm=w.dm, sc=w.sc))
    with pytest.raises(ValueError, match="dtype"):
        gc.dequantize(w, torch.int32)
    with pytest.raises(ValueError, match="ids"):
        gc.embedding(w, torch.tensor([0.0]))
    with pytest.raises(ValueError, match="out of range"):
        gc.embedding(w, torch.tensor([8]))


def test_mm_launch_rewords_what_does_not_compile(monkeypatch):
    """A variant Triton's compiler refuses comes back as a ValueError naming the type and
    config (the sweep records it and goes on); other failures pass through as they are."""
    errors = pytest.importorskip("triton.runtime.errors")
    from cvllm.kernels.quant import ggml_cuda as gc
    from cvllm.kernels.quant import ggml_kernels as gk

    w = gc.prepare(random_raw(GgmlType.Q4_K, 8, 256), GgmlType.Q4_K)
    x = torch.randn(2, 256).half()

    class Failing:
        def __init__(self, exc):
            self.exc = exc

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise self.exc
            return launch

    monkeypatch.setattr(gk, "ggml_mm_kernel",
                        Failing(errors.OutOfResources(300000, 232448, "shared memory")))
    with pytest.raises(ValueError, match=r"cannot compile or launch for Q4_K .*1, True\)"):
        gc.linear(x, w, path="mm", config=(16, 64, 256, 4, 3, 8, 1, True))
    monkeypatch.setattr(gk, "ggml_mm_kernel", Failing(RuntimeError("device lost")))
    with pytest.raises(RuntimeError, match="device lost"):
        gc.linear(x, w, path="mm")


# ----- GPU: compiled, model-sized ---------------------------------------------------------------

gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
GPU_SHAPES = [(4096, 4096), (28672, 4096), (4096, 14336), (1000, 4352)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_every_path_gpu(t):
    """Every path of every type compiled, at small ragged shapes and one 8B shape with the
    planned tiles, bf16; dequantize and embedding exact."""
    check_type(t, device="cuda", dtype=torch.bfloat16)
    n, k = 4096, 4096
    raw = random_raw(t, n, k, device="cuda")
    want_w = oracle(raw, t)
    for m in (1, 2, 5, 17, 64, 100, 300, 1100):  # 5, 17 (and 100 but for HEAVY): swapped
        check_linear(t, n, k, m, raw=raw, want_w=want_w, dtype=torch.bfloat16, device="cuda",
                     bias=(m == 5))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("t,n,k", [(GgmlType.Q4_K, n, k) for n, k in GPU_SHAPES]
                         + [(GgmlType.Q4_K, 6144, 4096), (GgmlType.Q6_K, 1000, 4352),
                            (GgmlType.Q6_K, 33800, 4096), (GgmlType.Q8_0, 1000, 4352)],
                         ids=lambda v: v.name if isinstance(v, GgmlType) else str(v))
def test_8b_shapes_gpu(t, n, k):
    raw = random_raw(t, n, k, device="cuda")
    want_w = oracle(raw, t)
    for m in (1, 16, 64, 2048):
        check_linear(t, n, k, m, raw=raw, want_w=want_w, dtype=torch.bfloat16, device="cuda")
    if n <= 6144:  # both products on the planned tiles of 16, 32, 64 and 128 rows
        from cvllm.kernels.device import sms_of
        from cvllm.kernels.quant.ggml_pack import SPECS

        for m in (16, 32, 64, 128):
            for swap in (False, True):
                cfg = gp.plan_mm(m, n, k, SPECS[t], sms_of(raw))[:7] + (swap,)
                check_linear(t, n, k, m, "mm", cfg, raw=raw, want_w=want_w,
                             dtype=torch.bfloat16, device="cuda")
        check_linear(t, n, k, 17, raw=raw, want_w=want_w, dtype=torch.float16,
                     device="cuda")  # the planned (swapped) product with fp16 activations
    if t == GgmlType.Q4_K and k == 14336:  # the down projection, its activation fused
        from cvllm.kernels.quant import ggml_cuda as gc

        check_gated(gc.prepare(raw, t), want_w, "cuda", torch.bfloat16)


@pytest.mark.gpu
@gpu
def test_gemv_is_deterministic_and_graph_safe():
    """Same inputs, same bits, in eager mode and replayed from a CUDA graph (PDL on)."""
    from cvllm.kernels.quant import ggml_cuda as gc

    raw = random_raw(GgmlType.Q4_K, 4096, 4096, device="cuda")
    w = gc.prepare(raw, GgmlType.Q4_K)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    for cfg in (None, (16, 1024, 4, False, 4), (8, 2048, 4, False, 2)):  # planned; K split
        first = gc.linear(x, w, config=cfg)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = gc.linear(x, w, config=cfg)
        for _ in range(3):  # a split call leaves its counts at zero for the next replay
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(first, out) and not w.sem.any()
        assert torch.equal(first, gc.linear(x, w, config=cfg))
    # the split products add the same float32 partials as one program would, in order:
    # equal to the unsplit product within float32 summation order
    whole = gc.linear(x, w, config=(16, 1024, 4, False, 1)).float()
    torch.testing.assert_close(gc.linear(x, w, config=(16, 1024, 4, False, 4)).float(), whole,
                               rtol=1e-2, atol=1e-2 * whole.abs().max().item())
