#!/usr/bin/env python3
"""Offline benchmark of cvllm against the hardware's own limits, measured in the same run.

    python tools/bench.py                  # Llama 3.1 8B shape, random bf16 weights (~9 min)
    python tools/bench.py --quick          # the same, short workloads (smoke test, < 2 min)
    python tools/bench.py --tiny --cpu     # a tiny Llama on the CPU (seconds; CI)
    python tools/bench.py --config cfg.json | --hidden 2048 --layers 16 ...

It writes a model folder (config.json + a tokenizer made on the fly; no weights) and runs
cvllm on it with ``load_format="dummy"`` through the engine (scheduler, runner, sampler,
detokenizer). Figures, each with its ceiling:

- decode tokens/s at batch 1 and at ``--decode-batches`` (random token-id prompts of
  ``--prompt-len``, ``--decode-tokens`` output tokens, ignore_eos). Only the decode
  window is timed: from the step where every sequence has its first token to the step
  where the first one finishes. Ceiling: (weight bytes + KV bytes read) per step at the
  measured copy bandwidth (``bench_model.decode_roofline``);
- prefill tokens/s for ``--prefill-batches`` prompts of ``--prefill-len`` tokens (max_tokens
  1); ceiling: FLOPs at the measured bf16 matmul rate (``bench_model.prefill_flops``);
- the ceilings: device-to-device copy bandwidth ((read + written bytes) / time) and a
  large square matmul, CUDA events, median; measured before and after the engine runs;
- the peer: the same decode workload through transformers' ``generate_batch``
  (``bench_hf_peer.py``, in a child process run first, so the two never share memory);
- with ``--tp 1,2[,4]``: the model served at each tensor-parallel size
  (``tools/bench_tp.py``): batch-1 decode speed-up and batch-64 throughput scaling.

Every phase is time-bounded (a decode phase past its limit reports the window measured
so far, with ``truncated: true``), prints progress, and the JSON report (``--out``) is
rewritten after each phase, so a run cut short still leaves its figures. A PNG plot is
written next to it when matplotlib is there (``tools/bench_plot.py`` makes it later).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import queue
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))

import bench_model as bm  # noqa: E402  (tools/ is not a package)
from bench_measure import (T_START, engine_facts, log, measure_ceilings, run_decode,  # noqa: E402
                           run_prefill, decode_figures, prefill_figures)

# Workloads and time limits (seconds) per mode; flags override single values.
MODES: Dict[str, Dict[str, Any]] = {
    "full": dict(decode_batches="16,64,256", decode_tokens=1024, batch1_tokens=1024,
                 prompt_len=128, prefill_batches="1,4,16", prefill_len=2048, prefill_reps=3,
                 hf_batches="64,16", hf_tokens=1024, decode_timeout=70, prefill_timeout=40,
                 hf_timeout=180, warmup_timeout=90, time_budget=540, kv_mem_mb=0),
    "quick": dict(decode_batches="16,64,256", decode_tokens=32, batch1_tokens=64, prompt_len=128,
                  prefill_batches="1,4,16", prefill_len=2048, prefill_reps=1, hf_batches="64",
                  hf_tokens=32, decode_timeout=15, prefill_timeout=15, hf_timeout=45,
                  warmup_timeout=45, time_budget=115, kv_mem_mb=0),
    "tiny": dict(decode_batches="2,4", decode_tokens=12, batch1_tokens=12, prompt_len=16,
                 prefill_batches="1,2", prefill_len=64, prefill_reps=1, hf_batches="4",
                 hf_tokens=12, decode_timeout=10, prefill_timeout=10, hf_timeout=45,
                 warmup_timeout=20, time_budget=90, kv_mem_mb=32),
}


# ---------------------------------------------------------------- arguments
def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="short workloads (smoke test)")
    mode.add_argument("--tiny", action="store_true", help="tiny Llama shape and workloads (CPU)")
    ap.add_argument("--config", help="a config.json to benchmark instead of the 8B Llama shape")
    for flag in bm.SHAPE_FLAGS:
        ap.add_argument(f"--{flag.replace('_', '-')}", dest=flag, type=int, default=None)
    ap.add_argument("--cpu", action="store_true", help="run on the CPU even with a GPU")
    ap.add_argument("--dtype", default=None, help="bf16 (GPU default) | f16 | f32 (CPU default)")
    for key, value in MODES["full"].items():
        ap.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=None,
                        help=f"full mode: {value}")
    ap.add_argument("--no-hf-peer", action="store_true", help="skip the transformers peer")
    ap.add_argument("--tp", default=None, metavar="SIZES",
                    help="also tensor-parallel serving at these sizes, e.g. 1,2,4 "
                         "(tools/bench_tp.py: batch-1 speed-up and batch-64 scaling)")
    ap.add_argument("--gpu-memory-fraction", type=float, default=None)
    ap.add_argument("--engine-opt", action="append", default=[], metavar="KEY=VALUE",
                    help="extra LLM(...) option, e.g. attention_backend=torch_ref (repeatable)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-dir", help="write (and keep) the model folder here")
    ap.add_argument("--out", help="the JSON report (default: "
                    "docs/benchmarks/bench-<device>[-<mode>].json)")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    args.mode = "tiny" if args.tiny else "quick" if args.quick else "full"
    if args.tp is not None:
        try:
            sizes = [int(t) for t in args.tp.split(",")]
        except ValueError:
            sizes = []
        if not sizes or min(sizes) < 1:
            ap.error(f"--tp takes comma-separated sizes such as 1,2,4, not {args.tp!r}")
    for key, value in MODES[args.mode].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def engine_options(args: argparse.Namespace) -> Dict[str, Any]:
    opts: Dict[str, Any] = {}
    for item in args.engine_opt:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--engine-opt wants KEY=VALUE, got {item!r}")
        try:
            opts[key.strip()] = json.loads(raw)
        except ValueError:
            opts[key.strip()] = raw
    return opts


def int_list(text: str) -> List[int]:
    return [int(x) for x in str(text).split(",") if x.strip()]


# ---------------------------------------------------------------- report
class Report:
    """The JSON report, rewritten atomically after every phase."""

    def __init__(self, path: Path, data: Dict[str, Any]):
        self.path = path
        self.data = data

    def save(self) -> None:
        self.data["wall_s"] = round(time.monotonic() - T_START, 1)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str))
        os.replace(tmp, self.path)

    def error(self, phase: str, exc: BaseException) -> None:
        msg = f"{phase}: {type(exc).__name__}: {exc}"
        log(f"ERROR {msg}")
        self.data.setdefault("errors", []).append(msg)
        self.save()


def device_slug(name: str) -> str:
    name = re.sub(r"^nvidia\s+", "", name.strip(), flags=re.I)
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def versions() -> Dict[str, Any]:
    import torch

    out: Dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda": torch.version.cuda}
    for mod in ("triton", "transformers", "cvllm"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # not installed, or no __version__
            out[mod] = None
    try:
        out["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=TOOLS, text=True,
                                           capture_output=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        out["git_commit"] = None
    return out


def device_info(use_cuda: bool) -> Dict[str, Any]:
    import torch

    if not use_cuda:
        name = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                name = next((line.split(":", 1)[1].strip() for line in f
                             if line.startswith("model name")), name)
        except OSError:
            pass
        return {"kind": "cpu", "name": name, "threads": torch.get_num_threads()}
    props = torch.cuda.get_device_properties(0)
    return {"kind": "cuda", "name": torch.cuda.get_device_name(0),
            "count": torch.cuda.device_count(), "memory_gib": round(props.total_memory / 2**30, 1),
            "capability": f"{props.major}.{props.minor}", "sm_count": props.multi_processor_count}


# ---------------------------------------------------------------- HF peer
def run_hf_peer(args: argparse.Namespace, model_dir: Path, dtype: str, use_cuda: bool,
                timeout: float) -> Dict[str, Any]:
    """``bench_hf_peer.py`` in a child process; its result lines, whatever it got through."""
    cmd = [sys.executable, str(TOOLS / "bench_hf_peer.py"), "--model-dir", str(model_dir),
           "--batches", args.hf_batches, "--prompt-len", str(args.prompt_len),
           "--tokens", str(args.hf_tokens), "--dtype", dtype, "--seed", str(args.seed)]
    if not use_cuda:
        cmd.append("--cpu")
    peer: Dict[str, Any] = {"command": " ".join(cmd), "results": [], "timeout_s": timeout}
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    lines: "queue.Queue[Optional[str]]" = queue.Queue()

    def pump() -> None:  # a thread, so the wait below can time out between lines
        for raw in proc.stdout:  # type: ignore[union-attr]
            lines.put(raw)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    tail: List[str] = []
    while True:
        try:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            line = ""
        if line is None:
            break
        if time.monotonic() > deadline:
            proc.kill()  # our own child, by its handle
            peer["error"] = f"timed out after {timeout:.0f}s"
            break
        if line.startswith("BENCH_HF_RESULT "):
            msg = json.loads(line.split(" ", 1)[1])
            peer.update(msg.get("info", {}))
            if "result" in msg:
                peer["results"].append(msg["result"])
        elif line.strip():
            tail = (tail + [line.rstrip()])[-20:]
            print(f"    {line.rstrip()}", flush=True)
    rc = proc.wait()
    if rc and "error" not in peer:
        peer["error"] = f"exit status {rc}: " + " | ".join(tail[-5:])
    return peer


class Budget:
    """The run's time budget: each phase gets its own limit, cut to what is left."""

    def __init__(self, total: float, reserve: float = 8.0):
        self.end = T_START + total - reserve

    def limit(self, phase_limit: float) -> float:
        return max(0.0, min(phase_limit, self.end - time.monotonic()))


