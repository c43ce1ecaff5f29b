#!/usr/bin/env python3
"""Latency of one decoder all-reduce between the GPUs of one node: NCCL against the
custom one-shot kernel (distributed/custom_allreduce.py), plain and fused with the
residual add + RMSNorm; the separate add + RMSNorm kernel for comparison.

    PYTHONPATH=. python tools/bench_allreduce.py --world 2 --out docs/benchmarks/allreduce-h200x2.json

One spawned process per GPU. For each size (bf16 rows of ``--hidden``) and each op, a
CUDA graph of ``--calls`` back-to-back calls is replayed ``--reps`` times after warm-up;
the ranks start each timing together (a barrier). Reported: microseconds per call on
rank 0 (CUDA events), the median of the repetitions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _time_graph(fn: Callable[[], Any], calls: int, reps: int, barrier) -> float:
    import torch

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times: List[float] = []
    for _ in range(reps):
        barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(1000.0 * start.elapsed_time(end) / calls)
    return statistics.median(times)


def _rank(rank: int, world: int, port: int, args, q) -> None:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=dev)
    cpu = dist.new_group(backend="gloo")
    from cvllm.distributed import custom_allreduce
    from cvllm.kernels.rmsnorm import rms_norm

    custom_allreduce.maybe_enable(dist.group.WORLD, cpu, dev, rank, world, True)
    impl = custom_allreduce.active()

    def barrier():
        torch.cuda.synchronize()
        dist.barrier(group=cpu)

    rows_list = [int(r) for r in args.rows.split(",")]
    results: List[Dict[str, Any]] = []
    w = torch.ones(args.hidden, dtype=torch.bfloat16, device=dev)
    for rows in rows_list:
        x = torch.randn(rows, args.hidden, dtype=torch.bfloat16, device=dev)  # [R, N]
        res = torch.randn_like(x)
        row: Dict[str, Any] = {"rows": rows, "bytes": x.numel() * 2}
        row["nccl_us"] = _time_graph(lambda: dist.all_reduce(x), args.calls, args.reps, barrier)
        row["add_rmsnorm_us"] = _time_graph(lambda: rms_norm(x, w, 1e-5, res), args.calls,
                                            args.reps, barrier)
        if impl is not None and impl.accepts(x):
            row["custom_us"] = _time_graph(lambda: impl.all_reduce(x), args.calls, args.reps,
                                           barrier)
            row["custom_add_rmsnorm_us"] = _time_graph(
                lambda: impl.all_reduce_rms_norm(x, res, w, 1e-5), args.calls, args.reps,
                barrier)
        results.append(row)
    if rank == 0:
        q.put({"device": torch.cuda.get_device_name(dev), "world": world,
               "custom_enabled": impl is not None, "results": results})
    barrier()
    os._exit(0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--rows", default="1,4,16,64,128")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch.multiprocessing as mp

    from cvllm.distributed.launch_env import find_free_port_pair

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = find_free_port_pair()
    procs = [ctx.Process(target=_rank, args=(r, args.world, port, args, q))
             for r in range(args.world)]
    for p in procs:
        p.start()
    report = q.get(timeout=600)
    for p in procs:
        p.join(60)
    report["command"] = "python " + " ".join(sys.argv)
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
