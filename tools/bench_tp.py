#!/usr/bin/env python3
"""Tensor-parallel scaling: the same server workload at TP=1, 2 (and 4) GPUs.

    PYTHONPATH=. python tools/bench_tp.py --tp 1,2 --out docs/benchmarks/bench-tp-h200x2.json

For each TP size it starts ``cvllm serve --d 0,..,tp-1`` (spawn mode: one process per
GPU, NCCL all-reduces) on an 8B Llama-3.1-shaped folder with random weights
(``--load-format dummy``), waits for ``/health``, then drives it with
``tools/bench_serving.py``:
- batch-1 decode: ``--concurrency 1`` requests one after another, tokens/s of one stream
  = 1000 / mean TPOT (time per output token after the first);
- batch-64 throughput: 64 concurrent requests, output tokens/s over the run.
Prompts are random token ids, outputs a fixed length (ignore_eos). It reports each figure
and the speed-ups over TP=1 (``speedup_batch1``, ``scaling_batch64``) in one JSON.
HTTP streaming is in every figure alike, so the ratios compare the engines.
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
import urllib.request
from pathlib import Path
from typing import Any, Dict, List

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))

import bench_model as bm  # noqa: E402


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"the server was not ready within {timeout:.0f}s")


def serving(url: str, out: Path, concurrency: int, num: int, args) -> Dict[str, Any]:
    cmd = [sys.executable, str(TOOLS / "bench_serving.py"), "--base-url", url,
           "--concurrency", str(concurrency), "--num-requests", str(num),
           "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--token-range", "100,120000", "--out", str(out), "--timeout", "240"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=300)
    return json.loads(out.read_text())


def run_tp(tp: int, folder: Path, port: int, args, work: Path) -> Dict[str, Any]:
    devices = ",".join(str(i) for i in range(tp))
    cmd = [sys.executable, "-m", "cvllm", "serve", "--w", str(folder), "--load-format", "dummy",
           "--d", devices, "--port", str(port), "--max-model-len", str(args.max_model_len),
           "--max-num-seqs", "64"]
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", CVLLM_NO_PROGRESS="1")
    log = open(work / f"serve-tp{tp}.log", "w")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, args.start_timeout)
        res: Dict[str, Any] = {"tp": tp, "startup_s": round(time.monotonic() - t0, 1)}
        b1 = serving(url, work / f"b1-tp{tp}.json", 1, args.batch1_requests, args)
        b64 = serving(url, work / f"b64-tp{tp}.json", 64, 64, args)
        res["batch1_tokens_per_s"] = 1000.0 / b1["tpot_ms"]["mean"]
        res["batch1_tpot_ms"] = b1["tpot_ms"]
        res["batch64_output_tokens_per_s"] = b64["output_throughput"]
        res["batch64_tpot_ms"] = b64["tpot_ms"]
        res["all_full_length"] = b1["all_full_length"] and b64["all_full_length"]
        res["failed"] = b1["failed"] + b64["failed"]
        log.flush()
        res["allreduce"] = sorted({line.split("all-reduce:", 1)[1].strip() for line in
                                   (work / f"serve-tp{tp}.log").read_text().splitlines()
                                   if "all-reduce:" in line})
        return res
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--batch1-requests", type=int, default=3)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--port", type=int, default=8431)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import torch

    work = Path(tempfile.mkdtemp(prefix="cvllm-tp-"))
    folder = bm.write_model_folder(work / "model", bm.build_config())
    report: Dict[str, Any] = {
        "schema": "cvllm-bench-tp/1", "command": " ".join(
            ([f"CVLLM_ALLREDUCE={os.environ['CVLLM_ALLREDUCE']}"]
             if os.environ.get("CVLLM_ALLREDUCE") else []) + ["python"] + sys.argv),
        "device": torch.cuda.get_device_name(0), "num_gpus": torch.cuda.device_count(),
        "model": "Llama-3.1-8B shape, bf16, random weights", "runs": []}
    out = Path(args.out)
    for i, tp in enumerate(int(t) for t in args.tp.split(",")):
        try:
            report["runs"].append(run_tp(tp, folder, args.port + 10 * i, args, work))
        except Exception as e:  # keep what was measured
            report["runs"].append({"tp": tp, "error": repr(e),
                                   "log_tail": (work / f"serve-tp{tp}.log").read_text()[-3000:]})
        out.write_text(json.dumps(report, indent=1))
        print(json.dumps(report["runs"][-1], indent=1), flush=True)
    base = next((r for r in report["runs"] if r["tp"] == 1 and "error" not in r), None)
    if base:
        for r in report["runs"]:
            if "error" not in r:
                r["speedup_batch1"] = r["batch1_tokens_per_s"] / base["batch1_tokens_per_s"]
                r["scaling_batch64"] = (r["batch64_output_tokens_per_s"]
                                        / base["batch64_output_tokens_per_s"])
    out.write_text(json.dumps(report, indent=1))
    print(json.dumps([{k: r.get(k) for k in ("tp", "batch1_tokens_per_s", "speedup_batch1",
                                              "batch64_output_tokens_per_s", "scaling_batch64",
                                              "error")} for r in report["runs"]], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
