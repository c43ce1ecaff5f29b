"""GGUF block-quantized linears on the GPU (``kernels/quant/ggml_cuda.py``) against bf16.

Usage::

    PYTHONPATH=. python tools/bench_ggml.py --out docs/benchmarks/ggml-h100.json
    PYTHONPATH=. python tools/bench_ggml.py --types Q4_K --sweep   # tile/path sweep too
    PYTHONPATH=. python tools/bench_ggml.py --types Q4_K --ms 64 --sweep --jobs 16
    # the tensor-core products (SWAP off / on x tiles) where they matter, one run:
    PYTHONPATH=. python tools/bench_ggml.py --sweep --jobs 16 --out ggml-mm-variants.json \
        --cases Q4_K:qkv,o_proj,gate_up,down:16,32,64,128 Q6_K:lm_head:64
    # the batch-1 int8 GEMV's tiles and K splits; the down projection as the model calls it
    PYTHONPATH=. python tools/bench_ggml.py --sweep --jobs 16 --paths gemv_i8 \
        --cases Q4_K:qkv,o_proj,gate_up,down:1
    PYTHONPATH=. python tools/bench_ggml.py --sweep --jobs 16 --paths gemv_i8 --gated \
        --prequant on --cases Q4_K:down:1

For each GGML type, each weight shape of the 8B Llama decoder and each row count M, the
planned ``linear`` (``choose_path`` and the tile plans) is timed (on the tensor-core path
also its tiles with the other product, ``swap_flipped_us``), with ``F.linear`` on a
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
such processes in parallel first, the compiles dominate a cold run; ``--jobs N`` does
that itself, N processes of one (type, shape, M) each, before it times anything). Rows
are written to ``--out`` as they are measured, so a run cut short keeps what it measured.
``--cases TYPE:SHAPES:MS ..`` runs each type on its own shapes and row counts instead of
the ``--types x --shapes x --ms`` product.

The tensor-core kernel's sweep (16 to 128 rows) crosses tiles near ``plan_mm``'s (BK 64 to
256, 4 or 8 warps, 2 to 4 stages) with both of ``ggml_mm_kernel``'s products (``SWAP``:
the weight as the dot's A operand): configs of eight values, K split as ``plan_mm`` would
split that tile (``_split_for``). A third variant, the weight tile left in its interleaved
K order with x loaded or permuted to match, was 5% to 4x slower everywhere on an H200
(docs/benchmarks/ggml-mm-variants-h200.json, its ``XPERM`` 1 / 2) and was removed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable, Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

L2_DEFEAT_BYTES = 512 << 20
SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336), "lm_head": (128256, 4096)}
WARM_ONLY = False
"""``--warm``: call every candidate once (compiling it into Triton's cache), time nothing."""
PART = (0, 1)
"""``--part i/n``: sweep only candidates ``i, i + n, ..`` (a ``--jobs`` warm-up process's
share)."""


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


_GEMV_I8_SWEEP = [  # (BN, BK, num_warps, prefetch[, split]) of the int8 GEMV (4-bit; Q8_0
    # halves BK), then K split over 2 to 8 programs (``SPLIT``) at the tiles that did best
    (16, 2048, 4, False), (8, 2048, 4, False), (16, 4096, 4, False), (8, 4096, 4, False),
    (8, 2048, 2, False), (4, 4096, 2, False), (4, 2048, 2, True), (8, 1024, 2, True),
    (16, 4096, 8, False), (32, 4096, 8, False), (16, 1024, 4, True), (4, 4096, 4, False)] + [
    (bn, bk, 4, False, split) for bn, bk in ((16, 2048), (8, 2048), (16, 1024), (8, 1024),
                                             (4, 2048), (16, 4096), (8, 4096))
    for split in (2, 4, 8)]
GEMV_I8_WIDE = [(bn, bk, warps, False, split)
                for bn, bk, warps in ((32, 1024, 4), (32, 2048, 4), (64, 512, 8), (64, 1024, 8))
                for split in (1, 2, 4, 8, 16)]
"""``--i8-wide``: 32 and 64 rows a program (x rounded once for more rows), K split 1 to
16 ways, in place of ``_GEMV_I8_SWEEP``."""
I8_WIDE = False
PREQUANT = None
"""``--prequant on|off``: the int8 GEMV's x rounded by its own kernel first (as the model's
gated down projection is) or by each program; None: as planned (``CVLLM_GGML_Q8_X``)."""
PATHS = None
"""``--paths``: sweep only these paths."""
GATED = False
"""``--gated``: at one row, x is a gate_up row ``[1, 2K]`` and the int8 GEMV applies SiLU
and the product on load (the model's down projection; ``ggml_cuda.linear(.., act=)``)."""


def _call(x, w, path=None, config=None, prequant=None):
    """``ggml_cuda.linear`` as the model calls it (``--gated``: with the activation)."""
    from cvllm.kernels.quant import ggml_cuda as gc

    act = "silu" if GATED and x.shape[0] == 1 else None
    return gc.linear(x, w, path=path, config=config, prequant=prequant, act=act)


def _i8_order(c: tuple) -> tuple:
    return c[1], c[0], c[2], c[3], c[4] if len(c) > 4 else 1


_MM_TILES = {  # rows up to -> (BM, BN, BK, num_warps, num_stages) crossed with the variants
    16: [(16, 64, 256, 4, 3), (16, 64, 128, 4, 3), (16, 64, 256, 4, 4), (16, 64, 256, 8, 3),
         (16, 128, 256, 8, 3)],
    32: [(32, 64, 128, 4, 3), (32, 64, 256, 4, 3), (32, 64, 128, 4, 4), (32, 64, 128, 8, 3),
         (32, 128, 128, 8, 3)],
    64: [(64, 64, 128, 4, 3), (64, 64, 256, 4, 3), (64, 64, 64, 4, 3), (64, 64, 128, 4, 2),
         (64, 64, 128, 4, 4), (64, 64, 128, 8, 3), (64, 128, 128, 4, 3), (64, 128, 64, 4, 3),
         (64, 128, 128, 8, 3), (64, 128, 64, 8, 4)],
    128: [(128, 64, 128, 4, 3), (128, 64, 128, 8, 3), (128, 64, 64, 4, 3),
          (128, 128, 64, 8, 3), (128, 128, 128, 8, 3), (64, 128, 128, 4, 3)],
}
"""Tiles around ``plan_mm``'s choice at each row count (its own first)."""
MM_VARIANTS = [False, True]
"""``SWAP`` of ``ggml_mm_kernel``."""


def _split_for(m: int, n: int, k: int, bm: int, bn: int, bk: int, num_sms: int) -> int:
    """K split for a tile, as ``plan_mm`` splits: the fewest (1, 2, 4, 8) whose programs
    cover the SMs, keeping at least two K steps a split."""
    tiles = -(-m // bm) * -(-n // bn)
    split = 1
    while split < 8 and tiles * split < num_sms:
        split *= 2
    while split > 1 and k // (bk * split) < 2:
        split //= 2
    return split


def mm_variant_candidates(m: int, n: int, k: int, sb: int = 32, num_sms: int = 132
                          ) -> List[tuple]:
    """``("mm", 8-tuple)`` for every tile of ``_MM_TILES`` at ``m`` rows (16 < m <= 128
    round up to 32, 64, 128) crossed with ``MM_VARIANTS``, K split by ``_split_for``."""
    bucket = next(b for b in sorted(_MM_TILES) if m <= b)
    out = []
    for bm, bn, bk, warps, stages in _MM_TILES[bucket]:
        bk = max(bk, sb)
        split = _split_for(m, n, k, bm, bn, bk, num_sms)
        out += [("mm", (bm, bn, bk, warps, stages, 8, split, swap)) for swap in MM_VARIANTS]
    return out


def candidates(m: int, int8: bool = False, wps: int = 4, n: int = 0, k: int = 0,
               sb: int = 32, num_sms: int = 132) -> List[tuple]:
    """``(path, config)`` pairs timed by ``--sweep`` at ``m`` rows (``int8``: Q4_0 / Q4_1
    / Q4_K / Q8_0 / Q6_K, which also have the int8 GEMV; ``wps`` 8 for Q8_0 and Q6_K,
    whose K steps are halved to hold about as many words). With the weight's shape ``n,
    k`` (and its sub-block ``sb``), 16 to 128 rows also sweep the tensor-core variants
    (``mm_variant_candidates``)."""
    variants = mm_variant_candidates(m, n, k, sb, num_sms) if n and 16 <= m <= 128 else []
    if m == 1:
        i8 = sorted({(c[0], max(32, c[1] * 4 // wps)) + tuple(c[2:])
                     for c in (GEMV_I8_WIDE if I8_WIDE else _GEMV_I8_SWEEP)}, key=_i8_order)
        return [("gemv", c) for c in _GEMV_SWEEP] + ([("gemv_i8", c) for c in i8]
                                                     if int8 else [])
    if m == 2:
        return [("gemv", c) for c in [(8, 4096, 4, False), (16, 4096, 4, False),
                                      (8, 2048, 4, True), (16, 2048, 4, True)]] + [
            ("mm", (16, 64, 256, 4, 3, 8, s)) for s in (2, 4)]
    if m <= 16:
        out = variants + [("mm", c) for c in [
            (16, 64, 256, 4, 3, 8, 2), (16, 64, 256, 4, 3, 8, 4), (16, 64, 256, 4, 3, 8, 8),
            (16, 32, 256, 4, 3, 8, 4), (16, 32, 256, 4, 3, 8, 8), (16, 128, 256, 4, 3, 8, 2),
            (16, 128, 256, 4, 3, 8, 4)]]
    elif m <= 32 and variants:
        out = variants + [("dense", None)]
    elif m <= 64:
        out = variants + [("mm", c) for c in _MM64_SWEEP] + [("dense", None)]
    elif m <= 256:
        out = variants + [("mm", c) for c in [
            (128, 128, 64, 8, 3, 8, 1), (128, 128, 64, 8, 3, 8, 2), (128, 64, 128, 4, 3, 8, 1),
            (64, 128, 128, 4, 3, 8, 1), (128, 128, 128, 8, 3, 8, 1)]] + [("dense", None)]
    else:
        out = [("mm", c) for c in [(128, 128, 64, 8, 3, 8, 1), (128, 256, 64, 8, 3, 8, 1),
                                   (128, 128, 128, 8, 4, 8, 1)]] + [("dense", None)]
    return _unique(out)


def _unique(cands: List[tuple]) -> List[tuple]:
    """``cands`` without repeats (a 7-tuple config is its 8-tuple with ``SWAP`` off)."""
    seen, out = set(), []
    for path, cfg in cands:
        key = (path, tuple(cfg) + (False,) if cfg is not None and len(cfg) == 7 else cfg)
        if key not in seen:
            seen.add(key)
            out.append((path, cfg))
    return out


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

    from cvllm.kernels.device import sms_of
    from cvllm.kernels.quant import ggml_cuda as gc
    from cvllm.kernels.quant import ggml_plan as gp
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
            xg = x
            if GATED and m == 1:  # a gate_up row whose act(gate) * up is the product's x
                from cvllm.kernels.reference.linear import act_and_mul_ref

                xg = torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16)
                x = act_and_mul_ref(xg, "silu")
            flops = 2 * m * n * k
            row: Dict[str, Any] = {"type": tname, "shape": shape, "N": n, "K": k, "M": m,
                                   "quant_bytes": qbytes, "path": gp.choose_path(m, probe.spec)}
            want = F.linear(x, gc.dequantize(probe, torch.bfloat16)).float()
            got = _call(xg, probe, prequant=PREQUANT).float()
            row["rel_err_vs_bf16_dense"] = ((got - want).norm() / want.norm()).item()
            t_ms = _ms([lambda w=w: _call(xg, w, prequant=PREQUANT) for w in ws], m)
            row.update(us=t_ms * 1e3, GBps=qbytes / t_ms / 1e6, TFLOPs=flops / t_ms / 1e9)
            if row["path"] == "mm":  # the planned tiles with the other product
                plan = gp.mm_config(None, m, n, k, probe.spec, sms_of(x), gc.has_wgmma(x))
                flip = plan[:7] + (not plan[7],)
                f_ms = _ms([lambda w=w: gc.linear(x, w, path="mm", config=flip) for w in ws], m)
                row.update(config=plan, swap_flipped_config=flip, swap_flipped_us=f_ms * 1e3)
            if not WARM_ONLY:
                row.update(_bf16_baseline(shape, m, x, bf))
                row["speedup_vs_bf16"] = row["bf16_cublas_us"] / row["us"]
            if shape in sweep_shapes:
                row["sweep"] = _sweep(xg, ws, m, want)
            emit(row)
        del ws, bf, all_ws, all_bf
        torch.cuda.empty_cache()


def _sweep(x, ws, m: int, want) -> List[Dict[str, Any]]:
    """Every candidate path/config at this M: time and error, fastest first."""
    from cvllm.kernels.device import sms_of
    from cvllm.kernels.quant import ggml_plan as gp

    spec = ws[0].spec
    n, k = ws[0].shape
    cands = candidates(m, gp.takes_int8_gemv(spec), gp.i8_plan_wps(spec), n, k, spec.sb,
                       sms_of(x))
    out = []
    cands = [c for c in cands if (PATHS is None or c[0] in PATHS)
             and not (GATED and m == 1 and c[0] != "gemv_i8")]
    for path, cfg in cands[PART[0]::PART[1]]:
        pq = PREQUANT if path == "gemv_i8" else None
        try:
            got = _call(x, ws[0], path=path, config=cfg, prequant=pq).float()
            err = ((got - want).norm() / want.norm()).item()
            t_ms = _ms([lambda w=w: _call(x, w, path=path, config=cfg, prequant=pq)
                        for w in ws], m)
        except Exception as e:  # a config the compiler refuses (registers, smem)
            out.append({"path": path, "config": cfg, "error": str(e)[:160]})
            continue
        out.append({"path": path, "config": cfg, "us": t_ms * 1e3, "rel_err": err})
    out.sort(key=lambda r: r.get("us", 1e30))
    return out


def parse_cases(cases: List[str]) -> List[Tuple[str, List[str], List[int]]]:
    """``TYPE:SHAPE,SHAPE:M,M`` strings -> ``(type, shapes, ms)``, checked."""
    out = []
    for case in cases:
        parts = case.split(":")
        if len(parts) != 3:
            raise SystemExit(f"--cases takes TYPE:SHAPES:MS; got {case!r}")
        tname, shapes, ms = parts[0], parts[1].split(","), [int(m) for m in parts[2].split(",")]
        bad = [sh for sh in shapes if sh not in SHAPES]
        if bad:
            raise SystemExit(f"unknown shapes {bad}; known: {list(SHAPES)}")
        out.append((tname, shapes, ms))
    return out


def warm_in_parallel(work, sweep_of, jobs: int, parts: int = 4) -> None:
    """Compile everything ``work`` will call into Triton's cache first, in ``jobs``
    processes at a time (``--warm``): one (type, shape, M) each, its sweep in ``parts``
    shares. The compiles (each about a second of one CPU core) would otherwise dominate,
    one after another, the timed run."""
    import subprocess

    cmds = []
    for tname, shapes, ms in work:
        for shape in shapes:
            swept = sweep_of(tname, shape)
            for m in ms:
                for i in range(parts if swept else 1):
                    cmds.append([sys.executable, os.path.abspath(__file__), "--warm",
                                 "--cases", f"{tname}:{shape}:{m}", "--part", f"{i}/{parts}"]
                                + (["--sweep"] if swept else [])
                                + ([] if PREQUANT is None else
                                   ["--prequant", "on" if PREQUANT else "off"])
                                + (["--gated"] if GATED else [])
                                + (["--i8-wide"] if I8_WIDE else [])
                                + (["--paths", ",".join(PATHS)] if PATHS else []))
    start, running, failed = time.time(), [], 0
    while cmds or running:
        while cmds and len(running) < jobs:
            running.append(subprocess.Popen(cmds.pop(0), stdout=subprocess.DEVNULL))
        time.sleep(0.2)
        for proc in [p for p in running if p.poll() is not None]:
            running.remove(proc)
            failed += proc.returncode != 0
    print(f"warmed in {time.time() - start:.0f} s ({failed} warm-up processes failed)",
          flush=True)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--types", default="Q4_K,Q6_K,Q8_0,Q4_0,Q4_1,Q5_K,Q5_0,Q5_1,Q2_K,Q3_K,"
                    "IQ4_NL,IQ4_XS")
    ap.add_argument("--ms", default="1,16,64,256,2048")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--cases", nargs="+", default=None, metavar="TYPE:SHAPES:MS",
                    help="each type on its own shapes and row counts (e.g. Q4_K:qkv,down:16,64 "
                    "Q6_K:lm_head:64), instead of --types x --shapes x --ms")
    ap.add_argument("--sweep", action="store_true", help="also time every candidate config")
    ap.add_argument("--sweep-types", default="", help="types swept (default: --types)")
    ap.add_argument("--sweep-shapes", default="", help="shapes swept (default: --shapes)")
    ap.add_argument("--warm", action="store_true", help="compile every candidate, time nothing")
    ap.add_argument("--jobs", type=int, default=1,
                    help="compile first in this many --warm processes at once (the host's "
                    "cores), then time")
    ap.add_argument("--prequant", choices=("plan", "on", "off"), default="plan",
                    help="int8 GEMV: x rounded by its own kernel first (on: the gated down "
                    "projection's default) or by every program (off)")
    ap.add_argument("--gated", action="store_true",
                    help="one row: x is a gate_up row, SiLU and product applied by the int8 "
                    "GEMV (the down projection as the model calls it)")
    ap.add_argument("--paths", default="", help="sweep only these paths (e.g. gemv_i8)")
    ap.add_argument("--i8-wide", action="store_true",
                    help="sweep the int8 GEMV at 32 and 64 rows a program (GEMV_I8_WIDE)")
    ap.add_argument("--part", default="0/1", help=argparse.SUPPRESS)
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    if args.cases:
        work = parse_cases(args.cases)
    else:
        shapes = args.shapes.split(",")
        work = [(tname, shapes, [int(m) for m in args.ms.split(",")])
                for tname in args.types.split(",")]
    sweep_types = set(args.sweep_types.split(",")) if args.sweep_types else None
    sweep_shapes = set(args.sweep_shapes.split(",")) if args.sweep_shapes else None

    def sweep_of(tname: str, shape: str) -> bool:
        return args.sweep and (sweep_types is None or tname in sweep_types) and (
            sweep_shapes is None or shape in sweep_shapes)

    import torch

    import bench_measure as bmeas

    if not torch.cuda.is_available():
        print("bench_ggml needs a CUDA device", file=sys.stderr)
        return 2
    global WARM_ONLY, PART, PREQUANT, PATHS, GATED, I8_WIDE
    WARM_ONLY = args.warm
    I8_WIDE = args.i8_wide
    GATED = args.gated
    PREQUANT = {"plan": None, "on": True, "off": False}[args.prequant]
    PATHS = set(args.paths.split(",")) if args.paths else None
    PART = tuple(int(v) for v in args.part.split("/"))
    if args.jobs > 1 and not WARM_ONLY:
        warm_in_parallel(work, sweep_of, args.jobs)
    dev = torch.device("cuda")
    res: Dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "command": "tools/bench_ggml.py " + " ".join(sys.argv[1:]),
        "copy_GBps": 0.0 if WARM_ONLY else bmeas.copy_rate(dev, 1 << 30, True) / 1e9,
        "bf16_matmul_TFLOPs": (0.0 if WARM_ONLY else
                               bmeas.matmul_rate(dev, 8192, torch.bfloat16, True) / 1e12),
        "rows": [],
    }
    if not WARM_ONLY:
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
        for line in variant_summary(row.get("sweep") or []):
            print("    " + line, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)

    start = time.time()
    for tname, shapes, ms in work:
        swept = [sh for sh in shapes if sweep_of(tname, sh)]
        bench_type(tname, ms, shapes, swept, emit)
    print(f"done in {time.time() - start:.0f} s", flush=True)
    return 0


def variant_summary(sweep: List[Dict[str, Any]]) -> List[str]:
    """One line per tensor-core product (``SWAP`` off / on) of a sweep: its fastest
    config, and how many of its configs failed (did not compile, or past the error
    bound)."""
    best: Dict[bool, Dict[str, Any]] = {}
    failed: Dict[bool, int] = {}
    for r in sweep:
        cfg = r.get("config")
        if r.get("path") != "mm" or cfg is None:
            continue
        key = bool(cfg[7]) if len(cfg) == 8 else False
        if "us" not in r or r.get("rel_err", 0) > 2e-2:
            failed[key] = failed.get(key, 0) + 1
        elif key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    return [f"SWAP={int(k)}: {best[k]['us']:8.1f} us {tuple(best[k]['config'])}"
            + (f" ({failed[k]} failed)" if failed.get(k) else "")
            for k in sorted(best)] + [f"SWAP={int(k)}: all {v} failed"
                                      for k, v in sorted(failed.items()) if k not in best]


if __name__ == "__main__":
    sys.exit(main())
