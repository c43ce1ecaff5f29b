#!/usr/bin/env python3
"""Microseconds per call of the CPU GGML linears (``cvllm/kernels/quant/ggml_cpu.py``)
against dense ``F.linear`` in float32 and bf16, at the default model's shapes.

    python tools/bench_ggml_cpu.py                       # SmolLM2-135M shapes, M = 1, 16
    python tools/bench_ggml_cpu.py --types Q4_1,Q8_0 --m 1,4,16,64 --json out.json

Each shape gets ``--layers`` copies of its weight (30, as many as the model has layers)
and every timed call uses the next copy, so the weights stream from the last-level cache
the way they do in a decode step instead of sitting in L2. A time is the mean over the
copies of each copy's best call in ``--repeats`` rounds (best, not average: other
processes on a small machine only ever add time); with ``--threads 1`` it is the
thread's CPU time, which other processes cannot inflate by preempting it. Weights are
random blocks with moderate f16 scales.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Callable, Dict, List

import numpy as np
import torch
import torch.nn.functional as F

from cvllm.kernels.quant import ggml_cpu
from cvllm.kernels.quant.ggml_types import BLOCK_SHAPES, GgmlType

# SmolLM2-135M: hidden 576, 9 / 3 heads of 64, intermediate 1536, vocab 49152 (tied head);
# cvllm merges q/k/v and gate/up into one linear each.
SHAPES = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576),
          "down_proj": (576, 1536), "lm_head": (49152, 576)}
CALLS_PER_LAYER = {"qkv_proj": 1, "o_proj": 1, "gate_up_proj": 1, "down_proj": 1}
F16_FIELDS = {
    GgmlType.Q4_0: (0,), GgmlType.Q4_1: (0, 2), GgmlType.Q5_0: (0,), GgmlType.Q5_1: (0, 2),
    GgmlType.Q8_0: (0,), GgmlType.Q2_K: (80, 82), GgmlType.Q3_K: (108,),
    GgmlType.Q4_K: (0, 2), GgmlType.Q5_K: (0, 2), GgmlType.Q6_K: (208,),
    GgmlType.IQ4_NL: (0,), GgmlType.IQ4_XS: (0,),
}


def random_raw(t: GgmlType, n: int, k: int, seed: int) -> torch.Tensor:
    """uint8 ``[n, k / B * S]`` random blocks whose f16 scales are finite and small."""
    rng = np.random.default_rng(seed)
    elems, nbytes = BLOCK_SHAPES[t]
    raw = rng.integers(0, 256, (n, k // elems * nbytes), dtype=np.uint8)
    blocks = raw.reshape(-1, nbytes)
    for off in F16_FIELDS[t]:
        scale = rng.uniform(-0.01, 0.01, (blocks.shape[0], 1)).astype(np.float16)
        blocks[:, off:off + 2] = scale.view(np.uint8)
    return torch.from_numpy(raw)


def best_us(fn: Callable[[int], object], copies: int, repeats: int) -> float:
    """Mean over i = 0..copies-1 of the best microseconds of ``fn(i)`` in ``repeats``
    rounds: a call another process interrupted is dropped per call, not per round."""
    # One thread: the calling thread's CPU time, which preemption does not inflate.
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    for i in range(min(copies, 4)):
        fn(i)
    best = [float("inf")] * copies
    for _ in range(repeats):
        for i in range(copies):
            t0 = clock()
            fn(i)
            best[i] = min(best[i], clock() - t0)
    return sum(best) / copies * 1e6


def bench_shape(n: int, k: int, types: List[GgmlType], ms: List[int], copies: int,
                repeats: int) -> List[Dict]:
    rows = []
    dense = [torch.randn(n, k) * 0.02 for _ in range(copies)]
    dense_bf16 = [w.bfloat16() for w in dense]
    # K-quants (256-element blocks) cannot hold K = 576 rows: GGUF writers fall back to a
    # 32-element type there, so only down_proj (K = 1536) measures them.
    quant = {t: [ggml_cpu.prepare(random_raw(t, n, k, i), t, torch.bfloat16)
                 for i in range(copies)] for t in types if k % BLOCK_SHAPES[t][0] == 0}
    for m in ms:
        x = torch.randn(m, k)
        xb = x.bfloat16()
        res = {"N": n, "K": k, "M": m,
               "f32 F.linear": best_us(lambda i: F.linear(x, dense[i]), copies, repeats),
               "bf16 F.linear": best_us(lambda i: F.linear(xb, dense_bf16[i]), copies, repeats)}
        for t, ws in quant.items():
            res[f"{t.name} bf16"] = best_us(lambda i: ggml_cpu.linear(xb, ws[i]), copies, repeats)
            res[f"{t.name} f32"] = best_us(lambda i: ggml_cpu.linear(x, ws[i]), copies, repeats)
        rows.append(res)
        print("  ".join(f"{key}={val:.1f}" if isinstance(val, float) else f"{key}={val}"
                        for key, val in res.items()), flush=True)
    return rows


def per_token(rows: List[Dict], names: Dict[tuple, str], layers: int, m: int, key_layers: str,
              key_head: str) -> float:
    """Matmul milliseconds of one decode step: ``layers`` layers of ``key_layers`` weights
    plus the LM head with ``key_head``."""
    total = 0.0
    for r in rows:
        if r["M"] != m:
            continue
        name = names[(r["N"], r["K"])]
        if name == "lm_head":
            total += r.get(key_head, float("nan"))
        else:
            total += layers * CALLS_PER_LAYER[name] * r.get(key_layers, float("nan"))
    return total / 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="Q4_1,Q8_0,Q4_0,Q4_K,Q5_0,Q5_1,Q5_K,Q6_K,Q3_K,Q2_K,"
                                       "IQ4_NL,IQ4_XS")
    ap.add_argument("--m", default="1,16")
    ap.add_argument("--layers", type=int, default=30, help="weight copies per shape")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--no-lm-head", action="store_true")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (1: times are CPU time, robust on a busy machine)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    types = [GgmlType[t.strip()] for t in args.types.split(",") if t.strip()]
    ms = [int(m) for m in args.m.split(",")]
    names = {v: k for k, v in SHAPES.items()}
    rows = []
    for name, (n, k) in SHAPES.items():
        if name == "lm_head" and args.no_lm_head:
            continue
        copies = 2 if name == "lm_head" else args.layers  # 2 x 28M params already pass L2
        head_types = [t for t in types if t in (GgmlType.Q8_0, GgmlType.Q6_K, GgmlType.Q4_1)]
        rows += bench_shape(n, k, head_types if name == "lm_head" else types, ms, copies,
                            args.repeats)
    summary = {}
    for m in ms:
        for layer_key, head_key in [("f32 F.linear", "f32 F.linear"),
                                    ("bf16 F.linear", "bf16 F.linear"),
                                    ("Q4_1 bf16", "Q8_0 bf16"), ("Q4_1 f32", "Q8_0 f32"),
                                    ("Q4_1 bf16", "bf16 F.linear")]:
            label = f"M={m} layers {layer_key} + head {head_key}"
            summary[label] = per_token(rows, names, 30, m, layer_key, head_key)
            print(f"{label}: {summary[label]:.2f} ms of matmuls per step")
    report = {"torch": torch.__version__, "threads": torch.get_num_threads(),
              "rows": rows, "matmul_ms_per_step": summary}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
