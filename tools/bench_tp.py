#!/usr/bin/env python3
"""Tensor-parallel scaling: the same server workload at TP=1, 2 (and 4) GPUs.

    PYTHONPATH=. python tools/bench_tp.py --tp 1,2 --out docs/benchmarks/bench-tp-h200x2.json
    python tools/bench.py --tp 1,2,4 ...     # the same, as a section of bench.py's report

For each TP size it starts ``cvllm serve --d 0,..,tp-1`` (spawn mode: one process per
GPU; the all-reduces of ``distributed/comm.py``, custom or NCCL, as ``CVLLM_ALLREDUCE``
chooses) on an 8B Llama-3.1-shaped folder (or ``--config``) with seeded random weights
written once as safetensors (``--weights random``; ``--weights dummy``: each rank draws
its own shard, quicker, speed only), waits for ``/health``, then drives it with
``tools/bench_serving.py``:
- batch-1 decode: ``--concurrency 1`` requests one after another, tokens/s of one stream
  = 1000 / mean TPOT (time per output token after the first);
- batch-64 throughput: 64 concurrent requests, output tokens/s over the run, with the
  round's first-token percentiles and duration and the server's /metrics counters after
  it (KV blocks, preemptions, steps, queue time) (``--batch64-requests 0`` skips it).
Prompts are random token ids, outputs a fixed length (ignore_eos). It reports each figure
and the speed-ups over TP=1 (``speedup_batch1``, ``scaling_batch64``) in one JSON, with
each server's start-up notes (weights, memory plan, KV cache, CUDA graphs, all-reduce).
HTTP streaming is in every figure alike, so the ratios compare the engines.

``--isq q4k`` (or any ``--isq`` type) quantizes the weights while loading, at every TP
size alike. Each server also answers ``--agree-prompts`` fixed token-id prompts greedily
(``--agree-tokens`` tokens, the top 20 log-probabilities of each), and every run is
compared with TP=1's (``agreement``): identical, or at the first divergence each side's
token in the other's top 5, with both sides' log-probabilities of the two tokens there
and each token's rank in the other's top 20 (the measured reason: a near tie that the
ranks' different summation order can flip).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Dict, List, Optional

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


def serving(url: str, out: Path, concurrency: int, num: int, args, vocab: int
            ) -> Dict[str, Any]:
    cmd = [sys.executable, str(TOOLS / "bench_serving.py"), "--base-url", url,
           "--concurrency", str(concurrency), "--num-requests", str(num),
           "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--token-range", f"{min(100, vocab // 2)},{min(vocab, 120000) - 1}",
           "--out", str(out), "--timeout", "240"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=300)
    return json.loads(out.read_text())


def agreement_prompts(n: int, vocab: int, length: int = 24, seed: int = 7
                      ) -> List[List[int]]:
    """``n`` fixed token-id prompts below ``vocab`` (the same at every TP size)."""
    import random

    rng = random.Random(seed)
    hi = max(2, min(30000, vocab))
    return [[rng.randrange(min(100, hi - 1), hi) for _ in range(length)] for _ in range(n)]


def greedy_outputs(url: str, prompts: List[List[int]], tokens: int, top: int = 20
                   ) -> List[Dict[str, Any]]:
    """Each prompt's greedy completion through ``/v1/completions``: its tokens and, for
    each, the ``top`` most likely tokens' log-probabilities (token text -> logprob)."""
    out = []
    for p in prompts:
        body = {"prompt": p, "max_tokens": tokens, "temperature": 0.0, "logprobs": top,
                "ignore_eos": True}
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            lp = json.loads(r.read())["choices"][0]["logprobs"]
        out.append({"tokens": lp["tokens"], "top": lp["top_logprobs"]})
    return out


def _standing(top: Dict[str, float], token: str) -> Dict[str, Any]:
    """Where ``token`` stands in one position's top list: its rank (1 = the greedy
    choice; None past the list) and how many nats below the best it is."""
    order = sorted(top, key=lambda t: -top[t])
    if token not in top:
        return {"rank": None, "below_best": None}
    return {"rank": order.index(token) + 1, "below_best": round(top[order[0]] - top[token], 4)}


