"""kernels/allreduce.py against reference.all_reduce_ref / all_reduce_rms_norm_ref, with
real ranks: one process per rank, buffers every rank maps (shared host memory on the
CPU under ``TRITON_INTERPRET=1``; CUDA peer memory through ``custom_allreduce`` on GPUs,
tests/distributed/test_custom_allreduce.py).

A sequence of calls of changing sizes, with and without the fused add + norm, runs on
every rank: it turns the three phases over several times, and a call smaller than the
one before it would read that call's stale values if a phase were not refilled. Sums
must equal the reference bit for bit (both add in float32 in rank order); the fused
norm within one unit of the dtype's last place (the mean's sum order differs).
"""

from __future__ import annotations

import traceback
from typing import List, Tuple

import pytest
import torch

from cvllm.distributed.custom_allreduce import CustomAllReduce
from cvllm.kernels import allreduce as ar
from cvllm.kernels.reference.norms import all_reduce_ref, all_reduce_rms_norm_ref
from tests.interpreted import run_interpreted

EPS = 1e-5
# (kind, shape): "flat" sums the tensor; "norm" also adds the residual and normalises rows;
# "gemv-flat" / "gemv-norm": the same over a batch-1 GEMV's outputs (with the gated
# activation fused) that the GEMV pushed itself (16-bit dtypes only).
CASES: List[Tuple[str, Tuple[int, ...]]] = [
    ("flat", (3000,)), ("norm", (3, 48)), ("gemv-norm", (1, 48)), ("flat", (5,)),
    ("norm", (1, 48)), ("gemv-flat", (1, 37)), ("flat", (2, 33)), ("norm", (4, 48)),
    ("flat", (7,)), ("gemv-norm", (1, 48)), ("flat", (2100,)), ("norm", (2, 48)),
    ("gemv-flat", (1, 3000)), ("flat", (1,)),
]
"""(A gemv-flat case over FLAT_BLOCK elements sums with several programs, launched as
ordinary kernels after the GEMV.)"""
GEMV_K = 80
"""Inner size of the gemv cases (not a multiple of the kernel's K step)."""


def case_inputs(i: int, kind: str, shape, world: int, dtype: torch.dtype):
    """Every rank's partials (with some -0.0 and exact zeros), residual and weight of
    call ``i``: the same on every rank (seeded), so each can compute the reference."""
    g = torch.Generator().manual_seed(1000 + i)
    parts = [torch.randn(shape, generator=g).to(dtype) for _ in range(world)]
    parts[0].view(-1)[::7] = -0.0
    parts[-1].view(-1)[::5] = 0.0
    residual = torch.randn(shape, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype)
    return parts, residual, weight


def gemv_inputs(i: int, n: int, world: int, dtype: torch.dtype):
    """Every rank's gate_up row ``[1, 2K]`` and weight ``[n, K]`` of gemv call ``i``."""
    g = torch.Generator().manual_seed(5000 + i)
    xs = [torch.randn(1, 2 * GEMV_K, generator=g).to(dtype) for _ in range(world)]
    ws = [(torch.randn(n, GEMV_K, generator=g) / GEMV_K ** 0.5).to(dtype) for _ in range(world)]
    return xs, ws


def check_case(i, kind, got, parts, residual, weight) -> None:
    if kind.endswith("flat"):
        want = all_reduce_ref(parts)
        assert torch.equal(got, want), f"call {i}: sum differs"
        return
    out, res_out = got
    want_out, want_res = all_reduce_rms_norm_ref(parts, residual.clone(), weight, EPS)
    assert torch.equal(res_out, want_res), f"call {i}: residual differs"
    torch.testing.assert_close(out.float(), want_out.float(), rtol=1e-2, atol=1e-2,
                               msg=f"call {i}: normed output differs")


def run_cases(rank: int, world: int, dtype, device, impl) -> None:
    """Every case in order (twice) through ``impl`` (a ``CustomAllReduce``), each checked
    against the reference; raises on the first mismatch. A gemv case's partial sums are
    what the (unpushed) GEMV kernel gives for each rank's inputs."""
    from cvllm.kernels.gemv import gemv

    for rep in range(2):
        for i, (kind, shape) in enumerate(CASES):
            if kind.startswith("gemv") and dtype == torch.float32:
                continue
            parts, residual, weight = case_inputs(i + 100 * rep, kind, shape, world, dtype)
            x = parts[rank].to(device)
            if kind.startswith("gemv"):
                xs, ws = gemv_inputs(i + 100 * rep, shape[-1], world, dtype)
                ws = [w.to(device) for w in ws]
                parts = [gemv(xr.to(device), wr, act="silu").cpu() for xr, wr in zip(xs, ws)]
                target = impl.push_target(shape[-1], dtype)
                assert target is not None
                x = gemv(xs[rank].to(device), ws[rank], act="silu", push=target)  # [1, N]
                impl.mark_pushed(x)
            if kind.endswith("flat"):
                got = impl.all_reduce(x).cpu()
            else:
                res = residual.clone().to(device)  # updated in place
                out, res_out = impl.all_reduce_rms_norm(x, res, weight.to(device), EPS)
                assert res_out is res, "the residual is updated in place"
                got = (out.cpu(), res_out.cpu())
            check_case(i, kind, got, parts, residual, weight)