class Phases:
    """cvllm's phases on one engine; each phase's limit covers its warm-up runs too."""

    def __init__(self, args: argparse.Namespace, llm: Any, cfg: Dict[str, Any],
                 facts: Dict[str, Any], ceil: Dict[str, Any], rep: Report, budget: Budget):
        import numpy as np

        self.args, self.cfg, self.facts, self.ceil = args, cfg, facts, ceil
        self.rep, self.budget = rep, budget
        self.engine, self.vocab = llm.engine, int(cfg["vocab_size"])
        self.rng = np.random.default_rng(args.seed)
        self.deadline = 0.0

    def start(self, phase_limit: float) -> float:
        limit = self.budget.limit(phase_limit)
        self.deadline = time.monotonic() + limit
        return limit

    def left(self) -> float:
        return max(0.5, self.deadline - time.monotonic())

    def run(self) -> None:
        self.warmup()
        for num in int_list(self.args.prefill_batches):
            self.guarded(f"prefill {num}", self.args.prefill_timeout, lambda: self.prefill(num))
        batches = [(1, self.args.batch1_tokens)]
        batches += [(b, self.args.decode_tokens) for b in int_list(self.args.decode_batches)]
        for batch, tokens in batches:
            self.guarded(f"decode batch {batch}", self.args.decode_timeout,
                         lambda: self.decode(batch, tokens))

    def guarded(self, name: str, phase_limit: float, fn: Callable[[], None]) -> None:
        if self.start(phase_limit) < 2:
            self.rep.data["skipped"].append(f"{name}: time budget spent")
            return
        try:
            fn()
            self.rep.save()
        except Exception as e:
            self.rep.error(name, e)

    def warmup(self) -> None:
        """First use compiles the Triton kernels (and tunes cuBLAS); no phase pays for it."""
        t = time.monotonic()
        self.start(self.args.warmup_timeout)
        try:
            run_prefill(self.engine, 1, self.args.prefill_len, self.rng, self.vocab, self.left(),
                        "warmup")
            run_decode(self.engine, 2, self.args.prompt_len, 8, self.rng, self.vocab, self.left(),
                       "warmup")
        except Exception as e:
            self.rep.error("engine warm-up", e)
        self.rep.data["engine_warmup_s"] = round(time.monotonic() - t, 1)
        log(f"engine warm-up: {self.rep.data['engine_warmup_s']}s")

    def prefill(self, num: int) -> None:
        length = self.args.prefill_len
        run_prefill(self.engine, num, length, self.rng, self.vocab, self.left(), "warm")
        times = [run_prefill(self.engine, num, length, self.rng, self.vocab, self.left(), "pf")
                 for _ in range(self.args.prefill_reps)]
        res = {"num_prompts": num, "prompt_len": length, "reps": len(times),
               "seconds": statistics.median(times), "seconds_all": times}
        prefill_figures(res, self.facts, self.cfg, self.ceil)
        self.rep.data["prefill"].append(res)
        log(f"prefill {num} x {length}: {res['tokens_per_s']:.0f} tok/s, "
            f"{res['achieved_TFLOPs']:.1f} TFLOP/s = {res['fraction_of_matmul']:.0%} of matmul")

    def decode(self, batch: int, tokens: int) -> None:
        plen = self.args.prompt_len
        run_decode(self.engine, batch, plen, min(4, tokens), self.rng, self.vocab,
                   self.left() / 4, "warm")
        res = run_decode(self.engine, batch, plen, tokens, self.rng, self.vocab, self.left(), "dec")
        need = batch * (plen + tokens)
        if self.facts.get("kv_capacity_tokens", need) < need:
            res["warning"] = (f"KV cache holds {self.facts['kv_capacity_tokens']} tokens, "
                              f"the phase needs {need}")
        decode_figures(res, self.facts, self.ceil)
        self.rep.data["decode"].append(res)
        log(f"decode batch {batch}: {res.get('tokens_per_s', 0):.1f} tok/s "
            f"({res.get('ms_per_step', 0):.1f} ms/step) = "
            f"{res.get('fraction_of_roofline', 0):.0%} of roofline"
            f"{' (truncated)' if res['truncated'] else ''}")


