"""The fused-MoE Triton kernel against its torch reference.

On the CPU the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``, set before
triton is imported, in a subprocess so other tests' triton state is untouched); on a CUDA
machine the same cases also run compiled. Shapes are small and odd on purpose: tails in
every block dimension, experts with no tokens, a token count of 1 (decode).
"""

from __future__ import annotations

import pytest
import torch

from cvllm.kernels.reference.fused_moe import fused_moe_ref
from cvllm.layers.moe import select_experts
from tests.interpreted import run_interpreted

# (tokens, hidden, intermediate, experts, top_k, activation)
CASES = [(1, 32, 16, 8, 2, "silu"), (7, 48, 40, 8, 2, "silu"), (19, 32, 24, 6, 3, "gelu")]
CONFIG = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}


def _inputs(case, device="cpu", dtype=torch.float32, seed=0):
    tokens, hidden, inter, experts, top_k, _ = case
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    logits = torch.randn(tokens, experts, generator=g)
    logits[:, 0] = -1e4  # expert 0 receives no tokens
    weights, ids = select_experts(logits, top_k, renormalize=True)
    to = dict(device=device)
    return (x.to(dtype=dtype, **to), w13.to(dtype=dtype, **to), w2.to(dtype=dtype, **to),
            weights.to(**to), ids.to(**to))


def _check_case(case, device="cpu", dtype=torch.float32, atol=1e-4):
    from cvllm.kernels.fused_moe import fused_moe

    args = _inputs(case, device, dtype)
    want = fused_moe_ref(*[a.float().cpu() if a.is_floating_point() else a.cpu() for a in args],
                         activation=case[-1])
    got = fused_moe(*args, activation=case[-1], config=CONFIG if device == "cpu" else None)
    assert got.shape == want.shape and got.dtype == dtype
    err = (got.float().cpu() - want).abs().max().item()
    assert err <= atol, f"{case}: max error {err:.2e}"


def test_reference_matches_per_token_loop():
    x, w13, w2, weights, ids = _inputs(CASES[1])
    inter = w13.shape[1] // 2
    want = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            gate_up = w13[ids[t, k]] @ x[t]
            act = torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]
            want[t] += weights[t, k] * (w2[ids[t, k]] @ act)
    torch.testing.assert_close(fused_moe_ref(x, w13, w2, weights, ids), want, atol=1e-5, rtol=1e-5)


def test_align_block_size_groups_pairs_by_expert():
    from cvllm.kernels.fused_moe import moe_align_block_size

    ids = torch.tensor([[3, 1], [1, 0], [3, 3]])
    sorted_ids, expert_ids, num_post = moe_align_block_size(ids, 4, 5)
    n = int(num_post)
    assert n == 12  # experts 0, 1, 3 each padded to one block of 4
    pairs = sorted_ids[:n].view(-1, 4)
    flat = ids.reshape(-1)
    for block, expert in zip(pairs, expert_ids[: n // 4].tolist()):
        real = block[block < flat.numel()]
        assert real.numel() > 0 and (flat[real.long()] == expert).all()
    assert sorted(sorted_ids[sorted_ids < 6].tolist()) == list(range(6))


def test_wrapper_rejects_bad_inputs():
    from cvllm.kernels.fused_moe import fused_moe

    x, w13, w2, weights, ids = _inputs(CASES[0])
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe(x, w13[:, :-1], w2, weights, ids)
    with pytest.raises(ValueError, match="share one of"):
        fused_moe(x.double(), w13, w2, weights, ids)
    with pytest.raises(ValueError, match="routing"):
        fused_moe(x, w13, w2, weights[:, :1], ids)


@pytest.mark.parametrize("case", CASES)
def test_kernel_interpreted_on_cpu(case):
    """Runs the Triton kernel on the CPU under the interpreter, in a fresh interpreter
    process (TRITON_INTERPRET must be set before triton compiles anything)."""
    code = (f"from tests.kernels.test_fused_moe import _check_case; _check_case({case!r})")
    run_interpreted(code, timeout=120, tail=3000)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 6e-2)])
@pytest.mark.parametrize("case", CASES + [(300, 256, 512, 16, 4, "silu")])
def test_kernel_cuda(case, dtype, atol):
    _check_case(case, "cuda", dtype, atol)
