#!/usr/bin/env python3
"""PNG plot of a ``tools/bench.py`` report: decode throughput against batch size (cvllm,
its bandwidth roofline, the transformers peer) and prefill throughput against the number
of prompts (with the matmul ceiling).

    python tools/bench_plot.py docs/benchmarks/bench-h100.json            # -> bench-h100.png

Needs matplotlib, which is no dependency of cvllm (the GPU machines lack it): ``bench.py``
skips its plot there with a message, and this script makes it later from the JSON, on any
machine that has matplotlib (``pip install matplotlib``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional


def _ok(rows: List[Dict[str, Any]], key: str) -> List[Dict[str, Any]]:
    return [r for r in rows if isinstance(r.get(key), (int, float)) and r[key] > 0]


def plot(report: Dict[str, Any], png: Path) -> Optional[str]:
    """Write ``png``; returns None, or why no plot was made."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ("matplotlib is not installed: no plot "
                "(run tools/bench_plot.py on the JSON where it is)")
    decode = _ok(report.get("decode", []), "tokens_per_s")
    prefill = _ok(report.get("prefill", []), "tokens_per_s")
    if not decode and not prefill:
        return "no figures to plot"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    device = report.get("device", {}).get("name", "?")
    cfg = report.get("config", {})
    shape = (f"hidden {cfg.get('hidden_size')}, {cfg.get('num_hidden_layers')} layers, "
             f"{cfg.get('num_attention_heads')}/{cfg.get('num_key_value_heads')} heads")
    fig.suptitle(f"cvllm, {report.get('model', {}).get('name', '')} ({shape}, "
                 f"{report.get('dtype', '')}) on {device}")
    if decode:
        xs = [r["batch"] for r in decode]
        ax1.plot(xs, [r["tokens_per_s"] for r in decode], "o-", label="cvllm")
        roof = _ok(decode, "roofline_tokens_per_s")
        if roof:
            ax1.plot([r["batch"] for r in roof], [r["roofline_tokens_per_s"] for r in roof], "k--",
                     label="bandwidth roofline")
        peer = _ok(report.get("hf_peer", {}).get("results", []), "tokens_per_s")
        if peer:
            ax1.plot([r["batch"] for r in peer], [r["tokens_per_s"] for r in peer], "s-",
                     label="transformers generate_batch")
        ax1.set_xscale("log", base=2)
        ax1.set_yscale("log")
        ax1.set_xticks(xs)
        ax1.set_xticklabels([str(x) for x in xs])
        ax1.set_xlabel("batch size (concurrent sequences)")
        ax1.set_ylabel("decode tokens/s (all sequences)")
        ax1.grid(True, which="both", alpha=0.3)
        ax1.legend()
    if prefill:
        xs = [str(r["num_prompts"]) for r in prefill]
        ax2.bar(xs, [r["tokens_per_s"] for r in prefill], label="cvllm")
        ceil = _ok(prefill, "ceiling_tokens_per_s")
        if ceil:
            ax2.plot([str(r["num_prompts"]) for r in ceil],
                     [r["ceiling_tokens_per_s"] for r in ceil],
                     "k_", markersize=30, mew=2, label="matmul ceiling")
        ax2.set_xlabel(f"prompts of {prefill[0].get('prompt_len', '?')} tokens")
        ax2.set_ylabel("prefill tokens/s")
        ax2.grid(True, axis="y", alpha=0.3)
        ax2.legend()
    fig.tight_layout()
    fig.savefig(str(png), dpi=110)
    plt.close(fig)
    return None


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    src = Path(argv[0])
    png = Path(argv[1]) if len(argv) > 1 else src.with_suffix(".png")
    why = plot(json.loads(src.read_text()), png)
    print(why or f"wrote {png}")
    return 1 if why else 0


if __name__ == "__main__":
    sys.exit(main())
