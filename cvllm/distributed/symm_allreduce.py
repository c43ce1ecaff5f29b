"""Low-latency all-reduce of small tensors between the GPUs of one node (NVLink).

Opt-in (``CVLLM_ALLREDUCE=symm``). Used by ``distributed/comm.py`` for the decoder's
per-layer all-reduces when the TP group is NCCL on GPUs of one host that reach each other
peer to peer; set up once per rank by ``launch_env`` right after the process groups
(``maybe_enable``). Everything else (large tensors, several nodes, no peer access, the
default) stays with NCCL.

Status, measured on 2 H200s (docs/benchmarks/bench-tp-h200x2*.json): through
``cvllm serve`` it gave 328 tok/s at batch 1 against NCCL's 324 (+1%) and 10951 tok/s at
batch 64 against 10673 (+3%), and TP=2 bf16 outputs passed tests/e2e/test_tp_bf16.py
with it. It stays off by default because a standalone 2-process check of it
(spawned ranks, a CUDA graph of 20 back-to-back reductions) did not finish on that
machine and the cause is not yet known.

Why: a batch-1 decode step of an 8B model runs 65 all-reduces of 8 KiB; NCCL spends
several microseconds of protocol on each, which at TP=2 is a large share of a 2-3 ms
step. Here every rank keeps one buffer in torch's symmetric memory
(``torch.distributed._symmetric_memory``), which the peers map; an all-reduce is one
kernel (``torch.ops.symm_mem.one_shot_all_reduce_copy_out``): copy the local input into
the buffer, a barrier over the peers' signal pads, then each rank reads every peer's
buffer over NVLink and sums. The op is captured in CUDA graphs like any kernel.

Every rank must take the same path for every call (a mismatch would hang), so the choice
is made once, collectively: each rank checks it can, the ranks agree (min over the CPU
group), the buffers are exchanged, and a test reduction is checked against its known sum
on every rank before the path is used; any failure leaves all ranks on NCCL with the
reason logged. Sums are in the input dtype's accumulation of torch's kernel (bf16 inputs
are summed in float32 and rounded once), like NCCL's ring for two ranks.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import torch

logger = logging.getLogger("cvllm.distributed")

MAX_BYTES = 1 << 20
"""Largest tensor that takes this path: decode all-reduces at batch <= 128 of a 4096-wide
bf16 model (larger ones are bandwidth-bound, where NCCL's ring is the better choice)."""

_ACTIVE: Optional["SymmAllReduce"] = None


class SymmAllReduce:
    """One rank's symmetric buffer and the group it is mapped in."""

    def __init__(self, group: Any, device: torch.device, max_bytes: int = MAX_BYTES):
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = group.group_name
        self.max_bytes = max_bytes
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(self.group_name)
        self.buf = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)  # [max_bytes]
        self.handle = symm_mem.rendezvous(self.buf, group)  # collective
        self.op = torch.ops.symm_mem.one_shot_all_reduce_copy_out

    def accepts(self, x: torch.Tensor) -> bool:
        # torch's one-shot kernel takes bf16 and float32 only (fp16 models stay on NCCL).
        return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float32)
                and x.is_contiguous() and 0 < x.numel() * x.element_size() <= self.max_bytes)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the group, as a new tensor (``x`` is not changed)."""
        flat = x.view(-1)
        buf = self.buf[: flat.numel() * flat.element_size()].view(x.dtype)  # [n]
        out = torch.empty_like(flat)
        self.op(buf, flat, "sum", self.group_name, out)
        return out.view(x.shape)


def active() -> Optional[SymmAllReduce]:
    return _ACTIVE


def disable() -> None:
    global _ACTIVE
    _ACTIVE = None


def _local_reason(group: Any, device: torch.device, world_size: int, single_node: bool) -> str:
    """Why this rank cannot take the path ('' when it can)."""
    choice = os.environ.get("CVLLM_ALLREDUCE", "nccl").lower()
    if choice != "symm":
        return f"CVLLM_ALLREDUCE={choice}; symm turns the symmetric-memory path on"
    if device.type != "cuda":
        return "not CUDA"
    if not single_node:
        return "ranks on several nodes"
    if world_size > 8:
        return f"{world_size} ranks (at most 8)"
    if not hasattr(group, "group_name"):
        return "the group has no name"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401

        torch.ops.symm_mem.one_shot_all_reduce_copy_out  # noqa: B018
    except (ImportError, AttributeError, RuntimeError) as e:
        return f"torch has no symmetric-memory all-reduce ({e})"
    count = torch.cuda.device_count()
    me = device.index if device.index is not None else torch.cuda.current_device()
    for other in range(count):
        if other != me and not torch.cuda.can_device_access_peer(me, other):
            return f"GPU {me} cannot access GPU {other} peer to peer"
    return ""


def maybe_enable(group: Any, cpu_group: Any, device: torch.device, rank: int, world_size: int,
                 single_node: bool) -> bool:
    """Collectively choose the symmetric-memory path for this TP group (every rank calls
    it, in the same order as its other collectives). True when enabled on every rank."""
    global _ACTIVE
    import torch.distributed as dist

    def agree(ok: bool) -> bool:
        t = torch.tensor([1 if ok else 0], dtype=torch.int64)  # [1]
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=cpu_group)
        return bool(t.item())

    _ACTIVE = None
    reason = _local_reason(group, device, world_size, single_node)
    if not agree(not reason):
        logger.info("all-reduce: NCCL (%s)", reason or "another rank cannot use symmetric memory")
        return False
    impl, err = None, ""
    try:
        impl = SymmAllReduce(group, device)
    except Exception as e:  # allocation or buffer exchange failed on this rank
        err = f"{type(e).__name__}: {e}"
    # Every rank has its buffer before any rank launches the test kernel (which waits
    # for all its peers): a rank that failed above must not leave the others spinning.
    if agree(not err):
        probe = torch.full((4096,), float(rank + 1), dtype=torch.bfloat16, device=device)
        try:
            got = impl.all_reduce(probe)
            want = float(world_size * (world_size + 1) // 2)
            torch.cuda.synchronize(device)
            if not bool((got == want).all()):
                err = f"test sum {got[0].item()} != {want}"
        except Exception as e:  # the kernel failed on this rank
            err = f"{type(e).__name__}: {e}"
    else:
        err = err or "failed on another rank"
    if not agree(not err):
        logger.warning("all-reduce: NCCL (symmetric memory failed: %s)",
                       err or "failed on another rank")
        return False
    _ACTIVE = impl
    logger.info("all-reduce: symmetric memory one-shot up to %d KiB over %d GPUs, NCCL above",
                MAX_BYTES >> 10, world_size)
    return True
