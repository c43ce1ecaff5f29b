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

Multi-turn chat (``--workload multi-turn``): ``--conversations`` conversations of ``--turns``
turns share one system prompt of ``--system-tokens`` synthetic words (about one token each);
each turn is a streamed ``POST /v1/chat/completions`` carrying the whole history (system
prompt, earlier user messages and the assistant's actual replies) plus a new user message
of ``--user-tokens`` words, with ``max_tokens`` ``--output-len``. Turns of a conversation run
in order; ``--concurrency`` conversations run at once (so at most that many requests are
in flight). The report adds per-turn figures.

Prefix-cache hit rate, both workloads: from the responses (``usage.prompt_tokens_details.
cached_tokens`` summed over ``prompt_tokens``) and from ``/metrics`` before and after the
timed run (``cvllm_prefix_cache_hits_total`` / ``cvllm_prefix_cache_queries_total``
deltas; None where the server has no such counters).

Sweep: ``--sweep 1,2,4,...,256`` (or a list given to ``--concurrency``) runs the workload at
each concurrency level in turn and writes one JSON with every level (throughput, TTFT and
ITL p50/p99, hit rates, each level's full report) and, when matplotlib is importable, a PNG
next to it (throughput and TTFT against concurrency; ``--plot`` names it otherwise; else a
message says why none was made). Level i uses seed ``--seed`` + i and its own system
prompt, so a level does not find the previous level's prompts in the cache.

The client's own CPU time over the run's wall time is reported as ``client_cpu_fraction``
(random workload): near 1.0 the client, one Python process, may be what limits the figures.

Safety: only loopback addresses unless ``--allow-remote``; the request count, each
request (``--request-timeout``) and the whole run (``--timeout``, per level) are bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import math
import random
import re
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence
from urllib.parse import urlparse

MAX_REQUESTS = 100_000
MAX_LEVELS = 32
WORDS = ("time person year way day thing man world life hand part child eye woman place work "
         "week case point government company number group problem fact river light stone "
         "cloud market garden letter music window system water history story paper").split()


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
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
                      timeout: float, text_out: Optional[List[str]] = None) -> RequestResult:
    """One streamed request; the generated text is appended to ``text_out`` if given."""
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
                piece = _chunk_text(chunk)
                if piece:
                    if text_out is not None:
                        text_out.append(piece)
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
                    details = usage.get("prompt_tokens_details") or {}
                    res.cached_tokens = int(details.get("cached_tokens") or 0)
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


_METRIC_RE = re.compile(r"^(cvllm_prefix_cache_(?:queries|hits)_total)\s+([0-9.eE+-]+)\s*$")


async def fetch_prefix_counters(session: Any, base: str,
                                headers: Dict[str, str]) -> Optional[Dict[str, float]]:
    """The server's prefix-cache counters from /metrics, or None where it has none."""
    import aiohttp

    try:
        async with session.get(f"{base}/metrics", headers=headers,
                               timeout=aiohttp.ClientTimeout(total=30)) as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None
    found: Dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC_RE.match(line.strip())
        if m:
            found[m.group(1)] = float(m.group(2))
    if len(found) != 2:
        return None
    return {"queries": found["cvllm_prefix_cache_queries_total"],
            "hits": found["cvllm_prefix_cache_hits_total"]}


def metrics_hit_rate(before: Optional[Dict[str, float]],
                     after: Optional[Dict[str, float]]) -> Dict[str, Any]:
    if before is None or after is None:
        return {"queries": None, "hits": None, "hit_rate": None}
    q, h = after["queries"] - before["queries"], after["hits"] - before["hits"]
    return {"queries": int(q), "hits": int(h), "hit_rate": h / q if q > 0 else None}


def system_prompt(args: argparse.Namespace, rng: random.Random) -> str:
    # A per-run tag first, so each sweep level starts with a cold cache.
    words = [f"run{args.seed}"] + [rng.choice(WORDS) for _ in range(args.system_tokens - 1)]
    return " ".join(words)


async def run(args: argparse.Namespace) -> Dict[str, Any]:
    import aiohttp

    base = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    chat = args.endpoint == "chat" or args.workload == "multi-turn"
    url = f"{base}/v1/{'chat/completions' if chat else 'completions'}"
    connector = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        model = args.model or await fetch_model(session, base, headers)
        if args.workload == "multi-turn":
            return await run_multi_turn(args, session, base, url, model, headers)
        prompts = make_prompts(args)
        for i in range(args.warmup):
            warm = request_body(args, model, prompts[i % len(prompts)])
            await one_request(session, url, dict(warm, max_tokens=min(4, args.output_len)), headers,
                              args.request_timeout)
        counters0 = await fetch_prefix_counters(session, base, headers)
        sem = asyncio.Semaphore(args.concurrency)

        async def limited(prompt: Any) -> RequestResult:
            async with sem:
                return await one_request(session, url, request_body(args, model, prompt), headers,
                                         args.request_timeout)

        tasks = [asyncio.ensure_future(limited(p)) for p in prompts]
        t0, cpu0 = time.perf_counter(), time.process_time()
        done, pending = await asyncio.wait(tasks, timeout=args.timeout)
        duration, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        counters1 = await fetch_prefix_counters(session, base, headers)
    results = [t.result() if t in done else RequestResult(error="run timed out") for t in tasks]
    rep = summarize(args, model, url, results, duration)
    rep["prefix_cache_metrics"] = metrics_hit_rate(counters0, counters1)
    rep["client_cpu_fraction"] = cpu / duration if duration > 0 else None
    return rep


async def run_multi_turn(args: argparse.Namespace, session: Any, base: str, url: str, model: str,
                         headers: Dict[str, str]) -> Dict[str, Any]:
    rng = random.Random(args.seed)
    system = system_prompt(args, rng)
    users = [[" ".join(rng.choice(WORDS) for _ in range(args.user_tokens))
              for _ in range(args.turns)] for _ in range(args.conversations)]
    for i in range(args.warmup):  # not the system prompt: the timed run starts cold
        warm = request_body(args, model, f"warm up {i} " + " ".join(WORDS[:8]))
        await one_request(session, url, dict(warm, max_tokens=min(4, args.output_len)), headers,
                          args.request_timeout)
    counters0 = await fetch_prefix_counters(session, base, headers)
    results = [[RequestResult(error="run timed out") for _ in range(args.turns)]
               for _ in range(args.conversations)]
    sem = asyncio.Semaphore(args.concurrency)

    async def conversation(c: int) -> None:
        async with sem:
            messages: List[Dict[str, str]] = [{"role": "system", "content": system}]
            for t in range(args.turns):
                messages.append({"role": "user", "content": users[c][t]})
                body = request_body(args, model, "")
                body.pop("prompt", None)
                body["messages"] = list(messages)
                pieces: List[str] = []
                res = await one_request(session, url, body, headers, args.request_timeout, pieces)
                results[c][t] = res
                if not res.ok:
                    for later in range(t + 1, args.turns):
                        results[c][later] = RequestResult(error="an earlier turn failed")
                    return
                messages.append({"role": "assistant", "content": "".join(pieces)})

    tasks = [asyncio.ensure_future(conversation(c)) for c in range(args.conversations)]
    t0 = time.perf_counter()
    _, pending = await asyncio.wait(tasks, timeout=args.timeout)
    duration = time.perf_counter() - t0
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    counters1 = await fetch_prefix_counters(session, base, headers)
    flat = [r for conv in results for r in conv]
    rep = summarize(args, model, url, flat, duration)
    rep["prefix_cache_metrics"] = metrics_hit_rate(counters0, counters1)
    rep["system_prompt_words"] = args.system_tokens
    per_turn = []
    for t in range(args.turns):
        ok = [conv[t] for conv in results if conv[t].ok]
        prompt = sum(r.prompt_tokens for r in ok)
        cached = sum(r.cached_tokens for r in ok)
        per_turn.append({"turn": t + 1, "completed": len(ok), "prompt_tokens": prompt,
                         "cached_tokens": cached, "hit_rate": cached / prompt if prompt else None,
                         "ttft_ms": percentiles([r.ttft_s for r in ok])})
    rep["turns"] = per_turn
    return rep


def summarize(args: argparse.Namespace, model: str, url: str, results: List[RequestResult],
              duration: float) -> Dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    errors: Dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    tpot = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    cached_tokens = sum(r.cached_tokens for r in ok)
    return {
        "schema": "cvllm-bench-serving/1",
        "command": shlex.join(["python", "tools/bench_serving.py"] + args.argv),
        "url": url, "model": model,
        "config": {k: v for k, v in vars(args).items() if k not in ("api_key", "argv")},
        "num_requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "errors": errors, "duration_s": duration,
        "total_prompt_tokens": prompt_tokens,
        "total_cached_tokens": cached_tokens,
        "hit_rate": cached_tokens / prompt_tokens if prompt_tokens else None,
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
    ap.add_argument("--workload", choices=("random", "multi-turn"), default="random",
                    help="random prompts (default), or multi-turn chats over a shared system "
                         "prompt")
    ap.add_argument("--num-requests", type=int, default=64, help="random workload")
    ap.add_argument("--concurrency", default="8",
                    help="requests (multi-turn: conversations) in flight at once; a list "
                         "1,2,4,... sweeps them like --sweep")
    ap.add_argument("--sweep", default=None,
                    help="concurrency levels to run in turn, e.g. 1,2,4,8,16,32,64,128,256")
    ap.add_argument("--plot", default=None,
                    help="PNG of a sweep (default: --out with .png; needs matplotlib)")
    ap.add_argument("--conversations", type=int, default=64, help="multi-turn workload")
    ap.add_argument("--turns", type=int, default=6, help="multi-turn: turns per conversation")
    ap.add_argument("--system-tokens", type=int, default=2048,
                    help="multi-turn: words (about tokens) of the shared system prompt")
    ap.add_argument("--user-tokens", type=int, default=64,
                    help="multi-turn: words (about tokens) of each user message")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128,
                    help="max_tokens of each request (multi-turn: of each turn)")
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
    try:
        levels = [int(x) for x in (args.sweep or args.concurrency).split(",") if x.strip()]
    except ValueError:
        ap.error("--concurrency and --sweep want integers separated by commas")
    if not levels or len(levels) > MAX_LEVELS or any(not 1 <= c <= 4096 for c in levels):
        ap.error(f"concurrency levels must be in [1, 4096], at most {MAX_LEVELS} of them")
    if args.sweep is None and len(levels) == 1:
        args.concurrency, args.sweep = levels[0], None
    else:
        args.concurrency, args.sweep = levels[0], levels
    if args.workload == "multi-turn":
        if not 1 <= args.conversations * args.turns <= MAX_REQUESTS or args.conversations < 1 \
                or args.turns < 1:
            ap.error(f"--conversations x --turns must be in [1, {MAX_REQUESTS}]")
        if args.system_tokens < 1 or args.user_tokens < 1:
            ap.error("--system-tokens and --user-tokens must be >= 1")
    if args.input_len < 1 or args.output_len < 1:
        ap.error("--input-len and --output-len must be >= 1")
    if args.workload == "multi-turn":
        args.endpoint = "chat"  # conversations are chat messages
    if args.endpoint == "chat" and args.prompt_kind == "tokens":
        args.prompt_kind = "text"  # chat messages are text
    if not args.allow_remote and not is_loopback(args.base_url):
        ap.error(f"{args.base_url} is not a loopback address; pass --allow-remote to load it")
    return args


def _pct(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def print_summary(rep: Dict[str, Any]) -> None:
    print(f"requests {rep['completed']}/{rep['num_requests']} ok in {rep['duration_s']:.2f}s: "
          f"{rep['request_throughput']:.2f} req/s, {rep['output_throughput']:.1f} output tok/s")
    print(f"prefix-cache hit rate: {_pct(rep.get('hit_rate'))} of prompt tokens (usage), "
          f"{_pct((rep.get('prefix_cache_metrics') or {}).get('hit_rate'))} (/metrics)")
    for t in rep.get("turns") or []:
        print(f"  turn {t['turn']}: {t['completed']} ok, {t['cached_tokens']}/{t['prompt_tokens']} "
              f"prompt tokens cached ({_pct(t['hit_rate'])})")
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "latency_ms"):
        p = rep[key]
        if p["p50"] is not None:
            print(f"{key:>10}: p50 {p['p50']:.1f}  p90 {p['p90']:.1f}  p99 {p['p99']:.1f}  "
                  f"mean {p['mean']:.1f}")
    for err, n in rep["errors"].items():
        print(f"failed x{n}: {err}")
    sys.stdout.flush()


def level_row(rep: Dict[str, Any]) -> Dict[str, Any]:
    """One sweep level's headline figures."""
    return {"concurrency": rep["config"]["concurrency"],
            "completed": rep["completed"], "failed": rep["failed"],
            "duration_s": rep["duration_s"],
            "request_throughput": rep["request_throughput"],
            "output_throughput": rep["output_throughput"],
            "ttft_ms_p50": rep["ttft_ms"]["p50"], "ttft_ms_p99": rep["ttft_ms"]["p99"],
            "itl_ms_p50": rep["itl_ms"]["p50"], "itl_ms_p99": rep["itl_ms"]["p99"],
            "hit_rate": rep["hit_rate"],
            "metrics_hit_rate": rep["prefix_cache_metrics"]["hit_rate"]}


async def run_sweep(args: argparse.Namespace) -> Dict[str, Any]:
    reports = []
    for i, level in enumerate(args.sweep):
        lvl = argparse.Namespace(**vars(args))
        lvl.concurrency, lvl.seed = level, args.seed + i
        rep = await run(lvl)
        print(f"-- concurrency {level}")
        print_summary(rep)
        reports.append(rep)
    return {
        "schema": "cvllm-bench-serving-sweep/1",
        "command": shlex.join(["python", "tools/bench_serving.py"] + args.argv),
        "workload": args.workload, "url": reports[0]["url"], "model": reports[0]["model"],
        "levels": [level_row(r) for r in reports],
        "reports": reports,
        "plot": None,
    }


def plot_sweep(sweep: Dict[str, Any], png: Path) -> Optional[str]:
    """Throughput and TTFT against concurrency into ``png``; returns None, or why no plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ("matplotlib is not installed: no plot (pip install matplotlib, or plot the "
                "JSON's levels elsewhere)")
    rows = [r for r in sweep.get("levels", []) if r.get("completed")]
    if not rows:
        return "no completed level to plot"
    xs = [r["concurrency"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    fig.suptitle(f"cvllm serving, {sweep.get('workload')} workload, {sweep.get('model')}")
    ax1.plot(xs, [r["output_throughput"] for r in rows], "o-", label="output tokens/s")
    ax1.set_ylabel("output tokens/s")
    for name, key in (("TTFT p50", "ttft_ms_p50"), ("TTFT p99", "ttft_ms_p99")):
        ax2.plot(xs, [r[key] for r in rows], "o-", label=name)
    ax2.set_ylabel("time to first token (ms)")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels([str(x) for x in xs])
        ax.set_xlabel("concurrency")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(str(png), dpi=110)
    plt.close(fig)
    return None


def print_sweep(sweep: Dict[str, Any]) -> None:
    print(f"{'conc':>5} {'ok':>6} {'req/s':>8} {'tok/s':>9} {'TTFT p50':>9} {'p99':>9} "
          f"{'ITL p50':>8} {'p99':>8} {'hit':>6} {'hit(m)':>6}")
    for r in sweep["levels"]:
        def ms(x: Optional[float]) -> str:
            return "n/a" if x is None else f"{x:.1f}"
        print(f"{r['concurrency']:>5} {r['completed']:>6} {r['request_throughput']:>8.2f} "
              f"{r['output_throughput']:>9.1f} {ms(r['ttft_ms_p50']):>9} {ms(r['ttft_ms_p99']):>9} "
              f"{ms(r['itl_ms_p50']):>8} {ms(r['itl_ms_p99']):>8} {_pct(r['hit_rate']):>6} "
              f"{_pct(r['metrics_hit_rate']):>6}")
    sys.stdout.flush()


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.sweep:
        sweep = asyncio.run(run_sweep(args))
        print_sweep(sweep)
        png = Path(args.plot) if args.plot else (Path(args.out).with_suffix(".png")
                                                 if args.out else None)
        if png is not None:
            why = plot_sweep(sweep, png)
            sweep["plot"] = None if why else str(png)
            print(why or f"plot -> {png}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(sweep, f, indent=2)
        return 0 if all(r["completed"] for r in sweep["levels"]) else 1
    rep = asyncio.run(run(args))
    print_summary(rep)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rep, f, indent=2)
    return 0 if rep["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
