"""GGUF block-quantized linears on the GPU (``kernels/quant/ggml_cuda.py``) against bf16.

Usage::

    PYTHONPATH=. python tools/bench_ggml.py --out docs/benchmarks/ggml-h100.json
    PYTHONPATH=. python tools/bench_ggml.py --types Q4_K --sweep   # tile/path sweep too

For each GGML type, each weight shape of the 8B Llama decoder and each row count M, the
planned ``linear`` (``choose_path`` and the tile plans) is timed, with ``F.linear`` on a
bf16 weight of the same shape (cuBLAS) and, at M = 1, ``kernels/gemv.py``. Reported: the
time, the weight bytes streamed per second (the quantized bytes of the split layout,
``CudaGgmlWeight.nbytes``; at M = 1 this is the roofline figure), TFLOP/s (2 M N K / t),
and the same run's ceilings: device-to-device copy bandwidth and a large bf16 matmul.

Every figure is device time: the calls are captured in a CUDA graph and replayed (median
of 15 replays; host overhead, which a Triton launch of this many arguments makes tens of
microseconds, stays out, as in the engine's graphs). Up to M = 64 the weights rotate over
enough copies (more than 512 MiB together) that every call reads them from HBM, as in a
model step; from M = 256 (compute-bound) over 4 copies. ``--sweep`` also times the
candidate configs of each path (``candidates``) and the dense path, for choosing the
plans; ``--warm`` only calls each once (compiling it into Triton's cache: run several
such processes in parallel first, the compiles dominate a cold run). Rows are written to
``--out`` as they are measured, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

L2_DEFEAT_BYTES = 512 << 20
SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336), "lm_head": (128256, 4096)}
WARM_ONLY = False
"""``--warm``: call every candidate once (compiling it into Triton's cache), time nothing."""


def _ms(calls: List[Callable[[], Any]], m: int) -> float:
    """Median ms per call of ``calls`` replayed from one CUDA graph (device time: launch
    gaps as in the engine's graphs, no host overhead in the figure)."""
    if WARM_ONLY:
        calls[0]()
        return float("nan")
    from bench_kernels import graph_ms_per_call

    return graph_ms_per_call(calls)


def _copies(nbytes: int, m: int) -> int:
    """Weight copies that rotate: past the L2 for small M (a weight stream); fewer for
    large M, compute-bound, where the graph would hold a dense scratch per call."""
    return 1 if WARM_ONLY else max(2, min(-(-L2_DEFEAT_BYTES // nbytes), 4 if m >= 256 else 64))


def _weights(t, n: int, k: int, copies: int):
    import torch

    from cvllm.kernels.quant import ggml_cuda as gc
    from tests.kernels.test_ggml_cuda import random_raw

    out = []
    for i in range(copies):
        raw = random_raw(t, n, k, seed=i, device="cuda")
        out.append(gc.prepare(raw, t))
        del raw
    torch.cuda.synchronize()
    return out


_GEMV_SWEEP = [  # (BN, BK, num_warps, prefetch) at M = 1
    (8, 4096, 4, False), (8, 4096, 8, False), (4, 4096, 4, False), (4, 4096, 2, False),
    (2, 4096, 2, False), (16, 4096, 8, False), (16, 4096, 16, False), (8, 2048, 4, True),
    (8, 2048, 4, False), (4, 2048, 4, True), (4, 2048, 2, True), (8, 2048, 8, True),
    (16, 2048, 8, True), (8, 1024, 4, True), (8, 1024, 2, True), (4, 1024, 2, True)]
_MM64_SWEEP = [  # (BM, BN, BK, num_warps, num_stages, GROUP_M, SPLIT) at M = 64
    (64, 64, 128, 4, 3, 8, 1), (64, 64, 128, 4, 3, 8, 2), (64, 64, 128, 4, 3, 8, 4),
    (64, 64, 128, 4, 3, 8, 8), (64, 64, 256, 4, 3, 8, 2), (64, 64, 256, 4, 3, 8, 4),
    (64, 64, 128, 4, 2, 8, 4), (64, 64, 128, 4, 4, 8, 4), (64, 64, 128, 8, 3, 8, 4),
    (64, 64, 64, 4, 3, 8, 4), (64, 128, 128, 4, 3, 8, 1), (64, 128, 128, 4, 3, 8, 2),
    (64, 128, 128, 8, 3, 8, 1), (64, 128, 128, 8, 3, 8, 2), (64, 128, 64, 4, 3, 8, 1),
    (64, 128, 64, 4, 4, 8, 2), (64, 128, 256, 8, 3, 8, 1), (64, 256, 128, 8, 3, 8, 1)]


_GEMV_I8_SWEEP = [  # (BN, BK, num_warps, prefetch) of the int8 GEMV (4-bit; Q8_0 halves BK)
    (16, 2048, 4, False), (8, 2048, 4, False), (16, 4096, 4, False), (8, 4096, 4, False),
    (8, 2048, 2, False), (4, 4096, 2, False), (4, 2048, 2, True), (8, 1024, 2, True),
    (16, 4096, 8, False), (32, 4096, 8, False), (16, 1024, 4, True), (4, 4096, 4, False)]


def _i8_order(c: tuple) -> tuple:
    return c[1], c[0], c[2], c[3]


def candidates(m: int, int8: bool = False, wps: int = 4) -> List[tuple]:
    """``(path, config)`` pairs timed by ``--sweep`` at ``m`` rows (``int8``: Q4_0 / Q4_1
    / Q4_K / Q8_0, which also have the int8 GEMV; ``wps`` 8 for Q8_0, whose K steps are
    halved to hold as many words)."""
    if m == 1:
        i8 = sorted({(bn, max(32, bk * 4 // wps), w, p) for bn, bk, w, p in _GEMV_I8_SWEEP},
                    key=_i8_order)
        return [("gemv", c) for c in _GEMV_SWEEP] + ([("gemv_i8", c) for c in i8]
                                                     if int8 else [])
    if m == 2:
        return [("gemv", c) for c in [(8, 4096, 4, False), (16, 4096, 4, False),
                                      (8, 2048, 4, True), (16, 2048, 4, True)]] + [
            ("mm", (16, 64, 256, 4, 3, 8, s)) for s in (2, 4)]
    if m <= 16:
        return [("mm", c) for c in [
            (16, 64, 256, 4, 3, 8, 2), (16, 64, 256, 4, 3, 8, 4), (16, 64, 256, 4, 3, 8, 8),
            (16, 32, 256, 4, 3, 8, 4), (16, 32, 256, 4, 3, 8, 8), (16, 128, 256, 4, 3, 8, 2),
            (16, 128, 256, 4, 3, 8, 4)]]
    if m <= 64:
        return [("mm", c) for c in _MM64_SWEEP] + [("dense", None)]
    if m <= 256:
        return [("mm", c) for c in [
            (128, 128, 64, 8, 3, 8, 1), (128, 128, 64, 8, 3, 8, 2), (128, 64, 128, 4, 3, 8, 1),
            (64, 128, 128, 4, 3, 8, 1), (128, 128, 128, 8, 3, 8, 1)]] + [("dense", None)]
    return [("mm", c) for c in [(128, 128, 64, 8, 3, 8, 1), (128, 256, 64, 8, 3, 8, 1),
                                (128, 128, 128, 8, 4, 8, 1)]] + [("dense", None)]


_BF16: Dict[tuple, Dict[str, float]] = {}
"""(shape, M) -> the bf16 baselines, measured once for all types."""


def _bf16_baseline(shape: str, m: int, x, bf) -> Dict[str, float]:
    import torch.nn.functional as F

    from cvllm.kernels import gemv as bf16_gemv

    if (shape, m) not in _BF16:
        n, k = SHAPES[shape]
        b_ms = _ms([lambda w=w: F.linear(x, w) for w in bf], m)
        out = dict(bf16_cublas_us=b_ms * 1e3, bf16_cublas_GBps=n * k * 2 / b_ms / 1e6,
                   bf16_cublas_TFLOPs=2 * m * n * k / b_ms / 1e9)
        if m == 1:
            g_ms = _ms([lambda w=w: bf16_gemv.gemv(x, w) for w in bf], m)
            out.update(bf16_gemv_us=g_ms * 1e3, bf16_gemv_GBps=n * k * 2 / g_ms / 1e6)
        _BF16[(shape, m)] = out
    return _BF16[(shape, m)]


def bench_type(tname: str, ms: List[int], shapes: List[str], sweep_shapes: List[str],
               emit: Callable[[Dict[str, Any]], None]) -> None:
    import torch
    import torch.nn.functional as F

    from cvllm.kernels.quant import ggml_cuda as gc
    from cvllm.kernels.quant.ggml_types import GgmlType

    t = GgmlType[tname]
    for shape in shapes:
        n, k = SHAPES[shape]
        probe = _weights(t, n, k, 1)[0]
        qbytes = probe.nbytes()
        all_ws = [probe] + _weights(t, n, k, _copies(qbytes, min(ms)) - 1)
        nbf = 0 if WARM_ONLY or all((shape, m) in _BF16 for m in ms) else _copies(n * k * 2, 1)
        all_bf = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                  for _ in range(nbf)]
        for m in ms:
            ws, bf = all_ws[:_copies(qbytes, m)], all_bf[:_copies(n * k * 2, m)]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            flops = 2 * m * n * k
            row: Dict[str, Any] = {"type": tname, "shape": shape, "N": n, "K": k, "M": m,
                                   "quant_bytes": qbytes, "path": gc.choose_path(m, probe.spec)}
            want = F.linear(x, gc.dequantize(probe, torch.bfloat16)).float()
            got = gc.linear(x, probe).float()
            row["rel_err_vs_bf16_dense"] = ((got - want).norm() / want.norm()).item()
            t_ms = _ms([lambda w=w: gc.linear(x, w) for w in ws], m)
            row.update(us=t_ms * 1e3, GBps=qbytes / t_ms / 1e6, TFLOPs=flops / t_ms / 1e9)
            if not WARM_ONLY:
                row.update(_bf16_baseline(shape, m, x, bf))
                row["speedup_vs_bf16"] = row["bf16_cublas_us"] / row["us"]
            if shape in sweep_shapes:
                row["sweep"] = _sweep(x, ws, m, want)
            emit(row)
        del ws, bf, all_ws, all_bf
        torch.cuda.empty_cache()


def _sweep(x, ws, m: int, want) -> List[Dict[str, Any]]:
    """Every candidate path/config at this M: time and error, fastest first."""
    from cvllm.kernels.quant import ggml_cuda as gc

    spec = ws[0].spec
    cands = candidates(m, gc.takes_int8_gemv(spec), spec.sb * spec.lb // 32)
    out = []
    for path, cfg in cands:
        try:
            got = gc.linear(x, ws[0], path=path, config=cfg).float()
            err = ((got - want).norm() / want.norm()).item()
            t_ms = _ms([lambda w=w: gc.linear(x, w, path=path, config=cfg) for w in ws], m)
        except Exception as e:  # a config the compiler refuses (registers, smem)
            out.append({"path": path, "config": cfg, "error": str(e)[:160]})
            continue
        out.append({"path": path, "config": cfg, "us": t_ms * 1e3, "rel_err": err})
    out.sort(key=lambda r: r.get("us", 1e30))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--types", default="Q4_K,Q6_K,Q8_0,Q4_0,Q4_1,Q5_K,Q5_0,Q5_1,Q2_K,Q3_K,"
                    "IQ4_NL,IQ4_XS")
    ap.add_argument("--ms", default="1,16,64,256,2048")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--sweep", action="store_true", help="also time every candidate config")
    ap.add_argument("--sweep-types", default="", help="types swept (default: --types)")
    ap.add_argument("--sweep-shapes", default="", help="shapes swept (default: --shapes)")
    ap.add_argument("--warm", action="store_true", help="compile every candidate, time nothing")
    args = ap.parse_args()
    import torch

    import bench_measure as bmeas

    if not torch.cuda.is_available():
        print("bench_ggml needs a CUDA device", file=sys.stderr)
        return 2
    global WARM_ONLY
    WARM_ONLY = args.warm
    dev = torch.device("cuda")
    res: Dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "command": "tools/bench_ggml.py " + " ".join(sys.argv[1:]),
        "copy_GBps": 0.0 if WARM_ONLY else bmeas.copy_rate(dev, 1 << 30, True) / 1e9,
        "bf16_matmul_TFLOPs": (0.0 if WARM_ONLY else
                               bmeas.matmul_rate(dev, 8192, torch.bfloat16, True) / 1e12),
        "rows": [],
    }
    print(f"{res['device']}: copy {res['copy_GBps']:.0f} GB/s, bf16 matmul "
          f"{res['bf16_matmul_TFLOPs']:.0f} TFLOP/s", flush=True)

    def emit(row: Dict[str, Any]) -> None:
        res["rows"].append(row)
        if WARM_ONLY:
            return
        best = row.get("sweep", [{}])[0] if row.get("sweep") else {}
        print(f"{row['type']:6s} {row['shape']:8s} M={row['M']:5d} {row['path']:5s} "
              f"{row['us']:8.1f} us {row['GBps']:6.0f} GB/s {row['TFLOPs']:6.1f} TF | bf16 "
              f"{row['bf16_cublas_us']:8.1f} us x{row['speedup_vs_bf16']:.2f}"
              + (f" | gemv16 {row['bf16_gemv_us']:.1f} us" if "bf16_gemv_us" in row else "")
              + (f" | best {best.get('path')} {best.get('config')} {best.get('us', 0):.1f} us"
                 if best else "") + f" err {row['rel_err_vs_bf16_dense']:.1e}", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)

    sweep_types = set(args.sweep_types.split(",")) if args.sweep_types else None
    start = time.time()
    for tname in args.types.split(","):
        sweep = args.sweep and (sweep_types is None or tname in sweep_types)
        shapes = args.shapes.split(",")
        swept = (args.sweep_shapes.split(",") if args.sweep_shapes else shapes) if sweep else []
        bench_type(tname, [int(m) for m in args.ms.split(",")], shapes, swept, emit)
    print(f"done in {time.time() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