def rank_main(rank: int, world: int, bufs, dtype, slot_bytes: int, q) -> None:
    """One rank on the CPU: shared host buffers, every case."""
    try:
        views = [ar.payload_view(b, torch.empty((), dtype=dtype).element_size()) for b in bufs]
        state = ar.new_state(torch.device("cpu"))
        impl = CustomAllReduce.over(views, state, rank, world, slot_bytes)
        run_cases(rank, world, dtype, "cpu", impl)
        # The phase stays in 0..2 (no counter to overflow) and the ticket is reset.
        calls = 2 * sum(1 for kind, _ in CASES
                        if dtype != torch.float32 or not kind.startswith("gemv"))
        assert state[:2].tolist() == [calls % 3, 0], state.tolist()
        q.put((rank, "ok"))
    except BaseException:
        q.put((rank, traceback.format_exc()))


def run_ranks(world: int, dtype: torch.dtype) -> None:
    """Shared host buffers, one spawned process per rank (under the interpreter)."""
    import torch.multiprocessing as mp

    slot_bytes = 4096 * 4
    bufs = []
    for _ in range(world):
        b = torch.empty(ar.buffer_bytes(world, slot_bytes), dtype=torch.uint8)
        ar.init_buffer(b, torch.empty((), dtype=dtype).element_size())
        bufs.append(b.share_memory_())
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, world, bufs, dtype, slot_bytes, q))
             for r in range(world)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(30)
    bad = {r: msg for r, msg in got.items() if msg != "ok"}
    assert not bad, bad


def run_cpu_cases() -> None:
    # float16 for the 16-bit path: the interpreter truncates float32 -> bfloat16.
    run_ranks(2, torch.float16)
    run_ranks(3, torch.float32)


def test_interpreted_ranks_match_reference():
    run_interpreted("from tests.kernels.test_allreduce import run_cpu_cases; run_cpu_cases()",
                    timeout=400)


def test_reference_sums_in_rank_order():
    parts = [torch.tensor([1.0, -0.0], dtype=torch.bfloat16),
             torch.tensor([2.0 ** -8, -0.0], dtype=torch.bfloat16),
             torch.tensor([2.0 ** -8, 3.0], dtype=torch.bfloat16)]
    # float32 accumulation: 1 + 2^-8 + 2^-8 = 1 + 2^-7, a bf16 value; bf16 steps would
    # round each add back to 1 (a tie to even).
    assert all_reduce_ref(parts).tolist() == [1.0 + 2.0 ** -7, 3.0]


def test_wrapper_rejects_bad_arguments():
    x = torch.zeros(8, dtype=torch.bfloat16)
    bufs = [ar.payload_view(torch.zeros(ar.buffer_bytes(2, 64), dtype=torch.uint8), 2)
            for _ in range(2)]
    state = ar.new_state(torch.device("cpu"))
    with pytest.raises(ValueError, match="exceed the slot"):
        ar.lamport_all_reduce(x, bufs, state, 0, 2, slot_bytes=8)
    with pytest.raises(ValueError, match="one buffer per rank"):
        ar.lamport_all_reduce(x, bufs[:1], state, 0, 2, slot_bytes=64)
    with pytest.raises(ValueError, match="bytes"):  # too small for 3 phases of 128-byte slots
        ar.lamport_all_reduce(x, bufs, state, 0, 2, slot_bytes=128)
    with pytest.raises(ValueError, match="int32"):  # float32 moves as int32, not int16
        ar.lamport_all_reduce(x.float(), bufs, state, 0, 2, slot_bytes=64)
    with pytest.raises(ValueError, match="rank"):
        ar.lamport_all_reduce(x, bufs, state, 2, 2, slot_bytes=64)
    with pytest.raises(ValueError, match="residual"):
        ar.lamport_all_reduce(x.view(2, 4), bufs, state, 0, 2, 64, None,
                              torch.ones(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="weight"):
        ar.lamport_all_reduce(x.view(2, 4), bufs, state, 0, 2, 64, x.view(2, 4),
                              torch.ones(5, dtype=torch.bfloat16))
