"""The symmetric-memory all-reduce's collective choice: on the CPU, and by default, the
path must decline on every rank without a hang and leave ``comm`` on the group's own
all-reduce. (On GPUs it was exercised through ``cvllm serve`` and tests/e2e/test_tp_bf16.py
with ``CVLLM_ALLREDUCE=symm``; see the module's docstring.)
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cvllm.distributed import symm_allreduce
from cvllm.distributed.launch_env import find_free_port_pair


def _cpu_rank(rank: int, world: int, port: int, env_value: str, q) -> None:
    os.environ["CVLLM_ALLREDUCE"] = env_value
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        ok = symm_allreduce.maybe_enable(dist.group.WORLD, dist.group.WORLD,
                                         torch.device("cpu"), rank, world, single_node=True)
        q.put((rank, ok, symm_allreduce.active() is None))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("env_value", ["", "nccl", "symm"])
def test_declines_on_cpu_on_every_rank(env_value):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = find_free_port_pair()
    procs = [ctx.Process(target=_cpu_rank, args=(r, 2, port, env_value, q)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert all(p.exitcode == 0 for p in procs)
    got = sorted(q.get(timeout=5) for _ in procs)
    assert got == [(0, False, True), (1, False, True)]


def test_local_reason_names_the_cause(monkeypatch):
    monkeypatch.delenv("CVLLM_ALLREDUCE", raising=False)
    assert "CVLLM_ALLREDUCE" in symm_allreduce._local_reason(None, torch.device("cuda", 0), 2, True)
    monkeypatch.setenv("CVLLM_ALLREDUCE", "nccl")
    assert "CVLLM_ALLREDUCE" in symm_allreduce._local_reason(None, torch.device("cuda", 0), 2, True)
    monkeypatch.setenv("CVLLM_ALLREDUCE", "symm")
    assert symm_allreduce._local_reason(None, torch.device("cpu"), 2, True) == "not CUDA"
    assert "several nodes" in symm_allreduce._local_reason(None, torch.device("cuda", 0), 2, False)