def best_ceiling_fractions(data: Dict[str, Any]) -> None:
    """Each decode row's ``fraction_of_best_roofline``: its fraction against the higher of
    the run's two copy rates (start and end; the phases use the start's), so that a copy
    that ran slow once does not flatter the fraction. Rows untouched without both."""
    rates = [c.get("copy_bytes_per_s") for c in (data.get("ceilings") or {},
                                                 data.get("ceilings_end") or {})]
    if not all(rates):
        return
    for r in data["decode"]:
        if r.get("fraction_of_roofline") is not None:
            r["fraction_of_best_roofline"] = r["fraction_of_roofline"] * rates[0] / max(rates)


def compare_and_judge(data: Dict[str, Any]) -> None:
    """cvllm / peer ratios and the issue's targets, from the figures gathered."""
    best_ceiling_fractions(data)
    decode = {r["batch"]: r for r in data["decode"] if r.get("tokens_per_s")}
    peer = {r["batch"]: r for r in data.get("hf_peer", {}).get("results", [])
            if r.get("tokens_per_s")}
    data["vs_hf_peer"] = {
        str(b): {"ratio": decode[b]["tokens_per_s"] / peer[b]["tokens_per_s"],
                 "cvllm_tokens_per_s": decode[b]["tokens_per_s"],
                 "hf_tokens_per_s": peer[b]["tokens_per_s"],
                 "same_workload": (decode[b]["output_tokens"] == peer[b]["output_tokens"]
                                   and decode[b]["prompt_len"] == peer[b]["prompt_len"]
                                   and not decode[b]["truncated"])}
        for b in sorted(peer) if b in decode}
    prefill = [r for r in data["prefill"] if r.get("fraction_of_matmul")]
    targets = {
        "batch1_decode_fraction_of_roofline>=0.85": decode.get(1, {}).get("fraction_of_roofline"),
        "batch64_decode_fraction_of_roofline>=0.70": decode.get(64, {}).get("fraction_of_roofline"),
        "prefill_fraction_of_matmul>=0.50": prefill[-1]["fraction_of_matmul"] if prefill else None,
        "batch64_vs_hf_peer>=3": data["vs_hf_peer"].get("64", {}).get("ratio"),
    }
    data["targets"] = {
        k: {"value": v, "met": None if v is None else v >= float(k.split(">=")[1])}
        for k, v in targets.items()}


