#!/usr/bin/env python3
"""HTTP load generator for a running cvllm (or any OpenAI-compatible) server: throughput,
time to first token (TTFT) and inter-token latency (ITL), as candle-vllm's
``examples/benchmark.py`` and vLLM's ``benchmark_serving.py`` measure them.

    cvllm serve --w MODEL --port 8000 &
    python tools/bench_serving.py --base-url http://127.0.0.1:8000 \\
        --num-requests 64 --concurrency 16 --input-len 128 --output-len 128 --out serve.json

Each request is a streamed ``POST /v1/completions`` (``--endpoint chat`` for
``/v1/chat/completions``) with ``ignore_eos`` (so every request generates ``--output-len``
tokens) and ``stream_options.include_usage``. Prompts are random token ids in
``--token-range`` (``--prompt-kind tokens``, completions only) or random words
(``--prompt-kind text``, about one token per word; the server's usage counts are
reported). ``--concurrency`` requests are in flight at once until ``--num-requests``
have been sent.

Per request: TTFT is the time from sending to the first chunk carrying text; ITL the gaps
between successive text chunks (a chunk normally carries one token); TPOT
(latency - TTFT) / (output tokens - 1); output tokens from the usage chunk (else the
number of text chunks). The report gives p50/p90/p99/mean of each, in milliseconds,
request and output-token throughput over the run's wall time, and every failure.

Safety: only loopback addresses unless ``--allow-remote``; the request count, each
request (``--request-timeout``) and the whole run (``--timeout``) are bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import math
import random
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence
from urllib.parse import urlparse

MAX_REQUESTS = 100_000
WORDS = ("time person year way day thing man world life hand part child eye woman place work "
         "week case point government company number group problem fact river light stone "
         "cloud market garden letter music window system water history story paper").split()


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    text_chunks: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: List[float] = field(default_factory=list)
    finish_reason: Optional[str] = None


def is_loopback(url: str) -> bool:
    host = (urlparse(url).hostname or "").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def percentiles(values: Sequence[float], scale: float = 1000.0) -> Dict[str, Optional[float]]:
    """p50/p90/p99/mean/max (linear interpolation), times ``scale`` (s -> ms)."""
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None, "max": None}
    xs = sorted(values)

    def pct(p: float) -> float:
        k = (len(xs) - 1) * p / 100.0
        lo, hi = math.floor(k), math.ceil(k)
        return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)

    return {"p50": pct(50) * scale, "p90": pct(90) * scale, "p99": pct(99) * scale,
            "mean": sum(xs) / len(xs) * scale, "max": xs[-1] * scale}


def make_prompts(args: argparse.Namespace) -> List[Any]:
    rng = random.Random(args.seed)
    if args.prompt_kind == "tokens":
        lo, hi = args.token_range
        return [[rng.randrange(lo, hi) for _ in range(args.input_len)]
                for _ in range(args.num_requests)]
    return [" ".join(rng.choice(WORDS) for _ in range(args.input_len))
            for _ in range(args.num_requests)]


def request_body(args: argparse.Namespace, model: str, prompt: Any) -> Dict[str, Any]:
    body: Dict[str, Any] = {"model": model, "max_tokens": args.output_len, "temperature": 0.0,
                            "stream": True, "stream_options": {"include_usage": True}}
    if not args.no_ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _chunk_text(chunk: Dict[str, Any]) -> str:
    out = ""
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta")
        if isinstance(delta, dict):  # chat.completion.chunk
            out += delta.get("content") or ""
        else:  # text_completion
            out += choice.get("text") or ""
    return out


async def one_request(session: Any, url: str, body: Dict[str, Any], headers: Dict[str, str],
                      timeout: float) -> RequestResult:
    import aiohttp

    res = RequestResult()
    t0 = time.perf_counter()
    last = None
    try:
        async with session.post(url, json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return res
            async for raw in resp.content:  # one SSE line at a time
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                    return res
                now = time.perf_counter()
                if _chunk_text(chunk):
                    res.text_chunks += 1
                    if last is None:
                        res.ttft_s = now - t0
                    else:
                        res.itl_s.append(now - last)
                    last = now
                for choice in chunk.get("choices") or []:
                    res.finish_reason = choice.get("finish_reason") or res.finish_reason
                usage = chunk.get("usage")
                if usage:
                    res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    res.output_tokens = int(usage.get("completion_tokens") or 0)
        res.latency_s = time.perf_counter() - t0
        res.output_tokens = res.output_tokens or res.text_chunks
        res.ok = res.text_chunks > 0
        if not res.ok:
            res.error = "the stream carried no text"
    except asyncio.TimeoutError:
        res.error = f"timed out after {timeout:.0f}s"
    except (aiohttp.ClientError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def fetch_model(session: Any, base: str, headers: Dict[str, str]) -> str:
    async with session.get(f"{base}/v1/models", headers=headers) as resp:
        resp.raise_for_status()
        data = await resp.json()
    return data["data"][0]["id"]


async def run(args: argparse.Namespace) -> Dict[str, Any]:
    import aiohttp

    base = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = f"{base}/v1/{'chat/completions' if args.endpoint == 'chat' else 'completions'}"
    prompts = make_prompts(args)
    connector = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        model = args.model or await fetch_model(session, base, headers)
        for i in range(args.warmup):
            warm = request_body(args, model, prompts[i % len(prompts)])
            await one_request(session, url, dict(warm, max_tokens=min(4, args.output_len)), headers,
                              args.request_timeout)
        sem = asyncio.Semaphore(args.concurrency)

        async def limited(prompt: Any) -> RequestResult:
            async with sem:
                return await one_request(session, url, request_body(args, model, prompt), headers,
                                         args.request_timeout)

        tasks = [asyncio.ensure_future(limited(p)) for p in prompts]
        t0 = time.perf_counter()
        done, pending = await asyncio.wait(tasks, timeout=args.timeout)
        duration = time.perf_counter() - t0
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    results = [t.result() if t in done else RequestResult(error="run timed out") for t in tasks]
    return summarize(args, model, url, results, duration)


def summarize(args: argparse.Namespace, model: str, url: str, results: List[RequestResult],
              duration: float) -> Dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    errors: Dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    tpot = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "schema": "cvllm-bench-serving/1",
        "command": shlex.join(["python", "tools/bench_serving.py"] + args.argv),
        "url": url, "model": model,
        "config": {k: v for k, v in vars(args).items() if k not in ("api_key", "argv")},
        "num_requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "errors": errors, "duration_s": duration,
        "total_prompt_tokens": sum(r.prompt_tokens for r in ok),
        "total_output_tokens": out_tokens,
        "all_full_length": all(r.output_tokens == args.output_len for r in ok) if ok else False,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out_tokens / duration if duration > 0 else 0.0,
        "ttft_ms": percentiles([r.ttft_s for r in ok]),
        "itl_ms": percentiles([x for r in ok for x in r.itl_s]),
        "tpot_ms": percentiles(tpot),
        "latency_ms": percentiles([r.latency_s for r in ok]),
        "requests": [asdict(r) for r in results] if args.per_request else None,
    }


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--allow-remote", action="store_true", help="allow a non-loopback server")
    ap.add_argument("--model", default=None, help="default: the first of /v1/models")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prompt-kind", choices=("tokens", "text"), default="tokens")
    ap.add_argument("--token-range", default="100,10000", help="LO,HI of random prompt ids")
    ap.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos")
    ap.add_argument("--warmup", type=int, default=1, help="short requests sent first, untimed")
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--timeout", type=float, default=1800.0, help="limit of the whole run (s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--per-request", action="store_true", help="include every request in the JSON")
    ap.add_argument("--out", default=None, help="write the JSON report here")
    args = ap.parse_args(argv)
    args.argv = [a for a in (sys.argv[1:] if argv is None else argv)]
    lo, _, hi = args.token_range.partition(",")
    args.token_range = (int(lo), int(hi))
    if not 0 <= args.token_range[0] < args.token_range[1]:
        ap.error("--token-range wants LO,HI with 0 <= LO < HI")
    if not 1 <= args.num_requests <= MAX_REQUESTS:
        ap.error(f"--num-requests must be in [1, {MAX_REQUESTS}]")
    if not 1 <= args.concurrency <= 4096:
        ap.error("--concurrency must be in [1, 4096]")
    if args.input_len < 1 or args.output_len < 1:
        ap.error("--input-len and --output-len must be >= 1")
    if args.endpoint == "chat" and args.prompt_kind == "tokens":
        args.prompt_kind = "text"  # chat messages are text
    if not args.allow_remote and not is_loopback(args.base_url):
        ap.error(f"{args.base_url} is not a loopback address; pass --allow-remote to load it")
    return args


def print_summary(rep: Dict[str, Any]) -> None:
    print(f"requests {rep['completed']}/{rep['num_requests']} ok in {rep['duration_s']:.2f}s: "
          f"{rep['request_throughput']:.2f} req/s, {rep['output_throughput']:.1f} output tok/s")
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "latency_ms"):
        p = rep[key]
        if p["p50"] is not None:
            print(f"{key:>10}: p50 {p['p50']:.1f}  p90 {p['p90']:.1f}  p99 {p['p99']:.1f}  "
                  f"mean {p['mean']:.1f}")
    for err, n in rep["errors"].items():
        print(f"failed x{n}: {err}")
    sys.stdout.flush()


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    rep = asyncio.run(run(args))
    print_summary(rep)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rep, f, indent=2)
    return 0 if rep["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
