"""Fused mixture-of-experts: a grouped GEMM over token blocks sorted by expert (Triton).

Called by ``quantization/unquantized.UnquantizedMoEMethod`` on CUDA;
``kernels/reference/fused_moe.fused_moe_ref`` is the plain-torch version and the test
oracle (tests/kernels/test_fused_moe.py, also run on the CPU under
``TRITON_INTERPRET=1``). Nothing here keeps state between calls.

The design follows vLLM's fused_moe, written independently:

1. ``moe_align_block_size`` sorts the ``T*K`` (token, slot) pairs by expert and pads each
   expert's run to a multiple of ``BLOCK_M``, so every block of ``BLOCK_M`` sorted rows
   belongs to exactly one expert (``expert_ids[block]``). It runs as torch ops on the
   device with no host synchronisation: buffers have their worst-case size and blocks past
   ``num_tokens_post_padded`` exit at once.
2. Kernel 1 (``ACTIVATION`` silu/gelu): each program multiplies its block of gathered
   hidden rows by one expert's gate and up tiles and writes ``act(gate) * up``
   ``[T*K, I]`` -- the ``[T*K, 2I]`` projection never reaches memory.
3. Kernel 2: the intermediate rows times the expert's ``w2``, scaled by the routing
   weight, into a float32 ``[T*K, H]`` buffer that is summed over the K slots.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import triton
import triton.language as tl

_ACTIVATIONS = {"none": 0, "silu": 1, "gelu": 2}
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _fused_moe_kernel(
    a_ptr, b_ptr, c_ptr, topk_weights_ptr,
    sorted_token_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr,
    N, K, num_valid_tokens, up_offset,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    TOP_K: tl.constexpr, ACTIVATION: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
    IEEE_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """C[pair, n] = A[pair // TOP_K] . B[e, n] (with ACTIVATION: act(A.B[e, n]) * A.B[e,
    up_offset + n]) for the BLOCK_M sorted pairs of this program, all routed to expert e."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_token_ids_ptr + offs_m).to(tl.int64)  # [BLOCK_M]
    valid = pair < num_valid_tokens
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    a_rows = a_ptr + (pair // TOP_K)[:, None] * stride_am
    b_cols = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_rows + offs_k[None, :] * stride_ak,
                    mask=valid[:, None] & (offs_k[None, :] < K), other=0.0)
        b_mask = (offs_k[:, None] < K) & (offs_n[None, :] < N)
        b = tl.load(b_cols + offs_k[:, None] * stride_bk, mask=b_mask, other=0.0)
        if IEEE_F32:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
        if ACTIVATION != 0:
            b_up = tl.load(b_cols + up_offset * stride_bn + offs_k[:, None] * stride_bk,
                           mask=b_mask, other=0.0)
            if IEEE_F32:
                acc_up += tl.dot(a, b_up, input_precision="ieee")
            else:
                acc_up += tl.dot(a, b_up)
    if ACTIVATION == 1:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    elif ACTIVATION == 2:
        acc = 0.5 * acc * (1.0 + tl.erf(acc * 0.7071067811865476)) * acc_up
    if MUL_ROUTED_WEIGHT:
        w = tl.load(topk_weights_ptr + pair, mask=valid, other=0.0).to(tl.float32)
        acc = acc * w[:, None]
    c_ptrs = c_ptr + pair[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


def moe_align_block_size(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the ``T*K`` pairs by expert, each expert's run padded to a multiple of ``block_m``.

    Returns ``sorted_token_ids [max_padded]`` int32 (flat pair ids; padding = ``T*K``),
    ``expert_ids [max_blocks]`` int32 (expert of each block; ``num_experts`` past the end)
    and ``num_tokens_post_padded [1]`` int32. Sizes are worst-case so nothing syncs."""
    flat = topk_ids.reshape(-1).to(torch.int64)  # [T*K]
    num_pairs = flat.numel()
    # scatter_add_, not bincount: CUDA bincount reads the max id back to the host.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E]
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_end = torch.cumsum(padded, 0)  # [E]
    order = torch.argsort(flat, stable=True)  # [T*K]
    sorted_experts = flat[order]  # [T*K]
    # Rank of each sorted pair inside its expert's run, then its padded position.
    run_start = torch.cumsum(counts, 0) - counts  # [E]
    rank = torch.arange(num_pairs, device=flat.device) - run_start[sorted_experts]
    dest = (padded_end - padded)[sorted_experts] + rank  # [T*K]
    max_padded = num_pairs + num_experts * (block_m - 1)
    sorted_token_ids = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_token_ids[dest] = order.to(torch.int32)
    max_blocks = triton.cdiv(max_padded, block_m)
    block_start = torch.arange(max_blocks, device=flat.device) * block_m  # [max_blocks]
    expert_ids = torch.searchsorted(padded_end, block_start, right=True).to(torch.int32)
    return sorted_token_ids, expert_ids, padded_end[-1:].to(torch.int32)


def default_config(num_pairs: int) -> Dict[str, int]:
    """Block sizes: small BLOCK_M for decode-sized batches, where most blocks are padding."""
    block_m = 16 if num_pairs <= 64 else 64
    return {"BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": 32}


def _check_inputs(hidden, w13, w2, topk_weights, topk_ids, activation) -> None:
    """Shapes, dtypes, devices and strides the kernels rely on; raises ValueError."""
    if activation not in ("silu", "gelu"):
        raise ValueError(f"unsupported MoE activation {activation!r}")
    if hidden.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"expected hidden [T, H], w13 [E, 2I, H], w2 [E, H, I]; got "
                         f"{tuple(hidden.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}")
    (num_tokens, hidden_size), (num_experts, two_inter, _) = hidden.shape, w13.shape
    if w13.shape[2] != hidden_size or two_inter % 2 or tuple(w2.shape) != (
        num_experts, hidden_size, two_inter // 2
    ):
        raise ValueError(f"expert weights w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not "
                         f"fit hidden size {hidden_size}")
    if (topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens
            or topk_weights.shape != topk_ids.shape):
        raise ValueError(f"routing must be [T={num_tokens}, K]; got ids {tuple(topk_ids.shape)}, "
                         f"weights {tuple(topk_weights.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64) or not topk_weights.is_floating_point():
        raise ValueError(f"topk_ids must be int32/int64 and topk_weights float; got "
                         f"{topk_ids.dtype}, {topk_weights.dtype}")
    if hidden.dtype not in _DTYPES or w13.dtype != hidden.dtype or w2.dtype != hidden.dtype:
        raise ValueError(f"hidden/w13/w2 must share one of {_DTYPES}; got "
                         f"{hidden.dtype}, {w13.dtype}, {w2.dtype}")
    devices = {t.device for t in (hidden, w13, w2, topk_weights, topk_ids)}
    if len(devices) != 1:
        raise ValueError(f"all MoE inputs must be on one device; got {devices}")
    # The kernels take any strides for hidden/w13/w2; the routing tensors are read flat.
    if not (topk_ids.is_contiguous() and topk_weights.is_contiguous()):
        raise ValueError("topk_ids and topk_weights must be contiguous")


def _launch(a, b, c, topk_weights, align, num_valid, top_k, activation, mul_weight, config):
    sorted_token_ids, expert_ids, num_post_padded = align
    n_out = c.shape[1]
    up_offset = b.shape[1] // 2 if activation != "none" else 0
    grid = (expert_ids.numel(), triton.cdiv(n_out, config["BLOCK_N"]))
    _fused_moe_kernel[grid](
        a, b, c, topk_weights, sorted_token_ids, expert_ids, num_post_padded,
        n_out, a.shape[1], num_valid, up_offset,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        TOP_K=top_k, ACTIVATION=_ACTIVATIONS[activation], MUL_ROUTED_WEIGHT=mul_weight,
        IEEE_F32=a.dtype == torch.float32,
        BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"],
    )


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    config: Optional[Dict[str, int]] = None,
) -> torch.Tensor:
    """``hidden [T, H]``, ``w13 [E, 2I, H]``, ``w2 [E, H, I]``, routing ``[T, K]`` -> ``[T, H]``
    in ``hidden``'s dtype; same contract as ``reference.fused_moe_ref``."""
    _check_inputs(hidden, w13, w2, topk_weights, topk_ids, activation)
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return hidden.new_zeros(hidden.shape)
    config = config or default_config(num_pairs)
    align = moe_align_block_size(topk_ids, config["BLOCK_M"], w13.shape[0])
    weights = topk_weights.to(torch.float32).reshape(-1)  # [T*K]
    inter = hidden.new_empty(num_pairs, w2.shape[2])  # [T*K, I]
    _launch(hidden, w13, inter, weights, align, num_pairs, top_k, activation, False, config)
    out = torch.empty(num_pairs, w2.shape[1], dtype=torch.float32, device=hidden.device)  # [T*K, H]
    _launch(inter, w2, out, weights, align, num_pairs, 1, "none", True, config)
    return out.view(num_tokens, top_k, -1).sum(dim=1).to(hidden.dtype)  # [T, H]