def print_summary(data: Dict[str, Any]) -> None:
    c = data.get("ceilings") or {}
    print(f"\n== {data['device'].get('name')}: copy {c.get('copy_GBps', 0):.0f} GB/s, "
          f"matmul {c.get('matmul_TFLOPs', 0):.1f} TFLOP/s", flush=True)
    for r in data["decode"]:
        print(f"decode  batch {r['batch']:>4}: {r.get('tokens_per_s', 0):>9.1f} tok/s "
              f"{r.get('fraction_of_roofline', 0):6.1%} of roofline "
              f"({r.get('roofline_tokens_per_s', 0):.0f})"
              + (f", {r['fraction_of_best_roofline']:.1%} at the run's best copy rate"
                 if "fraction_of_best_roofline" in r else "")
              + f"{'  truncated' if r['truncated'] else ''}")
    for r in data["prefill"]:
        print(f"prefill {r['num_prompts']:>3} x {r['prompt_len']}: "
              f"{r['tokens_per_s']:>9.0f} tok/s {r['fraction_of_matmul']:6.1%} of matmul")
    for r in data.get("hf_peer", {}).get("results", []):
        vs = data.get("vs_hf_peer", {}).get(str(r["batch"]), {})
        ratio = f"cvllm/hf {vs['ratio']:.2f}x" if vs else ""
        print(f"hf peer batch {r['batch']:>4}: {r.get('tokens_per_s', 0):>9.1f} tok/s {ratio} "
              f"{r.get('error', '')}")
    if data.get("hf_peer", {}).get("error"):
        print(f"hf peer: {data['hf_peer']['error']}")
    for k, v in data.get("targets", {}).items():
        val = "n/a" if v["value"] is None else f"{v['value']:.3f}"
        print(f"target {k}: {val} {'' if v['met'] is None else 'MET' if v['met'] else 'not met'}")
    for e in data.get("errors", []):
        print(f"error: {e}")
    sys.stdout.flush()


