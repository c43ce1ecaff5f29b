#!/usr/bin/env python3
"""Decode speed of a model through the whole engine (scheduler, runner, sampler,
detokenizer), at several numbers of concurrent streams.

    python tools/bench_decode.py                      # default model, CPU, 1 and 16 streams
    python tools/bench_decode.py --streams 1,4,16 --tokens 128 --json out.json

Each stream gets the same chat prompt and generates ``--tokens`` tokens with ignore_eos.
Prefill steps are excluded: only steps where every running sequence decodes one token
are timed. Reports tokens/s summed over streams, and per stream.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

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
    args = ap.parse_args()
    llm = LLM(weight_file=args.weight_file, weight_path=args.weight_path, cpu=args.cpu,
              dtype=args.dtype, max_model_len=2048)
    measure(llm, 1, 8)  # warm-up
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
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
