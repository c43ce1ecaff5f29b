#!/usr/bin/env python3
"""What each kernel of a batch-1 decode step costs inside the CUDA graph: the step's graph
recaptured with one kind of kernel left out (or planned another way), replayed back to back.

    PYTHONPATH=. python tools/bench_ablate.py --isq q4k --out ablate.json

The engine decodes one random prompt of ``--prompt-len`` tokens into steady state (8B
Llama shape, dummy weights, the bench's ``max_model_len``), then every variant patches the
named launcher, captures a fresh batch-1 graph from the same staged inputs and times its
replays (CUDA events). A left-out kernel's outputs are wrong, so only the times mean
anything: ``base - variant`` is what that kernel adds to the step, its launch gap and its
share of the PDL overlap included. A diagnostic for choosing fusions, not a benchmark of
the product (that is ``tools/bench.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, List
from unittest import mock

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))

import bench_model as bm  # noqa: E402
from bench_step import steady_decode  # noqa: E402


def _variants(engine) -> Dict[str, Callable[[], contextlib.AbstractContextManager]]:
    """Name -> a context manager that patches the launchers for that variant."""
    from cvllm.attention.backends import triton_backend as tb
    from cvllm.kernels import paged_attention as pa
    from cvllm.kernels.paged_attention import decode as pd
    from cvllm.kernels import pdl, rmsnorm
    from cvllm.kernels.quant import ggml_cuda
    from cvllm.utils import tuning

    model = engine.runner.model

    def norm_off(x, weight, eps, residual=None, *a, **k):
        return x if residual is None else (x, residual)

    def q8_off(x2, k, act=0, wps=4):
        import torch

        return (torch.empty(2, k // 8, dtype=torch.int32, device=x2.device),
                torch.empty(2, k // 32, dtype=torch.float32, device=x2.device))

    def attn_off(q, *a, out=None, **k):
        return out

    def direct_plan(q, k_cache, block_g, span, num_splits, block_n):
        return _orig_plan(q, k_cache, block_g, span, 1, block_n)

    def logits_off(hidden):
        import torch

        return torch.zeros(hidden.shape[0], 1, dtype=torch.float32, device=hidden.device)

    _orig_plan = pd._decode_plan
    p = mock.patch.object
    single = {
        "no_norm": lambda: p(rmsnorm, "rms_norm", norm_off),
        "no_rotary_kv": lambda: p(tb, "rotary_write_kv", lambda *a, **k: None),
        "no_attention": lambda: p(pa, "decode_attention", attn_off),
        "no_merge": lambda: p(pd, "merge_attention_partials", lambda a, b, out: out),
        "fused_merge": lambda: tuning.configure(fused_merge=True),
        "one_split": lambda: p(pd, "_decode_plan", direct_plan),
        "no_q8": lambda: p(ggml_cuda, "quantize_q8", q8_off),
        "no_split_gemv": lambda: tuning.configure(ggml_i8_split=False),
        "no_lm_head": lambda: p(model, "compute_logits", logits_off),
    }
    # where the small PDL kernels trigger their dependents (kernels/pdl.py, CVLLM_PDL_EARLY):
    # early_none, early_all, early_qkv, early_qkv+rope, ...
    for combo in ("none", "all", "qkv", "qkv+q8", "qkv+rope", "qkv+mlp", "qkv+norm",
                  "qkv+act", "qkv+attn", "qkv+q8+norm", "qkv+norm+act", "qkv+q8+norm+act",
                  "qkv+q8+norm+rope", "qkv+q8+norm+attn", "qkv+q8+rope+norm+attn"):
        sites = frozenset() if combo == "none" else frozenset(pdl.SITES) if combo == "all" \
            else frozenset(combo.split("+"))
        single["early_" + combo] = functools.partial(tuning.configure, pdl_early=sites)

    @contextlib.contextmanager
    def gemv_only():
        with single["no_norm"](), single["no_rotary_kv"](), single["no_attention"](), \
                single["no_q8"](), single["no_lm_head"]():
            yield

    return {"base": contextlib.nullcontext, **single, "gemv_only": gemv_only}


def plan_variant(name: str) -> Callable[[], contextlib.AbstractContextManager]:
    """``plan:NxK=BN/BK/WARPS/PREFETCH/SPLIT[;NxK=..]``: the int8 GEMV of those weight
    shapes (``N x K``) tiled as given instead of as planned (``ggml_plan.plan_gemv_i8``;
    BK in elements, as the plan returns it)."""
    from cvllm.kernels.quant import ggml_plan

    if not name.startswith("plan:"):
        raise SystemExit(f"unknown variant {name!r}")
    table = {}
    for part in name[5:].split(";"):
        shape, cfg = part.split("=")
        n, k = (int(v) for v in shape.split("x"))
        bn, bk, warps, prefetch, split = (int(v) for v in cfg.split("/"))
        table[(n, k)] = (bn, bk, warps, bool(prefetch), split)
    orig = ggml_plan.plan_gemv_i8

    def plan(n, k, num_sms, prequant=False, wps=4):
        return table.get((n, k)) or orig(n, k, num_sms, prequant, wps)

    return lambda: mock.patch.object(ggml_plan, "plan_gemv_i8", plan)


def replay_us(engine, patch, reps: int, rounds: int) -> float:
    """Median over ``rounds`` of the mean replay time of a batch-1 graph captured under
    ``patch``."""
    import torch

    from cvllm.kernels import pdl

    graphs = engine.runner.graphs
    with torch.inference_mode(), patch():
        with pdl.graph_launches():
            graphs._forward(1)  # compiles what the variant launches
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=graphs.pool):
            graphs._forward(1)
    times = []
    for _ in range(rounds):
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(1000 * start.elapsed_time(end) / reps)
    del graph
    return statistics.median(times)


def timeline(engine, steps: int) -> Dict[str, Any]:
    """Where the GPU is idle over ``steps`` engine steps (``torch.profiler``): the union
    of the device's kernel and copy intervals against the span, the largest idle gaps
    with the operations on either side, and every operation's count and time a step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    evs = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                  and e.time_range.end > e.time_range.start),
                 key=lambda e: e.time_range.start)
    if not evs:
        return {}
    gaps, busy, end, prev = [], 0.0, evs[0].time_range.start, evs[0].name
    per_op: Dict[str, List[float]] = {}
    for e in evs:
        s0, s1 = e.time_range.start, e.time_range.end
        per_op.setdefault(e.name[:70], []).append(s1 - s0)
        if s0 > end:
            gaps.append((s0 - end, prev[:50], e.name[:50]))
        busy += max(0.0, s1 - max(s0, end))
        if s1 > end:
            end, prev = s1, e.name
    span = end - evs[0].time_range.start
    gaps.sort(reverse=True)
    return {"steps": steps, "span_us_per_step": span / steps, "busy_us_per_step": busy / steps,
            "idle_us_per_step": (span - busy) / steps,
            "top_gaps": [{"us": g, "after": a, "before": b} for g, a, b in gaps[:25]],
            "ops": sorted(({"op": k, "per_step": len(v) / steps, "us_per_step": sum(v) / steps}
                           for k, v in per_op.items()), key=lambda r: -r["us_per_step"]),
            "critical": critical_path(evs, steps)}


