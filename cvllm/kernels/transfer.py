"""Host -> device copies on the step path, staged through pinned memory, and the
on-device patch of the ids a step takes from the step before (``patch_ids_``).

Used by the sampler, the attention metadata and the model runner on every rank, every
step. A copy from pageable host memory is not asynchronous even with ``non_blocking``:
CUDA synchronizes the stream before it starts (the documented behaviour of pageable
``cudaMemcpyAsync``), so a sampler that copied its per-row values from plain tensors
waited for the forward it was queued behind, and the overlapped engine loop lost its
overlap. Staged through PyTorch's caching host allocator (``pin_memory()``: a block is
reused only once the copy that read it has completed), the copy is queued and the host
goes on.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import triton
import triton.language as tl


def to_device(array: np.ndarray, device: torch.device | str,
              dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``array`` on ``device`` (as ``dtype``), queued without a host sync on CUDA."""
    t = torch.from_numpy(np.ascontiguousarray(array))
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    dev = torch.device(device)
    if dev.type != "cuda":
        return t if dev.type == "cpu" else t.to(dev)
    return t.pin_memory().to(dev, non_blocking=True)


@triton.jit
def _patch_ids_kernel(ids_ptr, rows_ptr, prev_ptr, T, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rows = tl.load(rows_ptr + offs, mask=offs < T, other=-1)
    take = rows >= 0
    ids = tl.load(prev_ptr + tl.maximum(rows, 0), mask=take)
    tl.store(ids_ptr + offs, ids, mask=take)


def patch_ids_(input_ids: torch.Tensor, prev_rows: torch.Tensor,
               prev_sampled: torch.Tensor) -> torch.Tensor:
    """``input_ids[i] = prev_sampled[prev_rows[i]]`` wherever ``prev_rows[i] >= 0``, in
    place (all ``[T]`` int64, one CUDA device; the caller has checked that every row is
    below ``prev_sampled``'s length): one launch where the torch form
    (``worker/cuda_graph.patch_placeholders`` and a copy back) takes four."""
    T = input_ids.shape[0]
    contiguous = input_ids.is_contiguous() and prev_rows.is_contiguous()
    if prev_rows.shape != input_ids.shape or not contiguous:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and prev_rows "
                         f"{tuple(prev_rows.shape)} must match, both contiguous")
    prev_sampled = prev_sampled.contiguous()
    if T:
        block = min(1024, triton.next_power_of_2(T))
        _patch_ids_kernel[(triton.cdiv(T, block),)](input_ids, prev_rows, prev_sampled, T,
                                                    BLOCK=block, num_warps=4)
    return input_ids
