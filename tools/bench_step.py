#!/usr/bin/env python3
"""Where a decode step's time goes: GPU forward, LM head + sampler, host work, idle gap.

    PYTHONPATH=. python tools/bench_step.py --batches 1,64          # 8B shape, random bf16
    PYTHONPATH=. python tools/bench_step.py --tiny --cpu --batches 1  # smoke test
    PYTHONPATH=. torchrun --nproc-per-node 2 tools/bench_step.py --tp 2   # TP=2, rank 0's view

For each batch it runs B random prompts into steady decode through the engine, then:
- ``engine_step_ms``: wall time of ``LLMEngine.step()`` (median of the window);
- ``graph_replay_ms``: the decode CUDA graph of that size (forward and LM head) replayed
  back to back: pure GPU time, no host work in between, CUDA events;
- ``host_ms``: schedule + build_step_input + update + detokenize, timed on the host with
  the GPU idle (the part an overlapped loop hides);
- the top CUDA kernels of one engine step (``torch.profiler``), to see whether the GEMVs
  run at the copy bandwidth.
With ``--tp N`` (under torchrun) every rank runs the engine's SPMD job
(``runtime/job.run_job``) and rank 0 measures: the graph replay alone and the host-only
phases are skipped there (the other ranks would not follow), and the kernel table is rank 0's, all-reduce
waits included. JSON to ``--out``. A diagnostic, not a headline benchmark (that is
``tools/bench.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))

import bench_model as bm  # noqa: E402
from bench_measure import measure_ceilings, random_prompts  # noqa: E402


def cuda_ms(fn, reps: int) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def steady_decode(engine, batch: int, prompt_len: int, vocab: int, rng) -> List[str]:
    from cvllm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=100000, ignore_eos=True)
    ids = [f"s{batch}-{i}" for i in range(batch)]
    for rid, p in zip(ids, random_prompts(rng, batch, prompt_len, vocab)):
        engine.add_request(rid, p, params)
    while any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(5):
        engine.step()
    return ids


def host_phases(engine, reps: int) -> Dict[str, float]:
    """Host-only share of a step: schedule + build + update + outputs, with the model call
    replaced by the previous step's token ids (the GPU is idle meanwhile)."""
    from cvllm.core.step_builder import build_step_input

    engine.overlap = False
    engine.step()  # completes the step in flight: the scheduler is idle again
    sched, build, upd = [], [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = engine.scheduler.schedule()
        t1 = time.perf_counter()
        step = build_step_input(out, engine.block_size, engine.kv_layout.windows)
        t2 = time.perf_counter()
        seqs = [s.seq for s in out.scheduled if s.samples]
        sampled = {s.seq_id: 1 for s in seqs}
        engine.scheduler.update(out, sampled)
        engine._make_outputs(out, seqs, _Fake(len(seqs)))
        t3 = time.perf_counter()
        sched.append(t1 - t0), build.append(t2 - t1), upd.append(t3 - t2)
        del step
    engine.overlap = True
    med = lambda xs: 1000 * statistics.median(xs)  # noqa: E731
    return {"schedule_ms": med(sched), "build_step_input_ms": med(build),
            "update_and_outputs_ms": med(upd)}


class _Fake:
    def __init__(self, n: int):
        self.logprobs = None
        self.token_ids = [0] * n


def kernel_table(engine, top: int = 40) -> List[Dict[str, Any]]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            engine.step()
        torch.cuda.synchronize()
    rows = []
    for ev in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:top]:
        rows.append({"kernel": ev.key[:90], "calls_per_step": ev.count / 3,
                     "ms_per_step": ev.device_time_total / 3 / 1000})
    return rows


def measure(engine, batch: int, args, cfg, rng, tp: int = 1) -> Dict[str, Any]:
    import torch

    runner = engine.runner
    ids = steady_decode(engine, batch, args.prompt_len, int(cfg["vocab_size"]), rng)
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    res: Dict[str, Any] = {"batch": batch, "engine_step_ms": 1000 * statistics.median(times)}
    if tp == 1:  # it schedules steps that never run: the other ranks would see a gap
        res.update(host_phases(engine, 20))
    graphs = getattr(runner, "graphs", None)
    if tp > 1 and torch.cuda.is_available():
        res["top_kernels"] = kernel_table(engine)
    elif graphs is not None and graphs.graphs:
        bs = graphs.padded_size_for(batch) if hasattr(graphs, "padded_size_for") else \
            min(s for s in graphs.sizes if s >= batch)
        res["graph_replay_ms"] = cuda_ms(graphs.graphs[bs].replay, args.reps)
        if torch.cuda.is_available():
            res["top_kernels"] = kernel_table(engine)
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished():
        engine.step()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--tp", type=int, default=1, help="ranks (run under torchrun)")
    ap.add_argument("--isq", default=None, help="in-situ quantize the weights (q4k, q8_0, ...)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    use_cuda = torch.cuda.is_available() and not args.cpu
    cfg = bm.build_config(None, args.tiny, {})
    folder = bm.write_model_folder(Path(tempfile.mkdtemp(prefix="cvllm-step-")), cfg)
    batches = [int(b) for b in args.batches.split(",")]
    options = dict(weight_path=str(folder), load_format="dummy", cpu=not use_cuda,
                   dtype="bf16" if use_cuda else "f32", max_model_len=args.prompt_len + 2048,
                   max_num_seqs=max(batches), **({} if use_cuda else {"kvcache_mem_mb": 256}),
                   **({"isq": args.isq} if args.isq else {}))
    if args.tp == 1:
        from cvllm.engine.llm import LLM

        report(LLM(**options).engine, args, cfg, batches, use_cuda)
        return 0
    from cvllm.runtime.job import run_job
    from cvllm.runtime.spmd import ParallelOptions

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != args.tp:
        raise SystemExit(f"--tp {args.tp} needs {args.tp} ranks: run it under "
                         f"torchrun --nproc-per-node {args.tp} (WORLD_SIZE is {world})")
    run_job(ParallelOptions(device_ids=(0,), cpu=not use_cuda), options,
            lambda rank0: report(rank0.build_engine()[0], args, cfg, batches, use_cuda))
    return 0


def report(engine, args, cfg, batches: List[int], use_cuda: bool) -> None:
    import numpy as np
    import torch

    out: Dict[str, Any] = {"device": torch.cuda.get_device_name() if use_cuda else "cpu",
                           "tp": args.tp, "command": " ".join(sys.argv), "results": []}
    if use_cuda:
        out["ceilings"] = measure_ceilings(True, "bf16")
    rng = np.random.default_rng(0)
    for b in batches:
        r = measure(engine, b, args, cfg, rng, args.tp)
        out["results"].append(r)
        print(json.dumps(r, indent=1), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    sys.exit(main())
