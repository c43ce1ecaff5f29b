"""Round-trip error of cvllm's GGUF quantizers, per type, on Gaussian weights (for the docs).

Usage::

    PYTHONPATH=. python tools/quant_error.py [--rows 256] [--cols 4096] [--seed 0] [--device cpu]

Quantizes one ``[rows, cols]`` matrix of N(0, 1) weights with
``cvllm.quantization.ggml_quantizer.quantize`` to each ``--isq`` type, dequantizes with
gguf-py (an implementation independent of cvllm's), and prints a markdown table: bits
per weight, RMS error / weight std, max |error| / std, and for the five plain types
whether the bytes equal gguf-py's own quantizer's. Errors are relative to the weights'
standard deviation, so the figures hold for any scale of Gaussian weights.
"""

from __future__ import annotations

import argparse
import time

import gguf
import numpy as np
import torch

from cvllm.kernels.quant.ggml_types import BLOCK_SHAPES, ISQ_TYPES
from cvllm.quantization.ggml_quantizer import quantize

PLAIN = {"q4_0", "q4_1", "q5_0", "q5_1", "q8_0"}


def measure(w: torch.Tensor, name: str) -> dict:
    """One row of the table for ``--isq`` type ``name`` on weights ``w [N, K]``."""
    t = ISQ_TYPES[name]
    qt = gguf.GGMLQuantizationType(int(t))
    start = time.perf_counter()
    blocks = quantize(w, t)
    if blocks.is_cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    ref = w.float().cpu().numpy()
    err = gguf.quants.dequantize(blocks.cpu().numpy(), qt) - ref
    std = float(ref.std())
    elems, nbytes = BLOCK_SHAPES[t]
    rms = float(np.sqrt((err ** 2).mean()))
    row = {"type": t.name, "bpw": 8 * nbytes / elems, "rms": rms / std,
           "max": float(np.abs(err).max()) / std, "seconds": seconds, "gguf_py": "-"}
    if name in PLAIN:
        same = np.array_equal(gguf.quants.quantize(ref, qt), blocks.cpu().numpy())
        row["gguf_py"] = "identical" if same else "differs"
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    w = torch.randn(args.rows, args.cols, generator=gen).to(args.device)
    rows = sorted((measure(w, name) for name in ISQ_TYPES), key=lambda r: r["bpw"])
    print(f"N(0, 1) weights [{args.rows}, {args.cols}], seed {args.seed}, on {args.device}\n")
    print("| type | bits/weight | RMS error / std | max abs error / std | bytes vs gguf-py "
          "| seconds |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['type']} | {r['bpw']:.4g} | {r['rms']:.4f} | {r['max']:.3f} | {r['gguf_py']} "
              f"| {r['seconds']:.2f} |")


if __name__ == "__main__":
    main()
