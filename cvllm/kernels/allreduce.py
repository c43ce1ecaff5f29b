"""One-shot all-reduce of small tensors between the GPUs of one node, optionally fused
with the residual add and RMSNorm that follow it in a decoder layer (Triton).

Called by ``distributed/custom_allreduce.py`` (which owns the buffers and the pointer
exchange) for the decoder's per-layer all-reduces; ``reference.all_reduce_rms_norm_ref``
is the plain-torch version and the test oracle (tests/kernels/test_allreduce.py runs it
across processes, also on the CPU under ``TRITON_INTERPRET=1``).

Protocol (Lamport-style, one kernel, no barrier): every rank owns one buffer that every
peer has mapped, made of 3 phases x ``world`` slots. Call ``e`` uses phase ``e % 3``: each
rank *pushes* its partial sums into slot ``[rank]`` of that phase on every rank (NVLink
stores), then polls its own copy until no element of any slot holds the sentinel, sums
the slots in rank order (float32, rounded once: the same bits on every rank) and writes
the result. The sentinel is -0.0; a pushed -0.0 is sent as +0.0 (equal in any sum).
Before it polls (after its own push), it refills the previous call's phase ``(e + 2) %
3`` with sentinels, so those stores overlap the wait for the peers.

Why that is safe without a barrier: a rank at call ``e`` has seen every peer's data of
call ``e - 1`` (its call ``e - 1`` completed only then), so every peer has at least
started ``e - 1`` and has written all it writes there. A peer writes into phase
``e % 3`` only at calls ``e`` and ``e + 3``; this rank reads it only at call ``e`` and
refills it during call ``e + 1``. A peer reaches call ``e + 3`` only with this
rank's push of call ``e + 2``, which this rank issues after its kernel of call ``e + 1``
(refill included) has completed: kernels on one stream run in order, and no call of this
kernel ever overlaps the previous call (a pushed call may overlap the GEMV before it,
below, but that GEMV started only after the previous call completed).

Pushed from a GEMV (``PushTarget``): a row-parallel layer's batch-1 GEMV may push its
rows itself, from its epilogue (``push_slot``), as each program finishes; the call that
sums them then only polls (``pushed=True``), so the values travel while the rest of the
weight stream is still being read. That GEMV reads the phase only after ``gdc_wait``, and
triggers its dependents only after it too, so the call before it has completed by then,
as for the kernel's own push. A summing call of one program (batch 1) is launched with
PDL and waits for no kernel: every value it reads beyond its own buffer (the state and
the residual, read volatile, and the norm weight) comes from kernels that completed
before the GEMV's programs passed their wait. Its output and residual it writes only
once every program of the GEMV on this rank has pushed (has read its inputs); the GEMV
writes nothing else. Before that it writes only the refill: sentinels into this rank's
own buffer (never memory the allocator hands out), in the previous call's phase, which
the running GEMV does not touch. A call of several programs is launched normally
(``lamport_all_reduce``).

State is on the device (``state``: the phase, a ticket, elements used per phase), so the
kernel can be captured in CUDA graphs and replayed in any order with eager calls: the
last program of each call (a ticket counter; no counter with one program) advances the
phase. Every rank must make the same sequence of calls (the TP lockstep guarantees it);
a rank that never arrives leaves its peers spinning, as NCCL would, until the job's
fault handling ends the job. A call after a larger one refills the larger one's phase
with its own (possibly single) program: slower once, e.g. the first decode step after a
prefill chunk that fit the slot.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Tuple, Union

import torch
import triton
import triton.language as tl

from cvllm.kernels import pdl
from cvllm.kernels.pdl import gdc_launch_dependents

MAX_HIDDEN = 16384
"""Widest row the fused add + norm takes in one program."""
FLAT_BLOCK = 2048
"""Elements per program without the norm."""
STATE_INTS = 8
"""``state``: [phase (0-2), ticket, used phase 0, 1, 2, spare...] (int32)."""
_STATE = tl.constexpr(STATE_INTS)  # the same, inside the kernel
SENTINEL_BITS = {2: -32768, 4: -2147483648}
"""-0.0 as a signed int of the element's width: the 'not yet written' mark."""
_BITS_DTYPE = {2: torch.int16, 4: torch.int32}
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _buf(r: tl.constexpr, b0, b1, b2, b3, b4, b5, b6, b7):
    """Rank r's buffer (a compile-time choice among the eight pointer arguments)."""
    p = b0
    if r == 1:
        p = b1
    if r == 2:
        p = b2
    if r == 3:
        p = b3
    if r == 4:
        p = b4
    if r == 5:
        p = b5
    if r == 6:
        p = b6
    if r == 7:
        p = b7
    return p