def compare_greedy(base: List[Dict[str, Any]], other: List[Dict[str, Any]],
                   k: int = 5) -> Dict[str, Any]:
    """``other``'s greedy outputs against ``base``'s, prompt by prompt: identical, diverged
    between tokens in each other's top ``k``, or a problem (a token outside the other's
    top ``k``, lengths). Each divergence keeps both sides' log-probabilities of both
    tokens and each token's standing in the other side's list (rank, nats below its
    best): the measured reason, e.g. a near tie."""
    res: Dict[str, Any] = {"prompts": len(base), "identical": 0, "diverged_in_top5": 0,
                           "problems": [], "divergences": []}
    for i, (a, b) in enumerate(zip(base, other)):
        at = next((j for j, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y),
                  None)
        if at is None:
            if len(a["tokens"]) == len(b["tokens"]):
                res["identical"] += 1
            else:
                res["problems"].append(f"prompt {i}: lengths {len(a['tokens'])} vs "
                                       f"{len(b['tokens'])}")
            continue
        x, y = a["tokens"][at], b["tokens"][at]
        ta, tb = a["top"][at], b["top"][at]
        in_base, in_other = _standing(ta, y), _standing(tb, x)
        res["divergences"].append({"prompt": i, "position": at, "base_token": x,
                                   "other_token": y, "base_logprobs": [ta.get(x), ta.get(y)],
                                   "other_logprobs": [tb.get(x), tb.get(y)],
                                   "other_token_in_base": in_base,
                                   "base_token_in_other": in_other})
        if all(s["rank"] is not None and s["rank"] <= k for s in (in_base, in_other)):
            res["diverged_in_top5"] += 1
        else:
            res["problems"].append(
                f"prompt {i}, token {at}: {x!r} vs {y!r}, not in each other's top {k} "
                f"(ranks {in_other['rank']} / {in_base['rank']}, "
                f"{in_other['below_best']} / {in_base['below_best']} nats below the best)")
    if len(other) != len(base):
        res["problems"].append(f"{len(other)} outputs against {len(base)}")
    res["agrees"] = not res["problems"]
    return res


def run_tp(tp: int, folder: Path, port: int, args, work: Path) -> Dict[str, Any]:
    devices = ",".join(str(i) for i in range(tp))
    cmd = [sys.executable, "-m", "cvllm", "serve", "--w", str(folder), "--load-format",
           "dummy" if args.weights == "dummy" else "auto", "--d", devices, "--port", str(port), "--max-model-len", str(args.max_model_len),
           "--max-num-seqs", str(args.max_num_seqs)] + (["--isq", args.isq] if args.isq else []) \
        + (["--cpu", "--mem", "64"] if args.cpu else [])
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", CVLLM_NO_PROGRESS="1")
    log = open(work / f"serve-tp{tp}.log", "w")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, args.start_timeout)
        res: Dict[str, Any] = {"tp": tp, "startup_s": round(time.monotonic() - t0, 1)}
        vocab = int(json.loads((folder / "config.json").read_text())["vocab_size"])
        b1 = serving(url, work / f"b1-tp{tp}.json", 1, args.batch1_requests, args, vocab)
        res["batch1_tokens_per_s"] = 1000.0 / b1["tpot_ms"]["mean"]
        res["batch1_tpot_ms"] = b1["tpot_ms"]
        res["all_full_length"], res["failed"] = b1["all_full_length"], b1["failed"]
        if args.batch64_requests:
            b64 = serving(url, work / f"b64-tp{tp}.json", 64, args.batch64_requests, args,
                          vocab)
            res["batch64_output_tokens_per_s"] = b64["output_throughput"]
            res["batch64_tpot_ms"] = b64["tpot_ms"]
            # where a slow round's time went: first tokens late, or the decode
            res["batch64_ttft_ms"] = b64["ttft_ms"]
            res["batch64_duration_s"] = b64["duration_s"]
            res["batch64_server"] = server_counters(url)
            res["all_full_length"] = res["all_full_length"] and b64["all_full_length"]
            res["failed"] += b64["failed"]
        if args.agree_prompts:
            res["greedy"] = greedy_outputs(url, agreement_prompts(args.agree_prompts, vocab),
                                           args.agree_tokens)
        log.flush()
        lines = (work / f"serve-tp{tp}.log").read_text().splitlines()
        res["allreduce"] = sorted({line.split("all-reduce:", 1)[1].strip() for line in lines
                                   if "all-reduce:" in line})
        res["startup_notes"] = startup_notes(lines)
        return res
    finally:
        stop_server(proc)
        log.close()


