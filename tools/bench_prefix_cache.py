#!/usr/bin/env python3
"""Time to first token (TTFT) of a request that shares a long prefix with an earlier one,
against the earlier one's, through the engine: what the prefix cache buys.

    PYTHONPATH=. python tools/bench_prefix_cache.py                   # default model, CPU
    PYTHONPATH=. python tools/bench_prefix_cache.py --prefix-len 1500 --rounds 3 --out pc.json
    PYTHONPATH=. python tools/bench_prefix_cache.py --disable-prefix-cache   # the baseline
    PYTHONPATH=. python tools/bench_prefix_cache.py --w /models/X --gpu

Each round draws a fresh prefix of ``--prefix-len`` tokens (random words, tokenized and
cut to length) and runs two requests one after the other, each alone: ``cold`` = prefix
+ suffix A, then ``hit`` = the same prefix + suffix B (``--suffix-len`` tokens each), so
the second can reuse the first's full blocks. TTFT is the wall time from ``add_request``
to the ``step()`` that returns the request's first token (the engine's own loop: on the
CPU that step has already launched the next decode, as when serving). A short request
first warms the engine up. Reported per round and as medians: both TTFTs, their ratio,
the cached prompt tokens of the hit (``RequestOutput.num_cached_tokens``) and the
engine's prefix-cache counters. JSON to ``--out``. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cvllm.engine.llm import LLM  # noqa: E402
from cvllm.sampling_params import SamplingParams  # noqa: E402

WORDS = ("time person year way day thing man world life hand part child eye woman place work "
         "week case point government company number group problem fact river light stone "
         "cloud market garden letter music window system water history story paper").split()


def random_tokens(tokenizer, rng: random.Random, n: int) -> List[int]:
    """``n`` token ids of random English words."""
    ids: List[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(n)))
    return ids[:n]


def time_request(engine, request_id: str, prompt: List[int], max_tokens: int) -> Dict[str, Any]:
    """Run one request alone to the end; its TTFT, total time and cached tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    ttft, cached, done = None, 0, False
    while not done:
        for out in engine.step():
            if out.request_id != request_id:
                continue
            if ttft is None and out.delta_token_ids:
                ttft = time.perf_counter() - start
            cached = out.num_cached_tokens
            done = out.finished
    while engine.has_unfinished():  # a step launched past the end
        engine.step()
    return {"prompt_tokens": len(prompt), "ttft_s": ttft,
            "total_s": time.perf_counter() - start, "cached_tokens": cached}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--w", "--weight-path", dest="weight_path", default=None)
    p.add_argument("--f", "--weight-file", dest="weight_file", default=None)
    p.add_argument("--gpu", action="store_true", help="run on CUDA (default: the CPU)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--prefix-len", type=int, default=1500)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--disable-prefix-cache", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.prefix_len < 1 or args.suffix_len < 1:
        p.error("--prefix-len and --suffix-len must be positive")
    if args.prefix_len + args.suffix_len + args.max_tokens > args.max_model_len:
        p.error("prefix + suffix + max tokens exceed --max-model-len")
    if not 1 <= args.rounds <= 100:
        p.error("--rounds must be in 1..100")
    return args


def main(argv=None) -> Dict[str, Any]:
    args = parse_args(argv)
    llm = LLM(weight_path=args.weight_path, weight_file=args.weight_file, cpu=not args.gpu,
              dtype=args.dtype, max_model_len=args.max_model_len,
              disable_prefix_cache=args.disable_prefix_cache)
    engine, rng = llm.engine, random.Random(args.seed)
    tok = engine.tokenizer
    time_request(engine, "warm-up", random_tokens(tok, rng, 64), args.max_tokens)
    rounds = []
    for r in range(args.rounds):
        prefix = random_tokens(tok, rng, args.prefix_len)
        cold = time_request(engine, f"cold-{r}",
                            prefix + random_tokens(tok, rng, args.suffix_len), args.max_tokens)
        hit = time_request(engine, f"hit-{r}",
                           prefix + random_tokens(tok, rng, args.suffix_len), args.max_tokens)
        rounds.append({"cold": cold, "hit": hit, "speedup": cold["ttft_s"] / hit["ttft_s"]})
        print(f"round {r}: cold TTFT {cold['ttft_s'] * 1e3:.1f} ms, hit TTFT "
              f"{hit['ttft_s'] * 1e3:.1f} ms ({hit['cached_tokens']} of "
              f"{hit['prompt_tokens']} prompt tokens cached): {rounds[-1]['speedup']:.1f}x")
    metrics = engine.metrics()
    summary = {
        "model": engine.config.served_model_name, "device": engine.config.device.device,
        "prefix_cache": not args.disable_prefix_cache, "prefix_len": args.prefix_len,
        "suffix_len": args.suffix_len, "max_tokens": args.max_tokens,
        "block_size": engine.config.cache.block_size,
        "cold_ttft_ms_median": 1e3 * statistics.median(x["cold"]["ttft_s"] for x in rounds),
        "hit_ttft_ms_median": 1e3 * statistics.median(x["hit"]["ttft_s"] for x in rounds),
        "speedup_median": statistics.median(x["speedup"] for x in rounds),
        "prefix_cache_queries_total": metrics.prefix_cache_queries_total,
        "prefix_cache_hits_total": metrics.prefix_cache_hits_total,
        "rounds": rounds,
    }
    print(f"median: cold {summary['cold_ttft_ms_median']:.1f} ms, hit "
          f"{summary['hit_ttft_ms_median']:.1f} ms, {summary['speedup_median']:.1f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    main()