@triton.jit
def push_slot(vals, idx, mask, phase, slot_elems, b0, b1, b2, b3, b4, b5, b6, b7,
              RANK: tl.constexpr, WORLD: tl.constexpr, SENT: tl.constexpr):
    """Store ``vals`` (16/32-bit floats) at ``idx`` of slot ``RANK`` of ``phase`` (the
    state's first int) on every rank: the push half of a call, also made by a GEMV's
    epilogue (``kernels/gemv.py``, ``PushTarget``); -0.0 travels as +0.0."""
    pay_ty = b0.dtype.element_ty
    bits = vals.to(pay_ty, bitcast=True)
    bits = tl.where(bits == SENT, 0, bits).to(pay_ty)
    for r in tl.static_range(WORLD):
        dst = _buf(r, b0, b1, b2, b3, b4, b5, b6, b7)
        tl.store(dst + (phase * WORLD + RANK) * slot_elems + idx, bits, mask=mask)


@triton.jit
def _poll_sum(mine, phase, slot_elems, idx, mask, dtype, WORLD: tl.constexpr,
              SENT: tl.constexpr, BLOCK: tl.constexpr):
    """Wait until every slot of ``phase`` in this rank's buffer holds no sentinel at
    ``idx``; their float32 sum in rank order."""
    acc = tl.zeros((BLOCK,), tl.float32)
    for r in tl.static_range(WORLD):
        src = mine + (phase * WORLD + r) * slot_elems + idx
        v = tl.load(src, mask=mask, other=0, volatile=True)
        while tl.max((v == SENT).to(tl.int32), axis=0) > 0:
            v = tl.load(src, mask=mask, other=0, volatile=True)
        acc += v.to(dtype, bitcast=True).to(tl.float32)
    return acc


@triton.jit
def _refill(phase_base, used, slot_elems, WORLD: tl.constexpr, SENT: tl.constexpr,
            BLOCK: tl.constexpr):
    """Sentinels into the first ``used`` elements of every slot of the phase at
    ``phase_base``, spread over the programs of the grid."""
    cols = tl.arange(0, BLOCK)
    fill = tl.full((BLOCK,), SENT, phase_base.dtype.element_ty)
    step = tl.num_programs(0) * BLOCK
    for r in tl.static_range(WORLD):
        base = phase_base + r * slot_elems
        for start in range(tl.program_id(0) * BLOCK, used, step):
            offs = start + cols
            tl.store(base + offs, fill, mask=offs < used)