_NOTES = ("KV cache:", "memory:", "CUDA graphs", "CUDA graph capture failed", "weights:",
          "all-reduce:")
_COUNTERS = ("cvllm_kv_blocks_total", "cvllm_preemptions_total", "cvllm_steps_total",
             "cvllm_prompt_tokens_total", "cvllm_generation_tokens_total",
             "cvllm_prefix_cache_hits_total", "cvllm_request_queue_time_seconds_sum",
             "cvllm_request_queue_time_seconds_count")


def startup_notes(lines: List[str]) -> List[str]:
    """The server log's lines on the KV cache size, the memory plan, the CUDA graphs and
    the weights (rank 0's, without their time stamps): what a slow round is read against."""
    notes = []
    for line in lines:
        for key in _NOTES:
            if key in line:
                text = line[line.index(key):].strip()
                if text not in notes:
                    notes.append(text)
                break
    return notes[:24]


def server_counters(url: str) -> Dict[str, float]:
    """The server's /metrics counters after a round (cumulative since its start): KV
    blocks, preemptions, steps, tokens, prefix hits and the queue time of finished
    requests; {} when /metrics cannot be read."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except Exception:  # noqa: BLE001 - a figure lost, not the run (IncompleteRead too)
        return {}
    out: Dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in _COUNTERS:
            out[name[len("cvllm_"):]] = float(value)
    return out


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (it runs in its own session), SIGKILL after
    60 s; nothing when it is gone already."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--config", help="a config.json instead of the 8B Llama 3.1 shape")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--batch1-requests", type=int, default=3)
    ap.add_argument("--batch64-requests", type=int, default=64,
                    help="requests of the concurrency-64 run (0 skips it)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=64,
                    help="the servers' --max-num-seqs (the batch-64 round's 64 requests "
                         "all fit at the default)")
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--port", type=int, default=8431)
    ap.add_argument("--isq", default=None,
                    help="quantize the weights while loading (cvllm serve --isq), e.g. q4k")
    ap.add_argument("--agree-prompts", type=int, default=8,
                    help="greedy prompts compared with TP=1 (0 skips them)")
    ap.add_argument("--agree-tokens", type=int, default=32)
    ap.add_argument("--weights", choices=("random", "dummy"), default="random",
                    help="random: seeded safetensors written once and loaded by every TP "
                    "size (the same model, so the agreement means something); dummy: "
                    "--load-format dummy (each rank draws its own shard: faster start-up, "
                    "no agreement)")
    ap.add_argument("--cpu", action="store_true", help="CPU ranks (a smoke test of the tool)")
    ap.add_argument("--model-dir", help="write the model folder here (and keep it); an "
                    "existing folder with weights is reused")
    ap.add_argument("--keep-logs", action="store_true",
                    help="keep the servers' logs (kept anyway when a run fails)")
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def measure(tps: List[int], folder: Path, args: argparse.Namespace,
            on_run=None) -> List[Dict[str, Any]]:
    """One ``run_tp`` per size (an error is recorded, the others go on), then each run's
    speed-ups over TP=1 (``speedup_batch1``, ``scaling_batch64``)."""
    work = Path(tempfile.mkdtemp(prefix="cvllm-tp-"))
    runs: List[Dict[str, Any]] = []
    for i, tp in enumerate(tps):
        try:
            runs.append(run_tp(tp, folder, args.port + 10 * i, args, work))
        except Exception as e:  # keep what was measured
            log_file = work / f"serve-tp{tp}.log"
            runs.append({"tp": tp, "error": repr(e), "log_tail":
                         log_file.read_text()[-3000:] if log_file.exists() else ""})
        print(json.dumps(runs[-1], indent=1), flush=True)
        if on_run is not None:
            on_run(runs)
    base = next((r for r in runs if r["tp"] == 1 and "error" not in r), None)
    if base:
        for r in runs:
            if "error" not in r:
                r["speedup_batch1"] = r["batch1_tokens_per_s"] / base["batch1_tokens_per_s"]
                if "batch64_output_tokens_per_s" in r:
                    r["scaling_batch64"] = (r["batch64_output_tokens_per_s"]
                                            / base["batch64_output_tokens_per_s"])
                if r is not base and "greedy" in base and "greedy" in r:
                    r["agreement"] = compare_greedy(base["greedy"], r["greedy"])
    if args.keep_logs or any(_went_wrong(r) for r in runs):
        print(f"server logs kept in {work}", flush=True)
    else:  # what they say that matters is in each run's startup_notes
        shutil.rmtree(work, ignore_errors=True)
    return runs


def _went_wrong(run: Dict[str, Any]) -> bool:
    """A run worth its server's whole log: an error, failed or short requests, or
    outputs that do not agree with TP=1."""
    return ("error" in run or run.get("failed", 0) > 0 or not run.get("all_full_length", True)
            or not (run.get("agreement") or {}).get("agrees", True))


def prepare_folder(cfg: Dict[str, Any], args: argparse.Namespace) -> Path:
    """The model folder every TP size serves: config + tokenizer (kept when the folder
    has a config.json already), and with ``--weights random`` seeded safetensors
    (``bench_model.write_random_weights``; kept when the folder has them already). With
    ``dummy`` weights each rank draws its own shard, so the TP sizes would serve different
    models: no agreement is compared then."""
    base = Path(args.model_dir) if args.model_dir else Path(tempfile.mkdtemp(
        prefix="cvllm-tp-model-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    if not (base / "config.json").exists():
        bm.write_model_folder(base, cfg)
    if args.weights == "dummy":
        args.agree_prompts = 0
    elif not (base / "model.safetensors.index.json").exists():
        t0 = time.monotonic()
        bm.write_random_weights(base)
        print(f"random weights written in {time.monotonic() - t0:.0f}s", flush=True)
    return base


def main() -> int:
    args = parse_args()
    if not args.out:
        raise SystemExit("--out is required")
    # A SIGTERM (e.g. from `timeout`) unwinds through run_tp's cleanup: the servers run in
    # their own sessions and would otherwise keep their GPUs after this process is gone.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    import torch

    cfg = bm.build_config(args.config)
    folder = prepare_folder(cfg, args)
    try:
        return report_runs(cfg, folder, args, torch)
    finally:
        if not args.model_dir:
            shutil.rmtree(folder, ignore_errors=True)


def report_runs(cfg: Dict[str, Any], folder: Path, args: argparse.Namespace, torch) -> int:
    report: Dict[str, Any] = {
        "schema": "cvllm-bench-tp/1", "command": " ".join(
            ([f"CVLLM_ALLREDUCE={os.environ['CVLLM_ALLREDUCE']}"]
             if os.environ.get("CVLLM_ALLREDUCE") else []) + ["python"] + sys.argv),
        "device": "cpu" if args.cpu else torch.cuda.get_device_name(0),
        "num_gpus": 0 if args.cpu else torch.cuda.device_count(),
        "model": ("Llama-3.1-8B shape" if not args.config else args.config)
        + (", bf16, seeded random weights loaded from safetensors" if args.weights == "random"
           else ", bf16, --load-format dummy") + (f", quantized while loading (--isq {args.isq})"
                                                  if args.isq else ""),
        "config": cfg, "runs": []}
    out = Path(args.out)

    def save(runs):
        report["runs"] = runs
        out.write_text(json.dumps(report, indent=1))

    save(measure([int(t) for t in args.tp.split(",")], folder, args, save))
    print(json.dumps([{k: (r.get(k) if k != "agreement" else
                           {a: (r.get(k) or {}).get(a) for a in ("agrees", "identical",
                                                                 "diverged_in_top5")})
                       for k in ("tp", "batch1_tokens_per_s", "speedup_batch1",
                                 "batch64_output_tokens_per_s", "scaling_batch64", "agreement",
                                 "error")} for r in report["runs"]], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