def build_llm(args: argparse.Namespace, model_dir: Path, dtype: str, use_cuda: bool) -> Any:
    from cvllm.engine.llm import LLM

    max_len = max(args.prompt_len + max(args.decode_tokens, args.batch1_tokens),
                  args.prefill_len + 1) + 16
    opts: Dict[str, Any] = dict(weight_path=str(model_dir), load_format="dummy", dtype=dtype,
                                cpu=not use_cuda, max_model_len=max_len, seed=args.seed,
                                max_num_seqs=max(int_list(args.decode_batches)
                                                 + int_list(args.prefill_batches) + [1]))
    if args.gpu_memory_fraction:
        opts["gpu_memory_fraction"] = args.gpu_memory_fraction
    if args.kv_mem_mb:  # a CPU run would otherwise zero 2 GiB of cache it never uses
        opts["kvcache_mem_mb"] = args.kv_mem_mb
    opts.update(engine_options(args))
    return LLM(**opts), opts


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    for key, value in (("TOKENIZERS_PARALLELISM", "false"), ("CVLLM_NO_PROGRESS", "1"),
                       ("NCCL_NVLS_ENABLE", "0")):
        os.environ.setdefault(key, value)
    if args.tiny:
        # One thread (here and in the peer's child): on a small shared CI machine OpenMP
        # workers spin-wait behind other processes and a 3 ms step stalls to 300 ms.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    if args.tiny:
        torch.set_num_threads(1)
    use_cuda = torch.cuda.is_available() and not args.cpu
    dtype = args.dtype or ("bf16" if use_cuda else "f32")
    overrides = {key: getattr(args, flag) for flag, key in bm.SHAPE_FLAGS.items()}
    cfg = bm.build_config(args.config, args.tiny, overrides)
    dev = device_info(use_cuda)
    suffix = "" if args.mode == "full" else f"-{args.mode}"
    name = f"bench-{device_slug(dev['name'])}{suffix}.json"
    out = Path(args.out or TOOLS.parent / "docs" / "benchmarks" / name)
    cli = list(sys.argv[1:] if argv is None else argv)
    rep = Report(out, {"schema": "cvllm-bench/1", "mode": args.mode,
                       "command": shlex.join(["python", "tools/bench.py"] + cli),
                       "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       "device": dev, "versions": versions(), "dtype": dtype, "config": cfg,
                       "workload": {k: getattr(args, k) for k in MODES["full"]},
                       "decode": [], "prefill": [], "skipped": [], "errors": []})
    log(f"{args.mode} run on {dev['name']} ({dtype}); report -> {out}")
    model_dir = Path(args.model_dir or tempfile.mkdtemp(prefix="cvllm-bench-"))
    budget = Budget(args.time_budget)
    try:
        bm.write_model_folder(model_dir, cfg)
        run_all(args, rep, model_dir, dtype, use_cuda, cfg, budget)
    finally:
        if not args.model_dir:
            shutil.rmtree(model_dir, ignore_errors=True)
    compare_and_judge(rep.data)
    rep.save()
    print_summary(rep.data)
    if not args.no_plot:
        import bench_plot

        why = bench_plot.plot(rep.data, out.with_suffix(".png"))
        log(why or f"plot -> {out.with_suffix('.png')}")
    log(f"report -> {out}")
    return 0