@triton.jit
def _lamport_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, state_ptr,
    b0, b1, b2, b3, b4, b5, b6, b7,
    N, numel, slot_elems, eps,
    stride_x, stride_res, stride_out, stride_res_out,
    RANK: tl.constexpr, WORLD: tl.constexpr, SENT: tl.constexpr,
    HAS_NORM: tl.constexpr, BLOCK: tl.constexpr, ONE_PROGRAM: tl.constexpr,
    PUSHED: tl.constexpr, PDL: tl.constexpr,
):
    """Without HAS_NORM: program ``pid`` sums elements ``[pid*BLOCK, +BLOCK)`` of the
    flat tensor. With HAS_NORM: row ``pid``: ``s = round(sum)``, ``res_out = round(s +
    res)``, ``out = w * round(norm(res_out))`` (``kernels/rmsnorm.py``'s roundings).
    ``b0..b{WORLD-1}``: every rank's buffer as mapped here, as ints of the payload's
    width (the others are unused). PUSHED: the GEMV before this kernel has pushed this
    rank's values already (``x`` is not read); see ``lamport_all_reduce``."""
    if PDL:
        gdc_launch_dependents()  # a PDL GEMV after this may start loading its weights
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    dtype = out_ptr.dtype.element_ty
    if HAS_NORM:
        row = pid.to(tl.int64)
        mask = cols < N
        idx = row * N + cols  # position in the slot (rows packed)
        # Independent of the peers: in flight while the values travel.
        # volatile (PUSHED): launched early, this grid has waited on no kernel; read the
        # previous call's residual where it is coherent, not from a stale L1 line.
        resid = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0,
                        volatile=PUSHED).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if not PUSHED:
            x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    else:
        idx = pid.to(tl.int64) * BLOCK + cols
        mask = idx < numel
        if not PUSHED:
            x = tl.load(x_ptr + idx, mask=mask, other=0.0)
    # One load of the whole state: the phase and what the previous call used.
    slots = tl.arange(0, _STATE)
    state = tl.load(state_ptr + slots, volatile=PUSHED)
    phase = tl.sum(tl.where(slots == 0, state, 0), axis=0)  # 0, 1, 2: never wraps
    prev = (phase + 2) % 3
    used = tl.sum(tl.where(slots == 2 + prev, state, 0), axis=0)
    if not PUSHED:  # this rank's values into slot RANK of the phase, on every rank
        push_slot(x, idx, mask, phase, slot_elems, b0, b1, b2, b3, b4, b5, b6, b7,
                  RANK, WORLD, SENT)
    mine = _buf(RANK, b0, b1, b2, b3, b4, b5, b6, b7)
    # Refill the previous call's phase (every peer is past it) while the values travel:
    # its stores then no longer hold up this kernel's completion, which the next
    # kernel waits for.
    _refill(mine + prev * WORLD * slot_elems, used, slot_elems, WORLD, SENT, BLOCK)
    acc = _poll_sum(mine, phase, slot_elems, idx, mask, dtype, WORLD, SENT, BLOCK)
    if HAS_NORM:
        summed = (acc.to(dtype).to(tl.float32) + resid).to(dtype)
        tl.store(res_out_ptr + row * stride_res_out + cols, summed, mask=mask)
        s = summed.to(tl.float32)
        var = tl.sum(s * s, axis=0) / N
        y = (s * tl.rsqrt(var + eps)).to(dtype).to(tl.float32) * w
        tl.store(out_ptr + row * stride_out + cols, y.to(dtype), mask=mask)
    else:
        tl.store(out_ptr + idx, acc.to(dtype), mask=mask)
    nprog = tl.num_programs(0)
    if pid == 0:
        tl.store(state_ptr + 2 + phase, numel)
    # The last program to finish advances the phase (all have read it by then).
    if ONE_PROGRAM:
        tl.store(state_ptr, (phase + 1) % 3)
    else:
        ticket = tl.atomic_add(state_ptr + 1, 1)
        if ticket == nprog - 1:
            tl.store(state_ptr + 1, 0)
            tl.store(state_ptr, (phase + 1) % 3)


def _eight(bufs: Sequence[torch.Tensor]) -> list:
    """The kernels' ``b0..b7`` arguments: every rank's buffer, then the first repeated."""
    return list(bufs) + [bufs[0]] * (8 - len(bufs))


