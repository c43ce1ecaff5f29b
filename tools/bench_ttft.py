#!/usr/bin/env python3
"""Where a served request's time to first token goes, phase by phase (issue 14).

The aiohttp server and the engine thread run in this process (as ``cvllm serve`` runs
them on rank 0) and ``tools/bench_serving.py`` loads them from a separate client process.
Timers wrapped around the engine from outside (this file only; cvllm carries no timing
code) stamp each request:

- ``submit``: the HTTP handler has the prompt's ids and hands them to the engine thread
  (``AsyncEngine.generate``); the client's own TTFT minus the phases below is the HTTP,
  chat-template and tokenizing share before this, plus the SSE write after the last;
- ``arrive``: the engine thread adds it (``LLMEngine.add_request``): it takes requests
  between steps;
- ``scheduled``: the first step that computes some of its prompt is scheduled;
- ``first out``: the engine thread has its first token (``LLMEngine.step`` returned it);
- ``first yield``: the event loop hands that token to the handler.

Also per step: the interval from one ``schedule()`` to the next, split into steps that
compute prompt tokens (eager on CUDA) and decode-only steps (CUDA graphs), and the
longest ones with their make-up. The device is real (``--real-model 8b`` or a folder,
random weights) or simulated (``--device-ms`` a step, ``--prefill-us-per-token`` more for
each prompt token, and ``--eager-ms`` of GIL-holding host work in a step that computes
prompt tokens, as an eager CUDA step's launches are).

    PYTHONPATH=. python tools/bench_ttft.py --workload multi-turn --out ttft.json
    PYTHONPATH=. python tools/bench_ttft.py --real-model 8b --workload multi-turn   # GPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import bench_host as bh  # noqa: E402


class PrefillCostRunner(bh.SimulatedRunner):
    """``SimulatedRunner`` whose steps cost more with the prompt tokens they compute
    (``tokens`` is set by the schedule wrapper just before the launch)."""

    def __init__(self, *a, us_per_token: float, eager_s: float, **kw):
        super().__init__(*a, **kw)
        self.us_per_token, self.eager_s, self.tokens = us_per_token, eager_s, 0

    def launch(self, step, sampling):
        if self.tokens and self.eager_s:  # launches hold the GIL, as eager CUDA launches do
            until = time.perf_counter() + self.eager_s
            while time.perf_counter() < until:
                sum(range(100))
        start = max(time.perf_counter(), self._busy_until)
        self._busy_until = start + self.device_s + self.tokens * self.us_per_token / 1e6
        rows = sampling.num_rows if sampling is not None else 0
        ids = self.rng.choice(self.words, size=rows) if rows else None
        return bh.SimulatedStep(self._busy_until, ids)


def build_engine(args):
    """``(LLMEngine, simulated runner or None)``."""
    from cvllm import loader
    from cvllm.engine.tokenizer import Tokenizer

    if args.real_model:
        from cvllm.engine.builder import build_llm_engine

        engine, _ = build_llm_engine(
            weight_path=args.real_model, load_format="dummy", max_model_len=args.max_model_len,
            disable_prefix_cache=args.disable_prefix_cache)
        return engine, None
    tok = Tokenizer(loader.load_tokenizer(loader.resolve_model_source(None, args.model)))
    runner = PrefillCostRunner(40000, args.device_ms / 1e3, bh.word_tokens(tok),
                               us_per_token=args.prefill_us_per_token,
                               eager_s=args.eager_ms / 1e3)
    engine = bh.simulated_engine(tok, runner, 256, args.max_model_len, 8192,
                                 prefix_cache=not args.disable_prefix_cache)
    return engine, runner


class Stamps:
    """Per-request and per-step times, filled by the wrappers ``instrument`` installs."""

    def __init__(self):
        self.req: Dict[str, Dict[str, float]] = {}
        self.steps: List[Dict[str, Any]] = []

    def mark(self, rid: str, what: str) -> None:
        self.req.setdefault(rid, {}).setdefault(what, time.perf_counter())

    def clear(self) -> None:
        self.req.clear()
        self.steps.clear()


def instrument(llm, async_engine, runner, stamps: Stamps) -> None:
    sched = llm.scheduler
    schedule, add_request, step = sched.schedule, llm.add_request, llm.step
    generate = async_engine.generate

    def schedule_timed(*a, **kw):
        out = schedule(*a, **kw)
        prompt = [(s.seq.request_id, s.num_new_tokens, s.start) for s in out.scheduled
                  if s.start < len(s.seq.prompt_token_ids)]
        for s in out.scheduled:
            stamps.mark(s.seq.request_id, "scheduled")
        if runner is not None:
            runner.tokens = sum(n for _, n, _ in prompt)
        stamps.steps.append(dict(t=time.perf_counter(), prompt=prompt,
                                 decodes=len(out.scheduled) - len(prompt)))
        return out

    def add_timed(rid, ids, params):
        stamps.mark(rid, "arrive")
        return add_request(rid, ids, params)

    def step_timed():
        outs = step()
        for o in outs:
            if o.delta_token_ids:
                stamps.mark(o.request_id, "first_out")
        return outs

    async def generate_timed(rid, ids, params):
        stamps.mark(rid, "submit")
        async for item in generate(rid, ids, params):
            stamps.mark(rid, "first_yield")
            yield item

    sched.schedule, llm.add_request, llm.step = schedule_timed, add_timed, step_timed
    async_engine.generate = generate_timed


def percentiles(xs: List[float]) -> Dict[str, float]:
    xs = sorted(xs)
    if not xs:
        return {}
    pick = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return {"p50": round(pick(0.5), 2), "p90": round(pick(0.9), 2), "max": round(xs[-1], 2),
            "n": len(xs)}


def phases(stamps: Stamps) -> Dict[str, Any]:
    spans = {"submit_to_arrive": ("submit", "arrive"), "arrive_to_scheduled": ("arrive", "scheduled"),
             "scheduled_to_first_out": ("scheduled", "first_out"),
             "first_out_to_yield": ("first_out", "first_yield"),
             "submit_to_first_yield": ("submit", "first_yield")}
    rep = {name: percentiles([(r[b] - r[a]) * 1e3 for r in stamps.req.values() if a in r and b in r])
           for name, (a, b) in spans.items()}
    steps = stamps.steps
    pairs = list(zip(steps, steps[1:]))
    gap = lambda a, b: (b["t"] - a["t"]) * 1e3  # noqa: E731
    rep["step_interval_ms"] = {
        "with_prompt_tokens": percentiles([gap(a, b) for a, b in pairs if a["prompt"]]),
        "decode_only": percentiles([gap(a, b) for a, b in pairs if not a["prompt"]])}
    longest = sorted(pairs, key=lambda p: -gap(*p))[:5]
    rep["longest_steps"] = [{"ms": round(gap(a, b), 1), "decodes": a["decodes"],
                             "prompt_chunks": [[n, start] for _, n, start in a["prompt"][:8]]}
                            for a, b in longest]
    return rep


async def _serve_and_load(args, async_engine, stamps: Stamps) -> List[Dict[str, Any]]:
    from cvllm.server.app import build_app, start_server
    from cvllm.server.context import ServerSettings

    settings = ServerSettings(host="127.0.0.1", port=0)
    server = await start_server(build_app(async_engine, settings), settings)
    port = server.addresses[0][1]
    reports = []
    with tempfile.TemporaryDirectory() as d:
        for rnd in range(args.rounds):
            stamps.clear()
            out = Path(d) / f"client{rnd}.json"
            cmd = [sys.executable, str(ROOT / "tools" / "bench_serving.py"), "--base-url",
                   f"http://127.0.0.1:{port}", "--seed", str(args.seed + rnd), "--out", str(out),
                   *args.client_args]
            proc = await asyncio.create_subprocess_exec(*cmd, stdout=subprocess.DEVNULL)
            await proc.wait()
            client = json.loads(out.read_text())
            rep = {"round": rnd, "client": {k: client.get(k) for k in (
                "duration_s", "output_throughput", "hit_rate", "ttft_ms", "completed", "failed")}}
            rep.update(phases(stamps))
            reports.append(rep)
            print_round(rep)
    await server.cleanup()
    return reports


def print_round(rep: Dict[str, Any]) -> None:
    c = rep["client"]
    print(f"== round {rep['round']}: {c['duration_s']:.2f} s, {c['output_throughput']:.0f} tok/s, "
          f"client TTFT p50 {c['ttft_ms']['p50']:.0f} p90 {c['ttft_ms']['p90']:.0f} ms")
    for name in ("submit_to_arrive", "arrive_to_scheduled", "scheduled_to_first_out",
                 "first_out_to_yield", "submit_to_first_yield"):
        p = rep[name]
        if p:
            print(f"   {name:<24} p50 {p['p50']:7.1f}  p90 {p['p90']:7.1f}  max {p['max']:7.1f} ms")
    for kind, p in rep["step_interval_ms"].items():
        if p:
            print(f"   step interval {kind:<19} p50 {p['p50']:7.1f}  p90 {p['p90']:7.1f} ms ({p['n']})")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--real-model", default=None, metavar="FOLDER|8b",
                    help="the real runner on this folder (random weights); '8b': the 8B shape")
    ap.add_argument("--model", default=None, help="simulated: GGUF or folder for the tokenizer "
                    "(default: the default model)")
    ap.add_argument("--device-ms", type=float, default=8.0, help="simulated: time of a step")
    ap.add_argument("--prefill-us-per-token", type=float, default=27.0,
                    help="simulated: more for each prompt token (8B on an H100: ~27)")
    ap.add_argument("--eager-ms", type=float, default=0.0,
                    help="simulated: GIL-holding host work of a step with prompt tokens")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--disable-prefix-cache", action="store_true")
    ap.add_argument("--rounds", type=int, default=1, help="client runs, each its own seed")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=None)
    args, client = ap.parse_known_args(argv)
    # everything else goes to tools/bench_serving.py (default: the multi-turn workload)
    args.client_args = client or ["--endpoint", "chat", "--workload", "multi-turn",
                                  "--conversations", "32", "--turns", "4", "--system-tokens",
                                  "2000", "--user-tokens", "64", "--output-len", "64",
                                  "--concurrency", "16"]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.real_model == "8b":
        import bench_model as bm

        args.real_model = str(bm.write_model_folder(Path(tempfile.mkdtemp()), bm.build_config()))
    from cvllm.engine.async_engine import AsyncEngine
    from cvllm.utils.gc_freeze import freeze_startup_objects

    llm, runner = build_engine(args)
    async_engine = AsyncEngine(llm, "bench", {})
    stamps = Stamps()
    instrument(llm, async_engine, runner, stamps)
    freeze_startup_objects()  # as cvllm serve does
    async_engine.start()
    while not async_engine.is_ready():
        time.sleep(0.01)
    try:
        reports = asyncio.run(_serve_and_load(args, async_engine, stamps))
    finally:
        async_engine.shutdown()
    if args.out:
        meta = {k: v for k, v in vars(args).items() if k != "client_args"}
        Path(args.out).write_text(json.dumps({"args": meta, "client_args": args.client_args,
                                              "rounds": reports}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
