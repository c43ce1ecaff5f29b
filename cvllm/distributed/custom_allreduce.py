"""Low-latency all-reduce of small tensors between the GPUs of one node (NVLink), and
the same fused with the decoder's residual add + RMSNorm.

Used by ``distributed/comm.py`` for the decoder's per-layer all-reduces when the TP
group is NCCL on GPUs of one host that reach each other peer to peer; set up once per
rank by ``rendezvous`` right after the process groups (``maybe_enable``). Everything
else (tensors over ``MAX_BYTES``, float32, several nodes, no peer access,
``CVLLM_ALLREDUCE=nccl``) stays with NCCL.

Why: a batch-1 decode step of an 8B model runs 65 all-reduces of 8 KiB; NCCL spends
several microseconds of protocol on each, a large share of a 2-3 ms step at TP=2. Here
one Triton kernel (``kernels/allreduce.py``) pushes this rank's values into every peer's
buffer and sums what the peers pushed into its own, with no barrier; the fused form also
adds the residual and normalises, saving the separate norm kernel.

Every rank keeps one buffer in torch's symmetric memory
(``torch.distributed._symmetric_memory``), which only serves here to map each peer's
buffer into this process; the kernel gets every rank's buffer as a tensor. The buffers hold 16-bit values
(bf16 / fp16 models); their sentinel fill is done before any rank can push.

A batch-1 GEMV of a row-parallel layer may push its output rows itself
(``push_target``, from ``layers/linear.RowParallelLinear`` through
``comm.custom_path``): the next call then only waits for the slots and sums. The
object remembers the pushed tensor, and that call must be the next one (any other raises:
it would take the pushed phase).

Every rank must take the same path for every call (a mismatch would hang), so the choice
is made once, collectively: each rank checks it can, the ranks agree (min over the CPU
group), the buffers are exchanged and filled, and test reductions (plain and fused, over
all three buffer phases) are checked against their known values on every rank before the
path is used; any failure leaves all ranks on NCCL, with the reason logged. Per call, the
choice depends only on the tensor's shape and dtype, which every rank shares.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Tuple

import torch

from cvllm.kernels import allreduce as ar
from cvllm.utils import tuning

logger = logging.getLogger("cvllm.distributed")

MAX_BYTES = 1 << 20
"""Largest tensor that takes this path: decode all-reduces up to batch 128 of a 4096-wide
model (larger ones are bandwidth-bound, where NCCL's ring is the better choice)."""
CHOICES = tuning.ALLREDUCE_CHOICES
_DTYPES = (torch.bfloat16, torch.float16)

_ACTIVE: Optional["CustomAllReduce"] = None


class CustomAllReduce:
    """One rank's buffer, the peers' buffers as mapped here, and the call state."""

    def __init__(self, group: Any, device: torch.device, rank: int, world: int,
                 max_bytes: int = MAX_BYTES):
        """Allocate and fill this rank's buffer (local; ``exchange`` maps the peers')."""
        import torch.distributed._symmetric_memory as symm_mem

        self.rank, self.world, self.slot_bytes = rank, world, max_bytes
        self.group_name = group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(self.group_name)
        self.buf = symm_mem.empty(ar.buffer_bytes(world, max_bytes), dtype=torch.uint8,
                                  device=device)  # [3 * world * max_bytes]
        ar.init_buffer(self.buf, 2)
        torch.cuda.synchronize(device)  # filled before the exchange lets peers push
        self.state = ar.new_state(device)  # [STATE_INTS]
        self.bufs: list = []
        self._pushed: Optional[Tuple[int, int]] = None  # (data_ptr, numel) awaiting its call

    @classmethod
    def over(cls, bufs, state: torch.Tensor, rank: int, world: int,
             slot_bytes: int) -> "CustomAllReduce":
        """One over buffers mapped by other means (``bufs[r]``: rank r's, as
        ``kernels/allreduce.payload_view``s), e.g. the tests' shared host memory."""
        self = cls.__new__(cls)
        self.rank, self.world, self.slot_bytes = rank, world, slot_bytes
        self.bufs, self.state, self._pushed = list(bufs), state, None
        return self

    def exchange(self) -> None:
        """Map every rank's buffer here (collective: every rank calls it once)."""
        import torch.distributed._symmetric_memory as symm_mem

        handle = symm_mem.rendezvous(self.buf, self.group_name)
        nbytes = self.buf.numel()
        self.bufs = [ar.payload_view(handle.get_buffer(r, (nbytes,), torch.uint8), 2)
                     for r in range(self.world)]  # rank r's buffer, mapped here
        self.handle = handle

    def accepts(self, x: torch.Tensor) -> bool:
        return (x.is_cuda and x.dtype in _DTYPES
                and 0 < x.numel() * x.element_size() <= self.slot_bytes)

    def push_target(self, numel: int, dtype: torch.dtype) -> Optional[ar.PushTarget]:
        """Where a batch-1 GEMV of ``numel`` outputs pushes them for the next call
        (``kernels/gemv.py``), or None: this path declines it, or ``CVLLM_GEMV_PUSH=0``.
        The caller passes the GEMV's output to ``mark_pushed``; the next call on this
        object must then be the reduction of that output."""
        if (not tuning.current().gemv_push or self._pushed is not None or dtype not in _DTYPES
                or not 0 < numel * dtype.itemsize <= self.slot_bytes):
            return None
        return ar.PushTarget(self.bufs, self.state, self.rank, self.world, self.slot_bytes)

    def mark_pushed(self, y: torch.Tensor) -> None:
        self._pushed = (y.data_ptr(), y.numel())

    def forget_push(self) -> None:
        """Drop a push whose call never came because the forward raised before it (a
        failed CUDA graph capture, which ran nothing on the device)."""
        self._pushed = None

    def _take_pushed(self, x: torch.Tensor) -> bool:
        """Whether ``x`` is the pushed GEMV output (its values are in the buffers); any
        other tensor while one waits is a bug (its call would take the pushed phase)."""
        pushed, self._pushed = self._pushed, None
        if pushed is not None and pushed != (x.data_ptr(), x.numel()):
            raise RuntimeError("custom all-reduce: a GEMV pushed its output for the next "
                               "call, but that call reduces another tensor")
        return pushed is not None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the group, as a new tensor (``x`` is not changed)."""
        return ar.lamport_all_reduce(x, self.bufs, self.state, self.rank, self.world,
                                     self.slot_bytes, pushed=self._take_pushed(x))

    def accepts_norm(self, x: torch.Tensor, residual: torch.Tensor,
                     weight: torch.Tensor) -> bool:
        return (self.accepts(x) and residual.shape == x.shape and residual.dtype == x.dtype
                and residual.is_contiguous()
                and weight.dtype == x.dtype and weight.dim() == 1
                and weight.shape[0] == x.shape[-1] and weight.stride(0) == 1
                and x.shape[-1] <= ar.MAX_HIDDEN)

    def all_reduce_rms_norm(self, x: torch.Tensor, residual: torch.Tensor,
                            weight: torch.Tensor, eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(sum(x) + residual) * weight, sum(x) + residual)``; the second is
        ``residual``, updated in place."""
        return ar.lamport_all_reduce(x, self.bufs, self.state, self.rank, self.world,
                                     self.slot_bytes, residual, weight, eps,
                                     pushed=self._take_pushed(x))


def active() -> Optional[CustomAllReduce]:
    return _ACTIVE


def disable() -> None:
    global _ACTIVE
    _ACTIVE = None


def choice() -> str:
    """``CVLLM_ALLREDUCE``: auto (the custom path where it works, else NCCL; the default),
    custom (the same, but a failure to set it up ends the start-up), nccl
    (``utils/tuning.py``)."""
    return tuning.current().allreduce


def _local_reason(group: Any, device: torch.device, world_size: int, single_node: bool) -> str:
    """Why this rank cannot take the path ('' when it can)."""
    if choice() == "nccl":
        return "CVLLM_ALLREDUCE=nccl"
    if device.type != "cuda":
        return "not CUDA"
    if not single_node:
        return "ranks on several nodes"
    if world_size > 8:
        return f"{world_size} ranks (at most 8)"
    if not hasattr(group, "group_name"):
        return "the group has no name"
    try:
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.rendezvous  # noqa: B018
    except (ImportError, AttributeError, RuntimeError) as e:
        return f"torch has no symmetric memory ({e})"
    count = torch.cuda.device_count()
    me = device.index if device.index is not None else torch.cuda.current_device()
    for other in range(count):
        if other != me and not torch.cuda.can_device_access_peer(me, other):
            return f"GPU {me} cannot access GPU {other} peer to peer"
    return ""


def _self_test(impl: CustomAllReduce, device: torch.device, rank: int, world: int) -> str:
    """Plain and fused reductions of known values, over all three phases and a size
    change; '' when every result is right on this rank. Every call is made whatever the
    results (a rank that stopped early would leave its peers waiting for its pushes)."""
    total = float(world * (world + 1) // 2)  # sum of rank + 1
    errors = []
    for n in (4096, 37, 4096, 1):
        got = impl.all_reduce(torch.full((n,), float(rank + 1), dtype=torch.bfloat16,
                                         device=device))
        if not bool((got == total).all()):
            errors.append(f"test sum of {n} elements gave {got[0].item()}, not {total}")
    x = torch.full((2, 64), float(rank + 1), dtype=torch.bfloat16, device=device)
    res = torch.ones(2, 64, dtype=torch.bfloat16, device=device)
    w = torch.full((64,), 2.0, dtype=torch.bfloat16, device=device)
    out, res = impl.all_reduce_rms_norm(x, res, w, 0.0)
    if not (bool((res == total + 1).all()) and bool((out == 2.0).all())):
        errors.append(f"test add + norm gave {res[0, 0].item()}, {out[0, 0].item()}")
    return errors[0] if errors else ""


def maybe_enable(group: Any, cpu_group: Any, device: torch.device, rank: int, world_size: int,
                 single_node: bool) -> bool:
    """Collectively choose the custom path for this TP group (every rank calls it, in the
    same order as its other collectives). True when enabled on every rank."""
    global _ACTIVE
    import torch.distributed as dist

    def agree(ok: bool) -> bool:
        t = torch.tensor([1 if ok else 0], dtype=torch.int64)  # [1]
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=cpu_group)
        return bool(t.item())

    _ACTIVE = None
    wanted = choice()
    try:
        reason = _local_reason(group, device, world_size, single_node)
    except Exception as e:  # e.g. a CUDA query failed: decline, but still vote
        reason = f"{type(e).__name__}: {e}"
    if not agree(not reason):
        _declined(wanted, reason or "another rank cannot use it")
        return False
    # Each collective step (the buffer exchange, the test kernels, which wait for every
    # peer) starts only after every rank has voted that the step before it succeeded: a
    # rank that failed must not leave the others waiting in it.
    impl: Optional[CustomAllReduce] = None

    def build() -> str:
        nonlocal impl
        impl = CustomAllReduce(group, device, rank, world_size)
        return ""

    def exchange() -> str:
        impl.exchange()
        return ""

    def test() -> str:
        err = _self_test(impl, device, rank, world_size)
        torch.cuda.synchronize(device)
        return err

    for step in (build, exchange, test):
        try:
            err = step()
        except Exception as e:  # allocation, exchange or kernel failed on this rank
            err = f"{type(e).__name__}: {e}"
        if not agree(not err):
            _declined(wanted, f"set-up failed: {err or 'on another rank'}")
            return False
    _ACTIVE = impl
    logger.info("all-reduce: custom one-shot (bf16/fp16 up to %d KiB, fused with add + "
                "RMSNorm) over %d GPUs, NCCL above", MAX_BYTES >> 10, world_size)
    return True


def _declined(wanted: str, reason: str) -> None:
    if wanted == "custom":
        raise RuntimeError(f"CVLLM_ALLREDUCE=custom, but the custom all-reduce cannot run: "
                           f"{reason}")
    logger.info("all-reduce: NCCL (%s)", reason)
