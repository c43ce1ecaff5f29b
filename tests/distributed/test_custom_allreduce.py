"""distributed/custom_allreduce.py: the collective choice, and on GPUs the real path.

CPU: the path declines on every rank together (no hang) and leaves ``comm`` on the
group's own all-reduce; ``CVLLM_ALLREDUCE`` is checked. GPU (2 or more peer-connected
GPUs): one spawned process per GPU with NCCL; ``maybe_enable`` must take the path, then
the kernel test's sequence of calls (tests/kernels/test_allreduce.py: sums equal the
float32 reference bit for bit, the fused norm within bf16 rounding) runs eagerly, then a
CUDA graph of a plain and a fused call is replayed between eager calls of other sizes
(the state lives on the device) and each replay is checked.
"""

from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cvllm.distributed import custom_allreduce
from cvllm.distributed.launch_env import find_free_port_pair
from cvllm.utils import tuning
from cvllm.kernels.reference.norms import all_reduce_ref, all_reduce_rms_norm_ref
from tests.kernels.test_allreduce import EPS, run_cases


def _spawn(target, world: int, args, timeout: float = 240):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = find_free_port_pair()
    procs = [ctx.Process(target=target, args=(r, world, port, q) + args) for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = dict(q.get(timeout=timeout) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return got, [p.exitcode for p in procs]


def _cpu_rank(rank: int, world: int, port: int, q, env_value: str) -> None:
    os.environ["CVLLM_ALLREDUCE"] = env_value
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        ok = custom_allreduce.maybe_enable(dist.group.WORLD, dist.group.WORLD,
                                           torch.device("cpu"), rank, world, single_node=True)
        q.put((rank, (ok, custom_allreduce.active() is None)))
    except Exception as e:
        q.put((rank, repr(e)))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("env_value", ["", "auto", "nccl"])
def test_declines_on_cpu_on_every_rank(env_value):
    got, codes = _spawn(_cpu_rank, 2, (env_value,), timeout=60)
    assert got == {0: (False, True), 1: (False, True)}
    assert codes == [0, 0]


def test_required_custom_path_fails_clearly_on_cpu():
    got, _ = _spawn(_cpu_rank, 2, ("custom",), timeout=60)
    for msg in got.values():
        assert "CVLLM_ALLREDUCE=custom" in msg and "not CUDA" in msg


def test_choice_is_checked():
    with tuning.configure(tuning.from_environ({})):
        assert custom_allreduce.choice() == "auto"
    with tuning.configure(tuning.from_environ({"CVLLM_ALLREDUCE": "NCCL"})):
        assert custom_allreduce.choice() == "nccl"
        assert "CVLLM_ALLREDUCE=nccl" in custom_allreduce._local_reason(
            None, torch.device("cuda", 0), 2, True)
    with pytest.raises(ValueError, match="auto, custom, nccl"):
        tuning.from_environ({"CVLLM_ALLREDUCE": "symm"})
    with tuning.configure(tuning.from_environ({"CVLLM_ALLREDUCE": "auto"})):
        assert custom_allreduce._local_reason(None, torch.device("cpu"), 2, True) == "not CUDA"
        assert "several nodes" in custom_allreduce._local_reason(
            None, torch.device("cuda", 0), 2, False)


class _FakeImpl:
    """Stands in for CustomAllReduce on the CPU: records the collective steps it reaches;
    ``fail`` names the step that goes wrong on rank 1 (raise, or a wrong sum)."""

    def __init__(self, group, device, rank, world, fail):
        self.rank, self.fail, self.calls = rank, fail, 0
        if fail == "build" and rank == 1:
            raise RuntimeError("out of memory")

    def exchange(self):
        if self.fail == "exchange" and self.rank == 1:
            raise RuntimeError("rendezvous failed")

    def all_reduce(self, x):
        self.calls += 1
        wrong = self.fail == "sum" and self.rank == 1 and self.calls == 1
        return torch.full_like(x, 99.0 if wrong else 3.0)  # 1 + 2 over two ranks

    def all_reduce_rms_norm(self, x, res, w, eps):
        self.calls += 1
        res.fill_(4.0)
        return torch.full_like(x, 2.0), res


def _failing_rank(rank: int, world: int, port: int, q, fail: str) -> None:
    os.environ["CVLLM_ALLREDUCE"] = "auto"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    made = []
    custom_allreduce._local_reason = lambda *a: ""
    custom_allreduce.CustomAllReduce = lambda *a: made.append(_FakeImpl(*a, fail)) or made[-1]
    torch.cuda.synchronize = lambda *a: None
    try:
        ok = custom_allreduce.maybe_enable(dist.group.WORLD, dist.group.WORLD,
                                           torch.device("cpu"), rank, world, single_node=True)
        q.put((rank, (ok, made[0].calls if made else None)))
    except Exception as e:
        q.put((rank, repr(e)))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("fail", ["build", "exchange", "sum", "none"])
def test_a_failing_rank_leaves_every_rank_on_nccl_without_a_hang(fail):
    got, codes = _spawn(_failing_rank, 2, (fail,), timeout=60)
    assert codes == [0, 0]
    if fail == "none":
        assert got == {0: (True, 5), 1: (True, 5)}
    elif fail == "sum":  # every test call is still made on both ranks (no peer left waiting)
        assert got == {0: (False, 5), 1: (False, 5)}
    else:  # the later collective steps are never entered
        assert got[0] == (False, 0) and got[1][0] is False


# ------------------------------------------------------------------------------ GPU
def _graph_check(impl, rank: int, world: int, dev) -> None:
    """A CUDA graph of one plain and one fused call, replayed between eager calls."""
    n = 4096
    w = (1 + 0.1 * torch.randn(n, generator=torch.Generator().manual_seed(7))).to(torch.bfloat16)
    sx = torch.zeros(2, n, dtype=torch.bfloat16, device=dev)  # [2, N] static input
    sres = torch.zeros(2, n, dtype=torch.bfloat16, device=dev)
    wd = w.to(dev)
    impl.all_reduce(sx.view(-1))  # compile both variants before capture
    impl.all_reduce_rms_norm(sx, sres.clone(), wd, EPS)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        flat_out = impl.all_reduce(sx.view(-1))
        norm_out, _ = impl.all_reduce_rms_norm(sx, sres, wd, EPS)
    for it in range(5):
        gen = torch.Generator().manual_seed(50 + it)
        parts = [torch.randn(2, n, generator=gen).to(torch.bfloat16) for _ in range(world)]
        residual = torch.randn(2, n, generator=gen).to(torch.bfloat16)
        sx.copy_(parts[rank])
        sres.copy_(residual)
        g.replay()
        assert torch.equal(flat_out.view(2, n).cpu(), all_reduce_ref(parts)), f"replay {it}"
        want_out, want_res = all_reduce_rms_norm_ref(parts, residual, w, EPS)
        assert torch.equal(sres.cpu(), want_res), f"replay {it}: residual"
        torch.testing.assert_close(norm_out.cpu().float(), want_out.float(), rtol=1e-2,
                                   atol=1e-2)
        eager = [torch.full((3 + it,), float(r + it), dtype=torch.bfloat16) for r in range(world)]
        got = impl.all_reduce(eager[rank].to(dev)).cpu()
        assert torch.equal(got, all_reduce_ref(eager)), f"eager call after replay {it}"


def _graph_push_check(impl, rank: int, world: int, dev) -> None:
    """A CUDA graph of a pushed gated GEMV (8B down shape at TP=world) and the fused
    all-reduce that sums it, replayed with new inputs: equal to the reference over the
    unpushed GEMV's outputs of every rank."""
    from cvllm.kernels.gemv import gemv

    n, k = 4096, 14336 // world
    gen = torch.Generator().manual_seed(11)
    ws = [(torch.randn(n, k, generator=gen) / k ** 0.5).to(torch.bfloat16) for _ in range(world)]
    wn = (1 + 0.1 * torch.randn(n, generator=gen)).to(torch.bfloat16)
    w_dev, wn_dev = ws[rank].to(dev), wn.to(dev)
    sx = torch.zeros(1, 2 * k, dtype=torch.bfloat16, device=dev)  # [1, 2K] gate_up row
    sres = torch.zeros(1, n, dtype=torch.bfloat16, device=dev)

    def step():
        y = gemv(sx, w_dev, act="silu", push=impl.push_target(n, torch.bfloat16))
        impl.mark_pushed(y)
        return impl.all_reduce_rms_norm(y, sres, wn_dev, EPS)[0]

    step()  # compile before capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step()
    for it in range(4):
        xs = [torch.randn(1, 2 * k, generator=gen).to(torch.bfloat16) for _ in range(world)]
        residual = torch.randn(1, n, generator=gen).to(torch.bfloat16)
        parts = [gemv(xr.to(dev), wr.to(dev), act="silu").cpu() for xr, wr in zip(xs, ws)]
        sx.copy_(xs[rank])
        sres.copy_(residual)
        g.replay()
        want_out, want_res = all_reduce_rms_norm_ref(parts, residual, wn, EPS)
        assert torch.equal(sres.cpu(), want_res), f"pushed replay {it}: residual"
        torch.testing.assert_close(out.cpu().float(), want_out.float(), rtol=1e-2, atol=1e-2)


def _gpu_rank(rank: int, world: int, port: int, q) -> None:
    msg = "ok"
    try:
        os.environ["CVLLM_ALLREDUCE"] = "custom"
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        dev = torch.device("cuda", rank)
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        cpu = dist.new_group(backend="gloo")
        assert custom_allreduce.maybe_enable(dist.group.WORLD, cpu, dev, rank, world, True)
        impl = custom_allreduce.active()
        run_cases(rank, world, torch.bfloat16, dev, impl)
        _graph_check(impl, rank, world, dev)
        _graph_push_check(impl, rank, world, dev)
        torch.cuda.synchronize()
    except BaseException:
        msg = traceback.format_exc()
    q.put((rank, msg))
    q.close()
    q.join_thread()
    os._exit(0)  # NCCL teardown can wait on peers that already left


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_gpu_custom_path_matches_reference(world):
    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    got, _ = _spawn(_gpu_rank, world, (), timeout=240)
    assert got == {r: "ok" for r in range(world)}, got
