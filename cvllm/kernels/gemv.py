"""Batch-1 matrix-vector product ``y = x @ W^T (+ b)`` streaming the weight once (Triton).

Called by ``quantization/unquantized.UnquantizedLinearMethod`` (``apply``, and
``apply_fused`` for the fusions below) and the LM head for a single CUDA row in a 16-bit
dtype (batch-1 decode); ``kernels/reference/linear.gemv_ref`` is the plain-torch version and the
test oracle (tests/kernels/test_gemv.py, also run on the CPU under
``TRITON_INTERPRET=1``). Nothing here keeps state between calls.

Why not cuBLAS: at one row the product is a pure weight stream, and the library's kernels
for the decoder's shapes leave bandwidth unused; those for ``o_proj`` (4096x4096) and
``down`` (4096x14336) also split K and add a second reduce kernel. On an H100
(``tools/bench_kernels.py``, docs/benchmarks/kernels-h100.json, weights read from HBM):
cuBLAS 2392 / 2001 / 2789 / 2574 / 2816 GB/s for qkv / o_proj / gate_up / down / lm_head,
this kernel 2720 / 2573 / 3015 / 2847 / 3145 GB/s (copy: 2956 GB/s). Here one program owns
``BLOCK_N`` whole output rows: it walks K in ``BLOCK_K`` steps, keeps a
``[BLOCK_N, BLOCK_K]`` float32 partial sum in registers and reduces it once at the end,
so there is no second kernel and no cross-program traffic; ``BLOCK_N`` is picked so the
grid covers the SMs several times over (``plan``). The weight loads are marked
evict-first: every byte is used once, and the vector ``x`` (re-read by every program)
stays in L2. On Hopper the kernel is launched with programmatic dependent launch
(``kernels/pdl.py``): its first weight tile is in flight before the kernel that writes
``x`` has finished.

Two epilogue/prologue fusions serve the decoder's MLP and tensor parallelism. ``act``:
the input is a ``[gate | up]`` row and each program computes ``act(gate) * up`` as it
loads it (``kernels/activation.py``'s roundings, so the result is the two-kernel one bit
for bit), saving the activation kernel. ``push``: the output rows go into the custom
all-reduce's buffers on every rank (``kernels/allreduce.PushTarget``) instead of to
memory, so a row-parallel layer's partial sums travel as each program finishes.

Numerics: float32 accumulation of the 16-bit products, one rounding to the output dtype
(cuBLAS does the same, in a different summation order), so results equal ``F.linear`` up
to float32 summation order.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from cvllm.kernels import pdl
from cvllm.kernels.activation import ACTIVATIONS, activate
from cvllm.kernels.allreduce import PushTarget, push_slot
from cvllm.kernels.device import sms_of
from cvllm.kernels.pdl import gdc_launch_dependents, gdc_wait

_DTYPES = (torch.float16, torch.bfloat16)
_TILE = 8192
"""Weight elements one program loads per K step."""
_SMALL_BYTES = 64 << 20
"""Weights smaller than this take narrower K steps (more programs in flight)."""
MAX_K = 1 << 20
"""Longest row this kernel takes (a sanity bound: the grid is over N, K is looped)."""


@triton.jit
def _load_w(w_ptrs, k0, offs_k, nmask, K, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    """The ``[BLOCK_N, BLOCK_K]`` weight tile at K offset ``k0`` (read once: evict first)."""
    if EVEN_K:
        if EVEN_N:
            w = tl.load(w_ptrs, eviction_policy="evict_first")
        else:
            w = tl.load(w_ptrs, mask=nmask[:, None], other=0.0, eviction_policy="evict_first")
    else:
        kmask = (k0 + offs_k) < K
        w = tl.load(w_ptrs, mask=nmask[:, None] & kmask[None, :], other=0.0,
                    eviction_policy="evict_first")
    return w


@triton.jit
def _load_x(x_ptr, k0, offs_k, K, EVEN_K: tl.constexpr):
    """``x[k0 : k0 + BLOCK_K]`` as float32 (every program reads it: keep it in L2)."""
    if EVEN_K:
        x = tl.load(x_ptr + k0 + offs_k, eviction_policy="evict_last")
    else:
        x = tl.load(x_ptr + k0 + offs_k, mask=(k0 + offs_k) < K, other=0.0,
                    eviction_policy="evict_last")
    return x.to(tl.float32)


@triton.jit
def load_act_x(x_ptr, k0, offs_k, K, EVEN_K: tl.constexpr, ACT: tl.constexpr):
    """``act(gate) * up`` at ``k0 ..`` from a ``[gate (K) | up (K)]`` row, with
    ``kernels/activation.py``'s roundings (ACT: its activation code + 1; 0: plain x)."""
    if ACT == 0:
        return _load_x(x_ptr, k0, offs_k, K, EVEN_K)
    if EVEN_K:
        gate = tl.load(x_ptr + k0 + offs_k, eviction_policy="evict_last")
    else:
        gate = tl.load(x_ptr + k0 + offs_k, mask=(k0 + offs_k) < K, other=0.0,
                       eviction_policy="evict_last")
    up = _load_x(x_ptr + K, k0, offs_k, K, EVEN_K)
    act = activate(gate.to(tl.float32), ACT - 1)
    return (act.to(gate.dtype).to(tl.float32) * up).to(gate.dtype).to(tl.float32)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_wn,
    state_ptr, slot_elems, b0, b1, b2, b3, b4, b5, b6, b7,
    HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ACT: tl.constexpr,
    PUSH: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr, SENT: tl.constexpr,
    PDL: tl.constexpr,
):
    """Rows ``pid * BLOCK_N ..`` of ``y = W @ x (+ b)``; ``W [N, K]`` row-major. With PDL
    the first weight tile is loaded before waiting for the kernel that writes x, and
    the kernel after this one may launch once every program has passed that wait. ACT:
    x is a gate_up row, see ``load_act_x``. PUSH: the rows go to the custom
    all-reduce's buffers (``kernels/allreduce.push_slot``), not to ``y``."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    nmask = offs_n < N
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    w = _load_w(w_ptrs, 0, offs_k, nmask, K, EVEN_N, EVEN_K)
    if PDL:
        gdc_wait()  # x (and y's memory) belong to earlier kernels from here on
        gdc_launch_dependents()  # only now: see kernels/allreduce.py (pushed calls)
    acc = w.to(tl.float32) * load_act_x(x_ptr, 0, offs_k, K, EVEN_K, ACT)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w_ptrs += BLOCK_K
        w = _load_w(w_ptrs, k0, offs_k, nmask, K, EVEN_N, EVEN_K)
        acc += w.to(tl.float32) * load_act_x(x_ptr, k0, offs_k, K, EVEN_K, ACT)[None, :]
    y = tl.sum(acc, axis=1)  # [BLOCK_N]
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)
    y = y.to(y_ptr.dtype.element_ty)
    if PUSH:
        push_slot(y, offs_n, nmask, tl.load(state_ptr), slot_elems,
                  b0, b1, b2, b3, b4, b5, b6, b7, RANK, WORLD, SENT)
    else:
        tl.store(y_ptr + offs_n, y, mask=nmask)


def plan(n: int, k: int, num_sms: int) -> Tuple[int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps)`` for an ``[n, k]`` weight: 8192-element (16 KiB)
    weight tiles with 4 warps, as wide along K as the row allows: up to 2048 (the best
    config for every 8B decoder shape and its TP halves in the H100 sweep,
    docs/benchmarks/kernels-h100.json), but 1024 for weights under ``_SMALL_BYTES``
    (the tensor-parallel halves of qkv / o_proj / down: 2-10% faster on an H200,
    docs/benchmarks/kernels-h200.json, within 2% of the best on the H100). The row
    block halves (down to one row) while the grid would leave SMs idle. Fixed by shape
    alone, so every call with one shape sums in the same order (outputs do not depend on
    timing or the CUDA graph)."""
    widest = 1024 if n * k * 2 < _SMALL_BYTES else 2048
    block_k = max(64, min(triton.next_power_of_2(k), widest))
    block_n = max(1, min(16, _TILE // block_k))
    while block_n > 1 and triton.cdiv(n, block_n) < num_sms:
        block_n //= 2
    return block_n, block_k, 4


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
         config: Optional[Tuple[int, int, int]] = None, act: Optional[str] = None,
         push: Optional[PushTarget] = None) -> torch.Tensor:
    """``x [.., K]`` holding one row, ``weight [N, K]`` -> ``[.., N]`` in x's dtype; the
    contract of ``reference.gemv_ref`` (``F.linear``). ``config`` overrides ``plan``
    (``(BLOCK_N, BLOCK_K, num_warps)``; the benchmark's sweep).

    ``act`` (a key of ``kernels/activation.ACTIVATIONS``): ``x [.., 2K]`` is a gate_up
    row and the product is taken with ``act_and_mul(x, act)``, computed on the fly (one
    kernel instead of two). ``push``: the rows are pushed for the next custom
    all-reduce call on this stream, which must be ``lamport_all_reduce(y, ...,
    pushed=True)``; the returned ``y`` is then not written (it only has the shape)."""
    if act is not None and act not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {act!r}; supported: {list(ACTIVATIONS)}")
    width = 2 * weight.shape[1] if act is not None and weight.dim() == 2 else weight.shape[-1]
    if weight.dim() != 2 or x.shape[-1] != width:
        raise ValueError(f"x [.., {'2K' if act else 'K'}] and weight [N, K] disagree: "
                         f"{tuple(x.shape)}, {tuple(weight.shape)}")
    if x.numel() != width:
        raise ValueError(f"gemv takes one row; x has {x.numel() // max(x.shape[-1], 1)}")
    if push is not None:
        if bias is not None or weight.shape[0] * x.element_size() > push.slot_bytes:
            raise ValueError("a pushed GEMV takes no bias and must fit the all-reduce slot")
        if (len(push.bufs) != push.world or not 0 <= push.rank < push.world
                or any(b.device != x.device or b.element_size() != x.element_size()
                       for b in push.bufs)
                or push.state.device != x.device or push.state.dtype != torch.int32):
            raise ValueError("the push target needs one buffer per rank of x's element "
                             "size, on x's device, an int32 state there and a rank in range")
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share a dtype in {_DTYPES}; got {x.dtype}, "
                         f"{weight.dtype}")
    if weight.stride(1) != 1:
        raise ValueError("weight rows must be contiguous")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be [{weight.shape[0]}] {x.dtype}; got "
                         f"{tuple(bias.shape)} {bias.dtype}")
    if not (x.device == weight.device and (bias is None or bias.device == x.device)):
        raise ValueError("x, weight and bias must be on one device")
    n, k = weight.shape
    if k > MAX_K:
        raise ValueError(f"K={k} exceeds {MAX_K}")
    xv = x.reshape(width)
    if xv.stride(0) != 1:
        xv = xv.contiguous()
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()  # the kernel reads it with unit stride
    y = torch.empty(x.shape[:-1] + (n,), dtype=x.dtype, device=x.device)  # [.., N]
    if n == 0:
        return y
    if config is None:
        sms = sms_of(x)
        config = plan(n, k, sms)
    block_n, block_k, warps = config
    use_pdl = pdl.enabled(x)
    if push is not None:
        push_args, push_const = push.kernel_args(x.element_size())
    else:
        push_args, push_const = [y, 0] + [y] * 8, dict(RANK=0, WORLD=1, SENT=0)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        xv, weight, bias if bias is not None else xv, y, n, k, weight.stride(0), *push_args,
        HAS_BIAS=bias is not None, EVEN_N=n % block_n == 0, EVEN_K=k % block_k == 0,
        BLOCK_N=block_n, BLOCK_K=block_k, ACT=0 if act is None else ACTIVATIONS[act] + 1,
        PUSH=push is not None, PDL=use_pdl, num_warps=warps, **push_const,
        **pdl.launch_args(x),
    )
    return y


def use_gemv(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> bool:
    """Whether a linear layer should call ``gemv``: one CUDA row, a 16-bit weight of the
    same dtype with contiguous rows, and a weight large enough for the stream to matter
    (smaller ones stay with cuBLAS). ``gated``: x is a gate_up row (``act``)."""
    return (x.is_cuda and x.dtype in _DTYPES and weight.dtype == x.dtype
            and x.numel() == x.shape[-1] and weight.dim() == 2
            and weight.shape[1] * (2 if gated else 1) == x.shape[-1]
            and weight.stride(1) == 1
            and weight.numel() >= (1 << 20) and weight.shape[1] <= MAX_K)