def run_all(args: argparse.Namespace, rep: Report, model_dir: Path, dtype: str, use_cuda: bool,
            cfg: Dict[str, Any], budget: Budget) -> None:
    if not args.no_hf_peer:
        limit = budget.limit(args.hf_timeout)
        log(f"transformers peer: batches {args.hf_batches}, {args.hf_tokens} tokens "
            f"(limit {limit:.0f}s)")
        try:
            rep.data["hf_peer"] = run_hf_peer(args, model_dir, dtype, use_cuda, limit)
        except Exception as e:
            rep.error("hf peer", e)
        rep.save()
    log("ceilings: copy bandwidth and matmul")
    try:
        ceil = measure_ceilings(use_cuda, dtype)
    except Exception as e:
        rep.error("ceilings", e)
        return
    rep.data["ceilings"] = ceil
    log(f"copy {ceil['copy_GBps']:.0f} GB/s, matmul {ceil['matmul_TFLOPs']:.1f} TFLOP/s")
    rep.save()
    log("building the cvllm engine (random weights)")
    t = time.monotonic()
    try:
        llm, opts = build_llm(args, model_dir, dtype, use_cuda)
    except Exception as e:
        rep.error("engine build", e)
        return
    try:
        facts = engine_facts(llm, cfg, 2 if dtype in ("bf16", "f16") else 4)
    except Exception as e:
        rep.error("engine facts (weight / KV bytes)", e)
        return
    rep.data.update(engine_options=opts, engine_build_s=round(time.monotonic() - t, 1), model=facts)
    log(f"engine built in {rep.data['engine_build_s']}s: {facts['params']:,} params, "
        f"{facts['weight_bytes_per_step']:,} bytes read per decode step, "
        f"{facts['kv_bytes_per_token']} KV bytes/token, backends {facts['attention_backends']}")
    rep.save()
    Phases(args, llm, cfg, facts, ceil, rep, budget).run()
    del llm
    gc.collect()
    log("ceilings again (drift check)")
    try:
        rep.data["ceilings_end"] = measure_ceilings(use_cuda, dtype)
    except Exception as e:  # e.g. out of memory while the engine's cache lingers
        rep.error("ceilings at the end", e)
    if args.tp:
        run_tp_section(args, rep, model_dir, use_cuda)


def run_tp_section(args: argparse.Namespace, rep: Report, model_dir: Path,
                   use_cuda: bool) -> None:
    """``--tp``: the same model served at each TP size (tools/bench_tp.py), after this
    process has given its GPU memory back."""
    import torch

    import bench_tp

    sizes = [int(t) for t in args.tp.split(",")]
    have = torch.cuda.device_count() if use_cuda else 0
    if max(sizes) > have:
        rep.data["skipped"].append(f"tensor parallel {sizes}: {have} GPUs")
        return
    torch.cuda.empty_cache()
    log(f"tensor parallel: cvllm serve at TP {sizes}")

    def save(runs):
        rep.data["tensor_parallel"] = runs
        rep.save()

    try:
        isq = engine_options(args).get("isq")  # --engine-opt isq=...: the same at every size
        tp_args = bench_tp.parse_args((["--isq", str(isq)] if isq else [])
                                      + ["--model-dir", str(model_dir)])
        folder = bench_tp.prepare_folder({}, tp_args)  # + seeded weights: one model at every size
        save(bench_tp.measure(sizes, folder, tp_args, save))
    except Exception as e:
        rep.error("tensor parallel", e)


if __name__ == "__main__":
    sys.exit(main())
