"""Small helpers shared by the layers and model files (no state).

Checkpoint tensors reach the ``weight_loader``s either as ``torch.Tensor``s or as lazy
tensors (``loader/lazy.py``'s ``LazyTensor``: ``shape``, ``dtype``, ``dim()``,
``narrow()``, ``materialize()``). Loaders ``narrow`` to this rank's slice first and read
it through ``copy_checked`` / ``as_tensor`` last, so a rank reads only its shard. The
layers know lazy tensors only by that duck type: they never import the loader.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from cvllm.quantization.packed import PackedView

TORCH_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def torch_dtype(name: str) -> torch.dtype:
    """``ModelConfig.dtype`` (bf16 / f16 / f32) as a torch dtype."""
    if name not in TORCH_DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(TORCH_DTYPES)}")
    return TORCH_DTYPES[name]


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def as_tensor(x) -> torch.Tensor:
    """A checkpoint tensor as a ``torch.Tensor``: a lazy one is read now (narrow it first)."""
    return x if isinstance(x, torch.Tensor) else x.materialize()


def copy_checked(dst, src) -> None:
    """Copy a (sliced, maybe lazy) checkpoint tensor into a parameter (slice), converting
    dtype/device. The shape is checked before a lazy ``src`` is read. ``dst`` may be a
    ``quantization.packed.PackedView`` (a window of a quantized weight), which keeps a
    GGUF tensor's blocks or quantizes ``src``."""
    if isinstance(dst, PackedView):
        dst.load(src)
        return
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(
            f"shape mismatch: checkpoint tensor {tuple(src.shape)} vs parameter {tuple(dst.shape)}"
        )
    dst.copy_(as_tensor(src))


def split_sizes(x, sizes, dim: int):
    """``x.split(sizes, dim)`` through ``narrow`` (which lazy tensors support)."""
    if sum(sizes) != x.shape[dim]:
        raise ValueError(f"shape mismatch: cannot split {x.shape[dim]} rows of dim {dim} "
                         f"into {list(sizes)}")
    parts, start = [], 0
    for size in sizes:
        parts.append(x.narrow(dim, start, size))
        start += size
    return parts


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Loader of an unsharded parameter (norm weights, replicated tensors)."""
    copy_checked(param.data, loaded_weight)


def balanced_range(total: int, parts: int, index: int) -> Tuple[int, int]:
    """``(start, count)`` of part ``index`` when ``total`` items split into ``parts``
    contiguous, balanced ranges ``[index * total // parts, (index + 1) * total // parts)``
    (9 over 2: (0, 4), (4, 5)); an exact split when ``parts`` divides ``total``."""
    if not 0 <= index < parts:
        raise ValueError(f"part {index} out of range for {parts} parts")
    start = index * total // parts
    return start, (index + 1) * total // parts - start


def consecutive_runs(ids: Sequence[Optional[int]]) -> List[Tuple[int, int, int]]:
    """``ids`` (a global index per local slot; ``None``: a padding slot) as runs
    ``(local first, global first, count)`` of consecutive global indices, so a loader
    copies each run with one narrow. Padding slots belong to no run."""
    runs: List[Tuple[int, int, int]] = []
    for local, gid in enumerate(ids):
        if gid is None:
            continue
        if runs and runs[-1][0] + runs[-1][2] == local and runs[-1][1] + runs[-1][2] == gid:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((local, gid, 1))
    return runs
