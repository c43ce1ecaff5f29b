"""Kernel-level timings behind the batch-1 decode step, on a CUDA machine.

Usage::

    PYTHONPATH=. python tools/bench_kernels.py --out docs/benchmarks/kernels-h100.json

Two tables:

- ``gemv``: each weight shape of the 8B Llama decoder (and its tensor-parallel halves) at
  one input row, through ``F.linear`` (cuBLAS) and through ``kernels/gemv.py`` with its
  shape plan and with every candidate config, as achieved weight bytes per second. The
  weights rotate over enough copies (more than 4x the L2) that every call reads from
  HBM, as in a real step; calls are replayed from a CUDA graph so launch gaps are the
  graph's, as in the engine.
- ``decode_attention``: one decode token of one sequence (32 query / 8 KV heads, head
  dim 128) over a range of context lengths: the planned splits with the merge as a
  second kernel and fused into the decode kernel, and several fixed split lengths.

Also the same run's device-to-device copy bandwidth (``bench_measure.copy_rate``), the
ceiling the GEMV rates are compared with.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any, Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

L2_DEFEAT_BYTES = 512 << 20

SHAPES = {  # name -> (N, K) of the 8B Llama-3.1 shape
    "qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
    "down": (4096, 14336), "lm_head": (128256, 4096),
    "qkv/tp2": (3072, 4096), "o_proj/tp2": (4096, 2048), "gate_up/tp2": (14336, 4096),
    "down/tp2": (4096, 7168), "lm_head/tp2": (64128, 4096),
}


def graph_ms_per_call(calls: List[Callable[[], Any]], reps: int = 15) -> float:
    """Median ms per call of ``calls`` captured back to back in one CUDA graph."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls[:2]:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    del graph
    return statistics.median(times)


def candidate_configs() -> List[tuple]:
    out = []
    for bn in (2, 4, 8, 16, 32):
        for bk in (128, 256, 512, 1024, 2048):
            if not 512 <= bn * bk <= 16384:
                continue
            for warps in (2, 4, 8):
                if bn * bk // (32 * warps) < 4:
                    continue
                out.append((bn, bk, warps))
    return out


def bench_gemv(names: List[str], sweep: bool) -> List[Dict[str, Any]]:
    import torch
    import torch.nn.functional as F

    from cvllm.kernels import gemv as g

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for name in names:
        n, k = SHAPES[name]
        nbytes = n * k * 2
        copies = max(2, -(-L2_DEFEAT_BYTES // nbytes))
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        want = F.linear(x, ws[0]).float()
        row: Dict[str, Any] = {"shape": name, "N": n, "K": k, "weight_bytes": nbytes}

        def rate(ms: float) -> float:
            return nbytes / (ms * 1e-3) / 1e9

        ms = graph_ms_per_call([lambda w=w: F.linear(x, w) for w in ws])
        row["cublas_us"], row["cublas_GBps"] = ms * 1e3, rate(ms)
        planned = g.plan(n, k, sms)
        configs = candidate_configs() if sweep else []
        if planned not in configs:
            configs.append(planned)
        results = []
        for cfg in configs:
            try:
                got = g.gemv(x, ws[0], config=cfg).float()
                err = (got - want).abs().max().item()
                ms = graph_ms_per_call([lambda w=w, c=cfg: g.gemv(x, w, config=c) for w in ws])
            except Exception as e:  # a config the compiler refuses (registers, smem)
                results.append({"config": list(cfg), "error": str(e)[:120]})
                continue
            results.append({"config": list(cfg), "us": ms * 1e3, "GBps": rate(ms),
                            "max_abs_err_vs_cublas": err})
        ok = [r for r in results if "us" in r]
        ok.sort(key=lambda r: r["us"])
        row["planned"] = next(r for r in results if tuple(r["config"]) == planned)
        row["best"] = ok[0] if ok else None
        row["top5"] = ok[:5]
        print(f"{name:12s} cublas {row['cublas_GBps']:7.0f} GB/s  planned {planned} "
              f"{row['planned'].get('GBps', 0):7.0f}  best {row['best']['config']} "
              f"{row['best']['GBps']:7.0f}", flush=True)
        rows.append(row)
        del ws
        torch.cuda.empty_cache()
    return rows


def bench_decode_attention(contexts: List[int], splits_len: List[int]) -> List[Dict[str, Any]]:
    import torch

    from cvllm.kernels import paged_attention as pa

    dev = torch.device("cuda")
    heads, kv_heads, d, bs = 32, 8, 128, 16
    rows = []
    max_ctx = max(contexts)
    blocks = -(-max_ctx // bs)
    layers = 32  # distinct caches so the KV is read from HBM as in a step
    kc = [torch.randn(blocks, bs, kv_heads, d, device=dev, dtype=torch.bfloat16)
          for _ in range(layers)]
    vc = [torch.randn_like(c) for c in kc]
    table = torch.arange(blocks, device=dev, dtype=torch.int32).view(1, -1)
    q = torch.randn(1, heads, d, device=dev, dtype=torch.bfloat16)
    for ctx in contexts:
        seq_lens = torch.tensor([ctx], device=dev, dtype=torch.int32)
        plans = [("planned", {}), ("planned, merge fused", {"fused_merge": True})] + [
            (f"split {s}", {"num_splits": max(1, -(-max_ctx // s))}) for s in splits_len]
        for label, kwargs in plans:
            try:
                ms = graph_ms_per_call([
                    lambda i=i: pa.decode_attention(q, kc[i], vc[i], table, seq_lens,
                                                    scale=d ** -0.5, max_seq_len=max_ctx,
                                                    **kwargs)
                    for i in range(layers)])
            except TypeError as e:
                print("decode_attention signature:", e)
                return rows
            rows.append({"context": ctx, "plan": label, "us_per_layer": ms * 1e3})
            print(f"decode ctx {ctx:5d} {label:34s} {ms * 1e3:6.2f} us", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--no-sweep", action="store_true", help="time only the planned config")
    ap.add_argument("--no-gemv", action="store_true", help="skip the GEMV table")
    ap.add_argument("--contexts", default="128,512,1024,2048")
    ap.add_argument("--split-lens", default="32,64,128,256")
    args = ap.parse_args()
    import torch

    import bench_measure as bmeas

    if not torch.cuda.is_available():
        print("bench_kernels needs a CUDA device", file=sys.stderr)
        return 2
    res: Dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "command": "tools/bench_kernels.py " + " ".join(sys.argv[1:]),
        "copy_GBps": bmeas.copy_rate(torch.device("cuda"), 1 << 30, True) / 1e9,
    }
    print(f"copy {res['copy_GBps']:.0f} GB/s", flush=True)
    if not args.no_gemv:
        res["gemv"] = bench_gemv(args.shapes.split(","), not args.no_sweep)
    res["decode_attention"] = bench_decode_attention(
        [int(c) for c in args.contexts.split(",")], [int(s) for s in args.split_lens.split(",")])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