class PushTarget(NamedTuple):
    """Where a GEMV pushes its rows for the next call (``lamport_all_reduce``'s arguments
    of that call): every rank's buffer as mapped here, this rank's state, its rank."""

    bufs: Sequence[torch.Tensor]
    state: torch.Tensor
    rank: int
    world: int
    slot_bytes: int

    def kernel_args(self, element_size: int) -> Tuple[list, dict]:
        """The ``state_ptr, slot_elems, b0..b7`` arguments and the constexprs."""
        return ([self.state, self.slot_bytes // element_size] + _eight(self.bufs),
                dict(RANK=self.rank, WORLD=self.world, SENT=SENTINEL_BITS[element_size]))


def buffer_bytes(world: int, slot_bytes: int) -> int:
    """Size of one rank's buffer: 3 phases x ``world`` slots."""
    return 3 * world * slot_bytes


def init_buffer(buf: torch.Tensor, element_size: int) -> None:
    """Fill a fresh rank buffer with sentinels (before any rank's first call)."""
    buf.view(_BITS_DTYPE[element_size]).fill_(SENTINEL_BITS[element_size])


def new_state(device: torch.device) -> torch.Tensor:
    return torch.zeros(STATE_INTS, dtype=torch.int32, device=device)  # [STATE_INTS]


def payload_view(buf: torch.Tensor, element_size: int) -> torch.Tensor:
    """A rank buffer (bytes) as the ints the kernel moves for elements of this size."""
    return buf.view(_BITS_DTYPE[element_size])


def _check(x, bufs, state, rank, world, slot_bytes, residual, weight) -> None:
    if x.dtype not in _DTYPES:
        raise ValueError(f"x dtype must be one of {_DTYPES}; got {x.dtype}")
    if not 1 <= world <= 8 or len(bufs) != world:
        raise ValueError(f"need one buffer per rank (1 to 8), got {len(bufs)} for {world}")
    bits = _BITS_DTYPE[x.element_size()]
    for b in bufs:
        if b.dtype != bits or b.device != x.device or b.numel() * b.element_size() < \
                buffer_bytes(world, slot_bytes):
            raise ValueError(f"each buffer must be {bits} on {x.device} with "
                             f"{buffer_bytes(world, slot_bytes)} bytes")
    if state.dtype != torch.int32 or state.numel() < STATE_INTS or state.device != x.device:
        raise ValueError(f"state must be int32 [{STATE_INTS}] on {x.device}")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside world {world}")
    if x.numel() * x.element_size() > slot_bytes:
        raise ValueError(f"{x.numel() * x.element_size()} bytes exceed the slot ({slot_bytes})")
    if weight is not None:
        n = x.shape[-1]
        if residual is None or residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError("residual must match x")
        if weight.shape != (n,) or weight.dtype != x.dtype or weight.stride(0) != 1:
            raise ValueError(f"weight must be a contiguous [{n}] {x.dtype} tensor")
        if n > MAX_HIDDEN:
            raise ValueError(f"hidden size {n} exceeds {MAX_HIDDEN}")


def lamport_all_reduce(
    x: torch.Tensor,
    bufs: Sequence[torch.Tensor],
    state: torch.Tensor,
    rank: int,
    world: int,
    slot_bytes: int,
    residual: Optional[torch.Tensor] = None,
    weight: Optional[torch.Tensor] = None,
    eps: float = 0.0,
    pushed: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """The sum of every rank's ``x`` (a new tensor); with ``weight`` and ``residual``:
    ``(rms_norm(sum + residual) * weight, sum + residual)``, the second written into
    ``residual``. ``bufs[r]``: rank r's buffer as mapped here (``payload_view``);
    ``state``: this rank's ``new_state``. Every rank calls it with the same shapes in the
    same order. ``pushed``: the kernel just before this call on the stream was a GEMV
    that pushed this rank's values for it (``PushTarget``); ``x`` (that GEMV's
    unwritten output) gives only the shape. This call is then launched with PDL where
    the device has it: its wait for the peers' values is its wait for the GEMV."""
    _check(x, bufs, state, rank, world, slot_bytes, residual, weight)
    slot_elems = slot_bytes // x.element_size()
    b = _eight(bufs)
    use_pdl = pdl.enabled(x)
    common = dict(RANK=rank, WORLD=world, SENT=SENTINEL_BITS[x.element_size()],
                  PUSHED=pushed, PDL=use_pdl)

    def early(programs: int) -> dict:
        """PDL launch of a pushed call of one program: it writes its output only after
        every value arrived, i.e. after the GEMV has read all its inputs (before that,
        only the refill of its own buffer's previous phase). With several
        programs, one could write its rows (into memory the allocator may have just
        freed from the GEMV's input) while other GEMV programs still read: those wait
        for the GEMV like any kernel."""
        return pdl.launch_args(x) if pushed and programs == 1 else {}
    if weight is None:
        flat = x.reshape(-1)  # [numel]
        if not pushed:
            flat = flat.contiguous()
        out = torch.empty_like(flat)
        if flat.numel():
            grid = (triton.cdiv(flat.numel(), FLAT_BLOCK),)
            _lamport_kernel[grid](flat, flat, flat, out, out, state, *b, 0, flat.numel(),
                                  slot_elems, 0.0, 0, 0, 0, 0, HAS_NORM=False,
                                  ONE_PROGRAM=grid[0] == 1,
                                  BLOCK=FLAT_BLOCK, num_warps=8, **common, **early(grid[0]))
        return out.view(x.shape)
    n = x.shape[-1]
    x2 = x.reshape(-1, n)  # [R, N]
    x2 = x2 if x2.stride(-1) == 1 or pushed else x2.contiguous()
    r2 = residual.view(-1, n)  # [R, N]; written in place
    if r2.stride(-1) != 1:
        raise ValueError("residual must have unit stride along the hidden dim")
    out = torch.empty_like(x2)  # [R, N]
    if x2.shape[0]:
        block = triton.next_power_of_2(n)
        _lamport_kernel[(x2.shape[0],)](
            x2, r2, weight, out, r2, state, *b, n, x2.numel(), slot_elems, float(eps),
            x2.stride(0), r2.stride(0), out.stride(0), r2.stride(0), HAS_NORM=True,
            ONE_PROGRAM=x2.shape[0] == 1,
            BLOCK=block, num_warps=min(max(block // 512, 1), 16), **common,
            **early(x2.shape[0]))
    return out.view(x.shape), residual
