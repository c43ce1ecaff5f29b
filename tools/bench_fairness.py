#!/usr/bin/env python3
"""Fairness under a long prompt, through the engine: while one long prompt is prefilled,
how long a stream that is already decoding waits between two tokens, and how long a short
request sent meanwhile waits for its first token (issue 14 item 4).

    PYTHONPATH=. python tools/bench_fairness.py                         # default model, CPU
    PYTHONPATH=. python tools/bench_fairness.py --max-num-batched-tokens 512
    PYTHONPATH=. python tools/bench_fairness.py --prefill-chunk-size 0  # one-step prefill
    PYTHONPATH=. python tools/bench_fairness.py --w /models/X --gpu --out fair.json

Timeline: a ``stream`` request (``--stream-prompt`` tokens) starts and decodes a few
tokens; then the ``long`` request (``--long-prompt`` tokens of random words) is added;
``--short-delay`` seconds later the ``short`` request (``--short-prompt`` tokens) is sent.
The engine is driven as the server's engine thread drives it (``step()`` in a loop, new
requests taken between steps), so a request sent while a step runs waits for that step:
its TTFT is counted from the moment it was sent, not from the step boundary where it
was added. Reported: the stream's largest gap between two tokens while the long prompt
is prefilled (until the long request's first token), the short request's TTFT, the long
request's TTFT, the step budget and the load average. JSON to ``--out``. A benchmark,
not a test: the targets (CPU, default model, 2 cores: gap <= 1 s, short TTFT <= 2 s)
are printed beside the numbers, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cvllm.engine.llm import LLM  # noqa: E402
from cvllm.sampling_params import SamplingParams  # noqa: E402
from bench_prefix_cache import random_tokens  # noqa: E402  (tools/: the same synthetic text)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--w", "--weight-path", dest="weight_path", default=None)
    p.add_argument("--f", "--weight-file", dest="weight_file", default=None)
    p.add_argument("--gpu", action="store_true", help="run on CUDA (default: the CPU)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="step budget (default: the engine's for the device)")
    p.add_argument("--prefill-chunk-size", type=int, default=None)
    p.add_argument("--long-prompt", type=int, default=8100)
    p.add_argument("--stream-prompt", type=int, default=32)
    p.add_argument("--short-prompt", type=int, default=32)
    p.add_argument("--short-delay", type=float, default=1.0,
                   help="seconds after the long request that the short one is sent")
    p.add_argument("--max-model-len", type=int, default=0)
    p.add_argument("--no-overlap", action="store_true",
                   help="run the engine loop one step at a time (comparison)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if min(args.long_prompt, args.stream_prompt, args.short_prompt) < 1:
        p.error("prompt lengths must be positive")
    return args


class _Timeline:
    """Token arrival times per request, as the engine loop returns them."""

    def __init__(self) -> None:
        self.sent: Dict[str, float] = {}
        self.tokens: Dict[str, List[float]] = {}

    def send(self, engine, rid: str, prompt: List[int], params: SamplingParams,
             sent: Optional[float] = None) -> None:
        engine.add_request(rid, prompt, params)
        self.sent[rid] = time.perf_counter() if sent is None else sent
        self.tokens[rid] = []

    def record(self, outputs) -> None:
        now = time.perf_counter()
        for out in outputs:
            self.tokens[out.request_id].extend([now] * len(out.delta_token_ids))

    def ttft(self, rid: str) -> Optional[float]:
        t = self.tokens.get(rid)
        return t[0] - self.sent[rid] if t else None


def run(engine, args) -> Dict[str, Any]:
    rng, tok = random.Random(args.seed), engine.tokenizer
    greedy = dict(temperature=0.0, ignore_eos=True)
    long_prompt = random_tokens(tok, rng, args.long_prompt)
    tl = _Timeline()
    tl.send(engine, "stream", random_tokens(tok, rng, args.stream_prompt),
            SamplingParams(max_tokens=100_000, **greedy))
    while len(tl.tokens["stream"]) < 4:  # decoding before the long prompt comes
        tl.record(engine.step())
    tl.send(engine, "long", long_prompt, SamplingParams(max_tokens=2, **greedy))
    t_long = tl.sent["long"]
    short_at = t_long + args.short_delay
    steps = 0
    while not tl.tokens["long"] or (tl.sent.get("short") is None or not tl.tokens["short"]):
        if "short" not in tl.sent and time.perf_counter() >= short_at:
            # sent at short_at; the engine takes it at this step boundary
            tl.send(engine, "short", random_tokens(tok, rng, args.short_prompt),
                    SamplingParams(max_tokens=4, **greedy), sent=short_at)
        tl.record(engine.step())
        steps += 1
    t_done = tl.tokens["long"][0]
    # from the stream's last token before the long request to its first one after the
    # long request's first token
    times = tl.tokens["stream"]
    first = max(i for i, t in enumerate(times) if t < t_long)
    gaps = [b - a for a, b in zip(times[first:], times[first + 1:]) if a < t_done]
    engine.abort_request("stream")
    while engine.has_unfinished():
        engine.step()
    return {"long_ttft_s": tl.ttft("long"), "short_ttft_s": tl.ttft("short"),
            "stream_max_gap_s": max(gaps) if gaps else None,
            "stream_tokens_during_prefill": len(gaps), "steps": steps,
            "short_sent_during_prefill": short_at < t_done}


def main(argv=None) -> Dict[str, Any]:
    args = parse_args(argv)
    llm = LLM(weight_path=args.weight_path, weight_file=args.weight_file, cpu=not args.gpu,
              max_model_len=args.max_model_len,
              max_num_batched_tokens=args.max_num_batched_tokens,
              prefill_chunk_size=args.prefill_chunk_size)
    engine = llm.engine
    if args.no_overlap:
        engine.overlap = False
    sched = engine.config.scheduler
    load_before = os.getloadavg()
    res = run(engine, args)
    summary = {
        "model": engine.config.served_model_name, "device": engine.config.device.device,
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "prefill_chunk_size": sched.prefill_chunk_size, "overlap": engine.overlap,
        "long_prompt": args.long_prompt, "short_prompt": args.short_prompt,
        "short_delay_s": args.short_delay, "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(), "cpu_count": os.cpu_count(), **res,
    }
    print(f"budget {sched.max_num_batched_tokens} tokens/step, chunk cap "
          f"{sched.prefill_chunk_size}, overlap {engine.overlap}, load "
          f"{load_before[0]:.2f} -> {summary['loadavg_after'][0]:.2f}")
    print(f"long prompt of {args.long_prompt} tokens: first token after "
          f"{res['long_ttft_s']:.2f} s ({res['steps']} steps)")
    print(f"decoding stream: largest gap {res['stream_max_gap_s']:.3f} s over "
          f"{res['stream_tokens_during_prefill']} tokens meanwhile (target <= 1 s on CPU)")
    during = "" if res["short_sent_during_prefill"] else ", AFTER the long prompt's first token"
    print(f"short request sent {args.short_delay:.1f} s in{during}: first token after "
          f"{res['short_ttft_s']:.3f} s (target <= 2 s on CPU)")
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    main()
