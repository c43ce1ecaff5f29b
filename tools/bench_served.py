#!/usr/bin/env python3
"""Served throughput against the engine's own, same model, same workload, same run
(issue 14's first target: at 256 streams, served >= 0.85 of the engine, ITL p99 <= 3x p50).

    PYTHONPATH=. python tools/bench_served.py --concurrency 256 --out served.json
    PYTHONPATH=. python tools/bench_served.py --tp 2 --out served-tp2.json   # GPUs 0, 1

1. Writes an 8B Llama-3.1-shaped folder (``--config`` for another; random weights via
   ``--load-format dummy``, a word-level tokenizer made on the fly: ``bench_model``).
2. Engine alone, in a child process: ``LLM.generate`` over ``--concurrency`` prompts of
   ``--input-len`` random token ids, ``--output-len`` tokens each (ignore_eos), all
   submitted at once; one untimed round first (warm-up), then ``--rounds`` timed rounds;
   output tokens / wall time of the whole round (prefill included, as the served figure has it).
3. Served: ``cvllm serve`` on the same folder and ``tools/bench_serving.py`` with the same
   prompts shape, ``--concurrency`` streamed completions at once, a warm-up round first.
Reports both, their ratio, and the client's TTFT / ITL percentiles. ``--tp N`` runs both
on N ranks (the engine alone under torchrun, every rank in the SPMD job, rank 0 timing;
served as ``cvllm serve --d 0,..,N-1``); ``--isq TYPE`` quantizes both while loading.
``--servers api,one`` serves twice in the same run: with the API process (the default of
``cvllm serve``) and with ``--no-api-process`` (HTTP in rank 0's process); the ratio is
reported for each.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))

import bench_model as bm  # noqa: E402
from bench_tp import stop_server, wait_healthy  # noqa: E402


def engine_alone(args: argparse.Namespace) -> Dict[str, Any]:
    """Runs in the child process: the engine's own throughput (no HTTP)."""
    from cvllm.engine.llm import LLM

    options = dict(weight_path=args.folder, load_format="dummy", max_model_len=args.max_model_len,
                   max_num_seqs=args.concurrency, seed=0, **engine_flags(args))
    if args.tp == 1:
        return engine_rounds(LLM(**options), args)
    from cvllm.runtime.job import run_job
    from cvllm.runtime.spmd import ParallelOptions

    result: Dict[str, Any] = {}
    run_job(ParallelOptions(device_ids=(0,), cpu=args.cpu), options,
            lambda rank0: result.update(engine_rounds(
                LLM.from_engine(rank0.build_engine()[0]), args)))
    return result  # empty on the ranks other than 0


def engine_flags(args: argparse.Namespace) -> Dict[str, Any]:
    """The engine options both runs share beyond the model and the batch."""
    return {**({"isq": args.isq} if args.isq else {}),
            **({"cpu": True, "kvcache_mem_mb": 64} if args.cpu else {})}


