"""Host-side input checks of the paged-attention wrappers (and ``kernels/rotary``'s fused
write): shapes, dtypes, unit inner strides and one device, checked before a launch and
without a device sync; ValueError naming the input otherwise."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from cvllm.kernels.paged_attention.common import (
    CACHE_DTYPES, FLOAT_DTYPES, FP8_DTYPE, INDEX_DTYPES,
)


def check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} / v_cache {tuple(v_cache.shape)} "
                         "must both be [N, bs, Hkv, D]")
    check_dtypes(k_cache=(k_cache, CACHE_DTYPES), v_cache=(v_cache, CACHE_DTYPES))
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache {k_cache.dtype} and v_cache {v_cache.dtype} differ in dtype")
    check_inner_contiguous(k_cache=k_cache, v_cache=v_cache)


def scale_args(k_cache: torch.Tensor, k_scale: Optional[torch.Tensor],
                v_scale: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, bool]:
    """``(k_scale, v_scale, fp8)`` kernel arguments: an FP8 cache needs both scales as
    one float32 each on its device; other caches take none (the cache itself stands in
    for the pointers, which the kernels then never read)."""
    fp8 = k_cache.dtype == FP8_DTYPE
    if not fp8:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale / v_scale are for FP8 caches, not {k_cache.dtype}")
        return k_cache, k_cache, False
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t is None or t.numel() != 1 or t.dtype != torch.float32:
            raise ValueError(f"an FP8 cache needs {name} as one float32 element, got "
                             f"{None if t is None else (tuple(t.shape), t.dtype)}")
    check_same_device(k_cache, k_scale, v_scale)
    return k_scale, v_scale, True


def check_attention(q, k_cache, v_cache, block_tables, seq_lens, batch: int) -> None:
    """What decode and prefill share: q / cache shapes and GQA, table and length shapes,
    dtypes, unit stride along D, one device."""
    check_caches(k_cache, v_cache)
    if q.dim() != 3 or q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} must be [T, H, D] with H a multiple of the "
                         f"cache's Hkv and D its head dim; cache {tuple(k_cache.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables {tuple(block_tables.shape)} must be [B={batch}, M]")
    if seq_lens.dim() != 1 or seq_lens.shape[0] != batch:
        raise ValueError(f"seq_lens {tuple(seq_lens.shape)} must be [B={batch}]")
    check_dtypes(q=(q, FLOAT_DTYPES), block_tables=(block_tables, INDEX_DTYPES),
                  seq_lens=(seq_lens, INDEX_DTYPES))
    check_inner_contiguous(q=q)
    if block_tables.shape[1] and block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")
    if not seq_lens.is_contiguous():
        raise ValueError("seq_lens must be contiguous")
    check_same_device(q, k_cache, v_cache, block_tables, seq_lens)


def check_out(q: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must match q "
                         f"{tuple(q.shape)} {q.dtype}")
    check_inner_contiguous(out=out)
    check_same_device(q, out)
    return out


def check_dtypes(**named) -> None:
    for name, (t, allowed) in named.items():
        if t.dtype not in allowed:
            raise ValueError(f"{name} has dtype {t.dtype}; expected one of {allowed}")


def check_inner_contiguous(**named) -> None:
    """The kernels take any outer strides but index the last dim with unit stride."""
    for name, t in named.items():
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride along its last dim")


def check_same_device(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all paged-attention inputs must be on one device; got {devices}")
