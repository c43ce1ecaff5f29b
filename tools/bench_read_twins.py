#!/usr/bin/env python3
"""Whether the batch-1 int8 GEMV is held by its arithmetic or by its reads: each planned
tile of ``ggml_gemv_i8_kernel`` timed against a load-only twin.

    PYTHONPATH=. python tools/bench_read_twins.py --out read-twins.json

The twin (``read_twin_kernel``) has the GEMV's grid and tiles (``BN`` rows, ``BK``-element
K steps, K split in runs) and loads the same bytes of the split layout (a row block's
words, its super-blocks' packed ``(d, dm)`` and its sub-blocks' scale halfwords), then
only folds them with xor: no activations, no dp4a. Beside it, the same words read as one
flat stream (``flat_read_kernel``: 1,024 words a program step, programs striding over the
tensor), the most a single kernel of that many bytes gets. Times are device time from one
CUDA graph per call (``bench_ggml._ms``: launch gaps included, weights rotated past the
L2), Q4_K, the 8B shapes. Where the GEMV takes no longer than its twin, its arithmetic
is hidden and only the access pattern (tile shape, kernel length) can make it faster.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict

import triton
import triton.language as tl

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))

TILES = {  # shape -> (BN, BK, num_warps, split): the plan's first, then neighbours
    "gate_up": [(16, 2048, 4, 1), (16, 4096, 4, 1), (32, 2048, 8, 1)],
    "down": [(4, 2048, 2, 1), (16, 1024, 4, 4), (16, 2048, 4, 1)],
    "qkv": [(32, 2048, 4, 2)],
    "o_proj": [(16, 4096, 4, 1)],
}


@triton.jit
def read_twin_kernel(lo_ptr, d_ptr, sc_ptr, out_ptr, N, K, s_lo, s_sub, s_d,
                     BN: tl.constexpr, NSUB: tl.constexpr, SPLIT: tl.constexpr,
                     STEPS: tl.constexpr):
    """Program ``pid``: rows ``pid // SPLIT``'s block, K run ``pid % SPLIT``; writes the xor
    of every word, ``(d, dm)`` word and scale halfword it read (Q4_K: four words a
    32-element sub-block, one ``(d, dm)`` per 256)."""
    BK: tl.constexpr = NSUB * 32
    pid = tl.program_id(0)
    k_lo = (pid % SPLIT) * (STEPS * BK)
    k_hi = tl.minimum(K, k_lo + STEPS * BK)
    rows = tl.minimum((pid // SPLIT) * BN + tl.arange(0, BN), N - 1)[:, None]
    acc = tl.zeros((BN, NSUB * 4), dtype=tl.int32)
    accs = tl.zeros((BN, NSUB), dtype=tl.int32)
    for k0 in range(k_lo, k_hi, BK):
        j = k0 // 8 + tl.arange(0, NSUB * 4)[None, :]
        sub = k0 // 32 + tl.arange(0, NSUB)[None, :]
        acc ^= tl.load(lo_ptr + rows * s_lo + j, eviction_policy="evict_first")
        accs ^= tl.load(d_ptr + rows * s_d + sub // 8)
        accs ^= tl.load(sc_ptr + rows * s_sub + sub, eviction_policy="evict_first").to(tl.int32)
    x = tl.reduce(acc, 1, _xor)
    x ^= tl.reduce(accs, 1, _xor)
    tl.store(out_ptr + pid, tl.reduce(x, 0, _xor))


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def flat_read_kernel(p, out_ptr, n_words, BLOCK: tl.constexpr):
    """The xor of words ``pid * BLOCK + i + j * programs * BLOCK`` of ``p``."""
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for i in range(pid * BLOCK, n_words, tl.num_programs(0) * BLOCK):
        offs = i + tl.arange(0, BLOCK)
        acc ^= tl.load(p + offs, mask=offs < n_words, other=0, eviction_policy="evict_first")
    tl.store(out_ptr + pid, tl.reduce(acc, 0, _xor))


def twin_grid(n: int, k: int, bn: int, bk: int, split: int):
    """``(programs, split, steps)``: the split as ``ggml_cuda.i8_config`` trims it."""
    from cvllm.kernels.quant.ggml_plan import i8_config

    *_, split, steps = i8_config((bn, bk, 4, False, split), n, k, 1, False, 4)
    return triton.cdiv(n, bn) * split, split, steps


def read_twin(w, bn: int, bk: int, warps: int, split: int, out=None):
    """Launch the twin on a prepared Q4_K weight (``ggml_cuda.prepare``); returns ``out``."""
    import torch

    n, k = w.shape
    progs, split, steps = twin_grid(n, k, bn, bk, split)
    (lo, _hi, d, _dm, sc), (s_lo, s_sub, s_d) = w.args
    out = torch.empty(progs, dtype=torch.int32, device=lo.device) if out is None else out
    read_twin_kernel[(progs,)](lo, d, sc, out, n, k, s_lo, s_sub, s_d, BN=bn, NSUB=bk // 32,
                               SPLIT=split, STEPS=steps, num_warps=warps)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(TILES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    import bench_ggml as bg
    from cvllm.kernels.quant.ggml_types import GgmlType

    t, rows = GgmlType.Q4_K, []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for shape in args.shapes.split(","):
        n, k = bg.SHAPES[shape]
        ws = bg._weights(t, n, k, 1)
        ws += bg._weights(t, n, k, bg._copies(ws[0].nbytes(), 1) - 1)
        nbytes = ws[0].nbytes()
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        for bn, bk, warps, split in TILES[shape]:
            cfg = (bn, bk, warps, False, split)
            out = read_twin(ws[0], bn, bk, warps, split)  # the buffer every call reuses
            twin = 1e3 * bg._ms([lambda w=w, o=out: read_twin(w, bn, bk, warps, split, o)
                                 for w in ws], 1)
            gemv = 1e3 * bg._ms([lambda w=w: bg._call(x, w, path="gemv_i8", config=cfg)
                                 for w in ws], 1)
            rows.append(_row(shape, "tile", cfg, twin, nbytes, gemv_us=gemv))
        words = ws[0].args[0][0].numel()
        out = torch.empty(sms * 8, dtype=torch.int32, device="cuda")
        flat = 1e3 * bg._ms([lambda w=w: flat_read_kernel[(sms * 8,)](
            w.args[0][0], out, words, BLOCK=1024, num_warps=4) for w in ws], 1)
        rows.append(_row(shape, "flat", None, flat, 4 * words))
        del ws
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                              "command": " ".join(sys.argv), "rows": rows},
                                             indent=1))
    return 0


def _row(shape: str, kind: str, cfg, us: float, nbytes: int, **extra) -> Dict[str, Any]:
    row: Dict[str, Any] = {"shape": shape, "kind": kind, "config": cfg, "us": us,
                           "bytes": nbytes, "tb_per_s": nbytes / us / 1e6, **extra}
    print(json.dumps(row), flush=True)
    return row


if __name__ == "__main__":
    sys.exit(main())
