#!/usr/bin/env python3
"""Decode speed of a model through the whole engine (scheduler, runner, sampler,
detokenizer), at several numbers of concurrent streams.

    python tools/bench_decode.py                      # default model, CPU, 1 and 16 streams
    python tools/bench_decode.py --streams 1,4,16 --tokens 128 --json out.json
    python tools/bench_decode.py --cpu --dtype bf16 --peer llama.cpp   # side by side

Each stream gets the same chat prompt and generates ``--tokens`` tokens with ignore_eos.
Prefill steps are excluded: only steps where every running sequence decodes one token
are timed. Reports tokens/s summed over streams, and per stream.

``--peer llama.cpp`` also decodes the same GGUF file with llama.cpp (llama-cpp-python,
``--peer-threads`` threads, default 2), the same prompt tokens and the same number of
greedy tokens, in a subprocess (tools/peer_llama_cpp.py), alternating ``--rounds`` times
with cvllm's 1-stream run so that both see the same machine; each side reports its best
round. Without llama_cpp installed the peer is skipped with a message saying how to build
it, and cvllm is still measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from typing import Dict, List, Optional

from cvllm.engine.llm import LLM
from cvllm.sampling_params import SamplingParams

PROMPT = "Write a long story about a lighthouse keeper and a storm."


def measure(llm: LLM, streams: int, tokens: int) -> dict:
    engine = llm.engine
    prompt = llm.tokenizer.render_chat([{"role": "user", "content": PROMPT}])
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for i in range(streams):
        engine.add_request(f"bench-{streams}-{i}", prompt, params)
    decode_time, decode_tokens, steps = 0.0, 0, 0
    while engine.has_unfinished():
        all_decode = all(s.num_computed_tokens == len(s.token_ids) - 1 for s in engine.scheduler.running) \
            and engine.scheduler.num_waiting == 0 and engine.scheduler.num_running == streams
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        if all_decode:
            decode_time += dt
            decode_tokens += sum(len(o.delta_token_ids) for o in outs)
            steps += 1
    return {
        "streams": streams, "decode_steps": steps, "decode_tokens": decode_tokens,
        "tokens_per_s": decode_tokens / decode_time if decode_time else 0.0,
        "tokens_per_s_per_stream": decode_tokens / decode_time / streams if decode_time else 0.0,
        "ms_per_step": 1000 * decode_time / steps if steps else 0.0,
    }


def peer_llama_cpp(gguf: str, prompt_ids: List[int], tokens: int, threads: int) -> Dict:
    """One run of tools/peer_llama_cpp.py in a subprocess (its OpenMP threads never share
    a process with torch's); its JSON result, or ``{"error": ...}``."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer_llama_cpp.py")
    req = json.dumps({"gguf": gguf, "prompt_ids": prompt_ids, "tokens": tokens})
    proc = subprocess.run([sys.executable, script, "--threads", str(threads)], input=req,
                          capture_output=True, text=True)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = (proc.stderr or proc.stdout).strip()[-2000:]
        return {"peer": "llama.cpp", "error": f"exit status {proc.returncode}: {tail}"}


def _peer_gguf(args) -> Optional[str]:
    """The GGUF file both sides decode (the default model's when none is given)."""
    if args.weight_file:
        return args.weight_file
    if args.weight_path:
        return None
    from cvllm.loader import default_model_path

    return str(default_model_path())


def _peer_skip(args) -> Optional[str]:
    """Why ``--peer`` cannot run here (printed), or None."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from peer_llama_cpp import missing

    skip = missing()
    if skip is None and _peer_gguf(args) is None:
        skip = "--peer needs a GGUF file (--weight-file, or the default model)"
    if skip:
        print(f"--peer llama.cpp skipped: {skip}", file=sys.stderr)
    return skip


def side_by_side(llm: LLM, args, gguf: str) -> Dict:
    """Alternate llama.cpp's and cvllm's 1-stream decode ``args.rounds`` times; the best
    round of each and their ratio."""
    prompt = llm.tokenizer.render_chat([{"role": "user", "content": PROMPT}])
    peer_runs, ours = [], []
    for _ in range(args.rounds):
        peer_runs.append(peer_llama_cpp(gguf, prompt, args.tokens, args.peer_threads))
        if "error" in peer_runs[-1]:
            print(f"llama.cpp peer failed:\n{peer_runs[-1]['error']}", file=sys.stderr)
            return {"peer": peer_runs[-1]}
        ours.append(measure(llm, 1, args.tokens))
        print(f"round {len(ours)}: llama.cpp {peer_runs[-1]['tokens_per_s']:.1f} tok/s, "
              f"cvllm {ours[-1]['tokens_per_s']:.1f} tok/s (1 stream)", file=sys.stderr)
    peer = max(peer_runs, key=lambda r: r["tokens_per_s"])
    peer = {k: v for k, v in peer.items() if k != "rounds_tokens_per_s"}  # one inner round
    best = max(ours, key=lambda r: r["tokens_per_s"])
    return {"peer": dict(peer, gguf=gguf, rounds=[r["tokens_per_s"] for r in peer_runs]),
            "cvllm_1_stream": dict(best, rounds=[r["tokens_per_s"] for r in ours]),
            "cvllm_over_peer_1_stream": best["tokens_per_s"] / peer["tokens_per_s"]}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weight-file", default=None, help="a .gguf file (default: the default model)")
    ap.add_argument("--weight-path", default=None, help="an HF folder")
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--cpu", action="store_true", default=False)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--json", default=None, help="write the results here too")
    ap.add_argument("--peer", choices=["llama.cpp"], default=None,
                    help="also decode the same GGUF with this engine (1 stream), side by side")
    ap.add_argument("--peer-threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="alternations with --peer")
    args = ap.parse_args()
    peer_skip = _peer_skip(args) if args.peer else None
    llm = LLM(weight_file=args.weight_file, weight_path=args.weight_path, cpu=args.cpu,
              dtype=args.dtype, max_model_len=2048)
    measure(llm, 1, 8)  # warm-up
    peer = None
    if args.peer and not peer_skip:
        peer = side_by_side(llm, args, _peer_gguf(args))
    results = [measure(llm, int(n), args.tokens) for n in args.streams.split(",")]
    import torch

    report = {
        "model": llm.engine.config.served_model_name,
        "device": llm.engine.config.device.device,
        "dtype": llm.engine.config.model.dtype,
        "machine": _cpu_name(),
        "command": " ".join(["python"] + sys.argv),
        "torch_threads": torch.get_num_threads(),
        "results": results,
    }
    if args.peer:
        report["peer"] = peer if peer is not None else {"peer": args.peer, "error": peer_skip}
        if peer and "cvllm_1_stream" in peer:
            base = peer["peer"]["tokens_per_s"]
            report["vs_peer_1_stream"] = {
                f"cvllm_{r['streams']}_streams_over_peer_1_stream": r["tokens_per_s"] / base
                for r in results}
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