def critical_path(evs, steps: int) -> List[Dict[str, Any]]:
    """Each operation's share of the step by end times: operations in order of their ends,
    each charged with how far it moved the latest end. Under PDL a kernel starts before
    its predecessor ends, so start-based busy time charges the wrong one; the end-time
    increments add up to the span. An operation is named with the three before it
    (``q8 > gemv > norm > gemv``), which tells the four projections of a layer apart."""
    order = sorted(evs, key=lambda e: e.time_range.end)
    short = [_short(e.name) for e in order]
    per: Dict[str, List[float]] = {}
    last = min(e.time_range.start for e in evs)  # the span's start, as timeline's
    for i, e in enumerate(order):
        inc = max(0.0, e.time_range.end - last)
        last = max(last, e.time_range.end)
        key = " > ".join(short[max(0, i - 3):i + 1])
        per.setdefault(key, []).append(inc)
    rows = [{"ops": k, "per_step": len(v) / steps, "us_per_step": sum(v) / steps,
             "us_each": sum(v) / len(v)} for k, v in per.items()]
    return sorted(rows, key=lambda r: -r["us_per_step"])[:40]


def _short(name: str) -> str:
    for key, label in (("gemv_i8", "gemv"), ("ggml_gemv", "fgemv"), ("rms_norm", "norm"),
                       ("q8_kernel", "q8"), ("decode_kernel", "attn"), ("rotary", "rope"),
                       ("Memcpy", "copy")):
        if key in name:
            return label
    return name.split("<")[0].strip("_ ")[:24]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--isq", default="q4k", help="in-situ quantization ('none': bf16)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=2065,
                    help="sets the graph's decode split plan (bench.py --quick: 2065)")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", default=None, help="comma-separated variant names")
    ap.add_argument("--timeline", type=int, default=0, metavar="STEPS",
                    help="also profile this many engine steps: the GPU's idle gaps")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import numpy as np
    import torch

    from cvllm.engine.llm import LLM

    cfg = bm.build_config(None, False, {})
    folder = bm.write_model_folder(Path(tempfile.mkdtemp(prefix="cvllm-ablate-")), cfg)
    opts: Dict[str, Any] = dict(weight_path=str(folder), load_format="dummy", dtype="bf16",
                                max_model_len=args.max_model_len, max_num_seqs=1)
    if args.isq != "none":
        opts["isq"] = args.isq
    engine = LLM(**opts).engine
    steady_decode(engine, 1, args.prompt_len, int(cfg["vocab_size"]), np.random.default_rng(0))
    engine.step()
    torch.cuda.synchronize()
    variants = _variants(engine)
    names: List[str] = args.only.split(",") if args.only else list(variants)
    rows = []
    base = None
    for name in names:
        patch = variants[name] if name in variants else plan_variant(name)
        us = replay_us(engine, patch, args.reps, args.rounds)
        base = us if name == "base" else base
        row = {"variant": name, "replay_us": us}
        if base is not None:
            row["saved_us"] = base - us
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = {"device": torch.cuda.get_device_name(), "command": " ".join(sys.argv),
           "isq": args.isq, "prompt_len": args.prompt_len,
           "max_model_len": args.max_model_len, "rows": rows}
    if args.timeline:
        out["timeline"] = tl = timeline(engine, args.timeline)
        print(json.dumps({k: v for k, v in tl.items() if k not in ("ops", "critical")},
                         indent=1), flush=True)
        for r in tl.get("ops", [])[:40]:
            print(f"{r['us_per_step']:8.1f} us {r['per_step']:7.2f}x  {r['op']}")
        print("critical path (end-time increments):")
        for r in tl.get("critical", []):
            print(f"{r['us_per_step']:8.1f} us {r['per_step']:7.2f}x {r['us_each']:7.2f} each"
                  f"  {r['ops']}")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