def engine_rounds(llm, args: argparse.Namespace) -> Dict[str, Any]:
    import random

    from cvllm.sampling_params import SamplingParams

    rng = random.Random(0)
    vocab = int(json.loads((Path(args.folder) / "config.json").read_text())["vocab_size"])
    params = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True)
    rounds = []
    for r in range(args.rounds + 1):
        prompts = [[rng.randrange(min(100, vocab // 2), min(vocab, 120000))
                    for _ in range(args.input_len)]
                   for _ in range(args.concurrency)]
        t0 = time.perf_counter()
        results = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
        tokens = sum(len(res.token_ids) for res in results)
        if r:  # round 0 warms up
            rounds.append({"wall_s": round(wall, 3), "output_tokens": tokens,
                           "output_throughput": round(tokens / wall, 1)})
        print(f"engine round {r}: {tokens / wall:.0f} tok/s", flush=True)
    return {"rounds": rounds, "output_throughput": max(x["output_throughput"] for x in rounds)}


SERVER_FLAGS = {"api": [], "one": ["--no-api-process"]}
"""``--servers`` names: the extra ``cvllm serve`` flags of each way of serving."""


def served(args: argparse.Namespace, work: Path, flags: List[str]) -> Dict[str, Any]:
    cmd = [sys.executable, "-m", "cvllm", "serve", "--w", args.folder, "--load-format", "dummy",
           "--port", str(args.port), "--max-model-len", str(args.max_model_len),
           "--max-num-seqs", str(args.concurrency),
           "--d", ",".join(str(i) for i in range(args.tp))] \
        + (["--isq", args.isq] if args.isq else []) + (["--cpu", "--mem", "64"] if args.cpu else []) + flags
    env = dict(os.environ, CVLLM_NO_PROGRESS="1", NCCL_NVLS_ENABLE="0")
    log = open(work / "serve.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{args.port}"
    vocab = int(json.loads((Path(args.folder) / "config.json").read_text())["vocab_size"])
    try:
        try:
            wait_healthy(url, proc, args.start_timeout)
        except RuntimeError:
            raise SystemExit("the server did not start:\n" + (work / "serve.log").read_text()[-3000:])
        rounds = []
        for r in range(args.rounds + 1):
            out = work / f"served-{r}.json"
            client = [sys.executable, str(TOOLS / "bench_serving.py"), "--base-url", url,
                      "--concurrency", str(args.concurrency), "--num-requests", str(args.concurrency),
                      "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                      "--token-range", f"{min(100, vocab // 2)},{min(vocab, 120000) - 1}",
                      "--warmup", "0", "--seed", str(r),
                      "--out", str(out), "--timeout", "240"]
            subprocess.run(client, check=True, stdout=subprocess.DEVNULL, timeout=300)
            rep = json.loads(out.read_text())
            print(f"served round {r}: {rep['output_throughput']:.0f} tok/s", flush=True)
            if r:
                rounds.append({k: rep.get(k) for k in ("output_throughput", "duration_s", "completed",
                                                       "failed", "all_full_length", "ttft_ms",
                                                       "itl_ms", "tpot_ms", "client_cpu_fraction")})
        best = max(rounds, key=lambda x: x["output_throughput"])
        return {"rounds": rounds, "output_throughput": best["output_throughput"], "best": best}
    finally:
        stop_server(proc)
        log.close()


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="a config.json instead of the 8B Llama 3.1 shape")
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2, help="timed rounds after a warm-up round")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--port", type=int, default=8432)
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor-parallel ranks of both runs (GPUs 0..N-1; the engine alone "
                    "runs under torchrun)")
    ap.add_argument("--isq", default=None, help="quantize the weights while loading (q4k, ...)")
    ap.add_argument("--cpu", action="store_true", help="CPU ranks (a smoke test of the tool)")
    ap.add_argument("--servers", default="api",
                    help="comma list of: api (cvllm serve's default, the API process), one "
                    "(--no-api-process); each serves the same workload in turn")
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--engine-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def main() -> int:
    args = parse_args()
    if args.engine_only:
        result = engine_alone(args)
        if result:  # rank 0
            print("RESULT " + json.dumps(result), flush=True)
        return 0
    names = [x.strip() for x in args.servers.split(",") if x.strip()]
    unknown = sorted(set(names) - set(SERVER_FLAGS))
    if unknown or not names:
        raise SystemExit(f"--servers: unknown {unknown or names}; choose from {sorted(SERVER_FLAGS)}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(tempfile.mkdtemp(prefix="cvllm-served-"))
    cfg = bm.build_config(args.config)
    args.folder = str(bm.write_model_folder(work / "model", cfg))
    child_args = ["--engine-only", "--folder", args.folder]
    for name in ("concurrency", "input_len", "output_len", "rounds", "max_model_len", "tp"):
        child_args += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    child_args += (["--isq", args.isq] if args.isq else []) + (["--cpu"] if args.cpu else [])
    launcher = [sys.executable] if args.tp == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.tp),
        "--master-port", str(args.port + 1)]
    child = subprocess.run(launcher + [__file__] + child_args, capture_output=True, text=True,
                           timeout=600, env=dict(os.environ, NCCL_NVLS_ENABLE="0"))
    lines = [ln for ln in child.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        raise SystemExit(f"engine-alone run failed:\n{child.stdout[-3000:]}\n{child.stderr[-3000:]}")
    engine = json.loads(lines[-1][len("RESULT "):])
    runs = {}
    for name in names:
        srv = served(args, work, SERVER_FLAGS[name])
        itl = srv["best"]["itl_ms"]
        runs[name] = {
            "flags": SERVER_FLAGS[name], "served": srv,
            "served_over_engine": round(srv["output_throughput"] / engine["output_throughput"], 3),
            "itl_p99_over_p50": round(itl["p99"] / itl["p50"], 2) if itl and itl.get("p50") else None,
        }
    first = runs[names[0]]
    report = {
        "schema": "cvllm-bench-served/2", "command": "python " + " ".join(sys.argv),
        "concurrency": args.concurrency, "input_len": args.input_len, "output_len": args.output_len,
        "tp": args.tp, "isq": args.isq, "engine": engine,
        "served": first["served"], "served_over_engine": first["served_over_engine"],
        "itl_p99_over_p50": first["itl_p99_over_p50"], "servers": runs,
    }
    try:
        import torch

        report["device"] = torch.cuda.get_device_name(0) \
            if torch.cuda.is_available() and not args.cpu else "cpu"
        report["torch"] = torch.__version__
    except Exception:
        pass
    for name, run in runs.items():
        best = run["served"]["best"]
        print(f"[{name}] engine {engine['output_throughput']:.0f} tok/s, served "
              f"{run['served']['output_throughput']:.0f} tok/s ({run['served_over_engine']:.2f}x), "
              f"TTFT p50 {best['ttft_ms']['p50']:.0f} ms, ITL p50 {best['itl_ms']['p50']:.1f} "
              f"p99 {best['itl_ms']['p99']:.1f} ms ({run['itl_p99_over_p50']}x), client CPU "
              f"{best.get('client_cpu_fraction') or 0:.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
