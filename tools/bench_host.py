#!/usr/bin/env python3
"""Rank 0's host path at high concurrency, measured without a model (issue 14, item 2).

The device is simulated: a runner whose steps take ``--device-ms`` of wall time with the
GIL released (as a GPU step does) and sample random word tokens. Everything else is the
real thing: the scheduler, ``build_step_input``, the overlapped ``LLMEngine`` loop, the
detokenizers, ``AsyncEngine``'s engine thread, the aiohttp server with its handlers and SSE,
and a separate client process (``tools/bench_serving.py``) streaming over loopback.

Two runs with the same batch:

- engine alone: ``LLMEngine.step()`` in a loop, the ceiling the served path is held to;
- served: ``--concurrency`` streamed completions through HTTP.

For each: output tokens per second, the step rate, and the CPU time each thread spent
per step (``pthread_getcpuclockid``): the engine thread, broken down by phase (schedule,
build_step_input, launch, wait for the device, scheduler update, outputs and
detokenizing, delivery to the event loop), and the event-loop thread (HTTP, SSE, JSON).
Served / engine is the figure issue 14 asks for (target >= 0.85 at 256 streams).
``--api-process`` serves as ``cvllm serve`` does by default: HTTP in the API process
(``runtime/api_host.py``), this process keeping the engine thread and the channel's
reader and writer threads; the API process's CPU is reported as a whole.

    python tools/bench_host.py --concurrency 256 --device-ms 15 --out host.json
    python tools/bench_host.py --concurrency 256 --device-ms 15 --api-process --out api.json

The phase timers wrap the engine's methods from outside (this file only), so cvllm carries
no timing code; each wrapper costs well under a microsecond a call.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from cvllm import loader  # noqa: E402
from cvllm.config import (CacheConfig, DeviceConfig, EngineConfig, ModelConfig,  # noqa: E402
                          SchedulerConfig)
from cvllm.engine import llm_engine as llm_engine_mod  # noqa: E402
from cvllm.engine.async_engine import AsyncEngine  # noqa: E402
from cvllm.engine.llm_engine import LLMEngine  # noqa: E402
from cvllm.engine.tokenizer import Tokenizer  # noqa: E402
from cvllm.sampling_params import SamplingParams  # noqa: E402


class SimulatedStep:
    """A launched step: ``result()`` returns once ``device_s`` passed since launch."""

    def __init__(self, due: float, token_ids: Optional[np.ndarray]):
        self.due, self.token_ids = due, token_ids

    def result(self):
        from cvllm.worker.output_copy import StepResult

        left = self.due - time.perf_counter()
        if left > 0:
            time.sleep(left)  # the GIL is free meanwhile, as during a device step
        return None if self.token_ids is None else StepResult(token_ids=self.token_ids)


class SimulatedRunner:
    """A device whose every step takes ``device_s`` and samples random word tokens."""

    def __init__(self, num_blocks: int, device_s: float, words: np.ndarray, seed: int = 0):
        self.num_blocks = num_blocks
        self.device_s = device_s
        self.words = words
        self.rng = np.random.default_rng(seed)
        self._busy_until = 0.0

    def launch(self, step, sampling):
        # Steps queue on the device: this one starts when the previous one ends.
        start = max(time.perf_counter(), self._busy_until)
        self._busy_until = start + self.device_s
        rows = sampling.num_rows if sampling is not None else 0
        ids = self.rng.choice(self.words, size=rows) if rows else None
        return SimulatedStep(self._busy_until, ids)

    def execute(self, step, sampling):
        return self.launch(step, sampling).result()


def word_tokens(tok: Tokenizer, limit: int = 4000) -> np.ndarray:
    """Ids of plain word pieces (letters, optionally a leading space marker), so the
    detokenizer does the work real text makes it do."""
    ids = []
    for tid in range(min(len(tok.hf), 30000)):
        piece = tok.hf.convert_ids_to_tokens(tid)
        if isinstance(piece, str) and piece.lstrip("Ġ▁").isalpha() and len(piece) > 2:
            ids.append(tid)
        if len(ids) >= limit:
            break
    return np.array(ids, dtype=np.int64)


def build_engine(args, tok: Tokenizer, words: np.ndarray) -> LLMEngine:
    if args.real_model:
        from cvllm.engine.builder import build_llm_engine

        engine, _ = build_llm_engine(weight_path=args.real_model, load_format="dummy",
                                     max_model_len=args.max_model_len,
                                     max_num_seqs=args.concurrency,
                                     max_num_batched_tokens=args.max_num_batched_tokens)
        return engine
    per_seq = -(-(args.input_len + args.output_len + 16) // 16)
    runner = SimulatedRunner(per_seq * args.concurrency + 64, args.device_ms / 1e3, words)
    return simulated_engine(tok, runner, args.concurrency, args.max_model_len,
                            args.max_num_batched_tokens)


def simulated_engine(tok: Tokenizer, runner, max_num_seqs: int, max_model_len: int,
                     max_num_batched_tokens: int, prefix_cache: bool = True) -> LLMEngine:
    """The real overlapped ``LLMEngine`` over a simulated ``runner`` (a one-layer stand-in
    config: only the tokenizer's vocabulary matters)."""
    hf = dict(hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
              vocab_size=len(tok.hf), max_position_embeddings=max_model_len)
    eos = tok.eos_token_id if tok.eos_token_id is not None else 0
    config = EngineConfig(
        model=ModelConfig("LlamaForCausalLM", hf, eos_token_ids=[eos], bos_token_id=tok.bos_token_id),
        cache=CacheConfig(block_size=16, enable_prefix_caching=prefix_cache),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                  max_num_batched_tokens=max_num_batched_tokens),
        device=DeviceConfig())
    return LLMEngine(config, tok, runner, overlap=True)


# ------------------------------------------------------------------------ phase timers
class PhaseTimer:
    """CPU-free wall-clock accumulation per phase of the engine thread."""

    def __init__(self):
        self.seconds: Dict[str, float] = defaultdict(float)
        self.calls: Dict[str, int] = defaultdict(int)

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds[name] += time.perf_counter() - t0
                self.calls[name] += 1
        return timed


def instrument(engine: LLMEngine, timer: PhaseTimer, async_engine: Optional[AsyncEngine]) -> None:
    sched = engine.scheduler
    sched.schedule = timer.wrap("schedule", sched.schedule)
    sched.update = timer.wrap("scheduler_update", sched.update)
    llm_engine_mod.build_step_input = timer.wrap("build_step_input", llm_engine_mod.build_step_input)
    runner = engine.runner
    launch = runner.launch

    def launch_timed(step, sampling):
        handle = timer.wrap("launch", launch)(step, sampling)
        handle.result = timer.wrap("wait_device", handle.result)
        return handle
    runner.launch = launch_timed
    engine._make_outputs = timer.wrap("outputs_detokenize", engine._make_outputs)
    engine.metrics = timer.wrap("metrics_snapshot", engine.metrics)
    if async_engine is not None:
        for name in ("_deliver", "_deliver_step"):
            if hasattr(async_engine, name):
                setattr(async_engine, name, timer.wrap("deliver", getattr(async_engine, name)))


def thread_cpu(ident: int) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(ident))


# ------------------------------------------------------------------------ engine alone
def run_engine_alone(args, tok, words) -> Dict[str, Any]:
    engine = build_engine(args, tok, words)
    timer = PhaseTimer()
    instrument(engine, timer, None)
    rng = np.random.default_rng(1)
    params = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True)
    for i in range(args.concurrency):
        engine.add_request(f"r{i}", rng.choice(words, size=args.input_len).tolist(), params)
    t0, c0, steps, tokens = time.perf_counter(), time.thread_time(), 0, 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens += len(out.delta_token_ids)
        steps += 1
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    return report("engine alone", wall, tokens, steps, timer, {"engine_thread": cpu})


# ------------------------------------------------------------------------ served
async def _serve_and_load(args, engine: AsyncEngine, client_out: Path) -> Dict[str, float]:
    from cvllm.server.app import build_app, start_server
    from cvllm.server.context import ServerSettings

    settings = ServerSettings(host="127.0.0.1", port=0)
    runner = await start_server(build_app(engine, settings), settings)
    port = runner.addresses[0][1]
    loop_thread = threading.get_ident()
    engine_thread = engine._thread.ident
    cmd = _client_cmd(args, port, client_out)
    before = {"loop": thread_cpu(loop_thread), "engine": thread_cpu(engine_thread)}
    steps0 = engine.engine.stats["steps"]
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=subprocess.DEVNULL)
    profile = None
    if args.profile_loop:
        import cProfile

        profile = cProfile.Profile()
        profile.enable()
    t0 = time.perf_counter()
    await proc.wait()
    wall = time.perf_counter() - t0
    if profile is not None:
        import pstats

        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    used = {"event_loop_thread": thread_cpu(loop_thread) - before["loop"],
            "engine_thread": thread_cpu(engine_thread) - before["engine"]}
    await runner.cleanup()
    return dict(wall=wall, steps=engine.engine.stats["steps"] - steps0, **used)


def _client_cmd(args, port: int, client_out: Path) -> list:
    return [sys.executable, str(ROOT / "tools" / "bench_serving.py"), "--base-url",
            f"http://127.0.0.1:{port}", "--num-requests", str(args.concurrency), "--concurrency",
            str(args.concurrency), "--input-len", str(args.input_len), "--output-len",
            str(args.output_len), "--token-range", f"{int(args.words_lo)},{int(args.words_hi)}",
            "--warmup", "0", "--out", str(client_out)]


def _serve_through_api_process(args, engine: AsyncEngine, client_out: Path) -> Dict[str, float]:
    """The served run as ``cvllm serve`` runs by default: HTTP in the API process
    (``runtime/api_host.py``), this process keeping the engine thread. CPU per thread of
    this process, and the API process's whole CPU time."""
    import dataclasses
    import socket

    import psutil

    from cvllm.runtime import api_host, api_launch
    from cvllm.server.context import ServerSettings

    ours, theirs = socket.socketpair()
    settings = dataclasses.asdict(ServerSettings(host="127.0.0.1", port=0))
    hello = api_launch.make_hello(engine, settings, {}, 5.0)
    host = api_host.ApiHost(engine, ours, hello)
    proc = api_launch.spawn([sys.executable, "-m", "cvllm.server.api_process"], theirs,
                            ["--log-level", "WARNING"])
    theirs.close()
    host.start()
    api_launch.wait_listening(host, proc)
    port = int(host.address.rsplit(":", 1)[1])
    threads = {t.name: t.ident for t in threading.enumerate()
               if t.name in ("cvllm-engine", "cvllm-api-writer", "cvllm-api-reader")}
    before = {n: thread_cpu(i) for n, i in threads.items()}
    api = psutil.Process(proc.pid)
    api_before = sum(api.cpu_times()[:2])
    steps0 = engine.engine.stats["steps"]
    t0 = time.perf_counter()
    subprocess.run(_client_cmd(args, port, client_out), stdout=subprocess.DEVNULL, check=True)
    wall = time.perf_counter() - t0
    used = {f"{n.replace('cvllm-', '').replace('-', '_')}_thread": thread_cpu(i) - before[n]
            for n, i in threads.items()}
    used["api_process"] = sum(api.cpu_times()[:2]) - api_before
    host.close()  # the API process leaves once its channel is gone (it ignores SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
    shutil.rmtree(hello.tokenizer_dir, ignore_errors=True)
    return dict(wall=wall, steps=engine.engine.stats["steps"] - steps0, **used)


def run_served(args, tok, words) -> Dict[str, Any]:
    llm = build_engine(args, tok, words)
    engine = AsyncEngine(llm, "sim", {})
    timer = PhaseTimer()
    instrument(llm, timer, engine)
    if args.gc_freeze:  # as cvllm serve does once start-up is over
        from cvllm.utils.gc_freeze import freeze_startup_objects

        freeze_startup_objects()
    engine.start()
    while not engine.is_ready():
        time.sleep(0.01)
    timer.seconds.clear(), timer.calls.clear()
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "client.json"
        if args.api_process:
            res = _serve_through_api_process(args, engine, out)
        else:
            res = asyncio.run(_serve_and_load(args, engine, out))
        client = json.loads(out.read_text())
    engine.shutdown()
    tokens = client.get("total_output_tokens") or 0
    # the client's own timed span (its start-up and imports are not serving time)
    rep = report("served" + (" (API process)" if args.api_process else ""),
                 client.get("duration_s") or res["wall"], tokens, res["steps"], timer,
                 {k: v for k, v in res.items() if k not in ("wall", "steps")})
    rep["client"] = {k: client.get(k) for k in ("output_throughput", "ttft_ms", "itl_ms",
                                                 "completed", "failed", "duration_s")}
    return rep


def report(name, wall, tokens, steps, timer: PhaseTimer, cpu: Dict[str, float]) -> Dict[str, Any]:
    steps = max(steps, 1)
    return {
        "run": name, "wall_s": round(wall, 3), "output_tokens": tokens, "steps": steps,
        "tok_per_s": round(tokens / wall, 1), "steps_per_s": round(steps / wall, 1),
        "engine_phase_ms_per_step": {k: round(v * 1e3 / steps, 3) for k, v in sorted(timer.seconds.items())},
        "thread_cpu_ms_per_step": {k: round(v * 1e3 / steps, 3) for k, v in cpu.items()},
    }


def print_report(rep: Dict[str, Any]) -> None:
    print(f"== {rep['run']}: {rep['tok_per_s']:.0f} tok/s, {rep['steps_per_s']:.1f} steps/s "
          f"({rep['steps']} steps, {rep['wall_s']} s)")
    for k, v in rep["engine_phase_ms_per_step"].items():
        print(f"   engine {k:<20} {v:8.3f} ms/step")
    for k, v in rep["thread_cpu_ms_per_step"].items():
        print(f"   cpu    {k:<20} {v:8.3f} ms/step")
    if "client" in rep:
        c = rep["client"]
        print(f"   client: {c}")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF or HF folder for the tokenizer "
                    "(default: the default model)")
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--device-ms", type=float, default=15.0,
                    help="simulated device time per step (8B bf16 on an H100 at batch 256: ~15)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--real-model", default=None, metavar="FOLDER|8b",
                    help="the real runner on this model folder (random weights: load format "
                         "dummy) instead of the simulated device; '8b': the 8B Llama shape")
    ap.add_argument("--no-gc-freeze", dest="gc_freeze", action="store_false",
                    help="served run: leave start-up objects in the collector's sight")
    ap.add_argument("--skip-engine-alone", action="store_true")
    ap.add_argument("--skip-served", action="store_true",
                    help="(with --real-model run the two in separate processes: each "
                         "engine takes most of the GPU's memory for its KV cache)")
    ap.add_argument("--api-process", action="store_true",
                    help="served run: HTTP in the API process, as cvllm serve does by default "
                         "(without it: in this process, as --no-api-process)")
    ap.add_argument("--profile-loop", action="store_true",
                    help="cProfile the event-loop thread during the served run (slows it)")
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.real_model == "8b":  # the 8B Llama-3.1 shape, random weights, word-level tokenizer
        import bench_model as bm

        folder = Path(tempfile.mkdtemp(prefix="cvllm-host-"))
        args.real_model = str(bm.write_model_folder(folder, bm.build_config()))
    if args.real_model:
        tok = Tokenizer(loader.load_tokenizer(loader.resolve_model_source(args.real_model, None)))
        words = np.arange(100, min(len(tok.hf), 120000), dtype=np.int64)
    else:
        tok = Tokenizer(loader.load_tokenizer(loader.resolve_model_source(None, args.model)))
        words = word_tokens(tok)
    # bench_serving's random prompt ids come from a range; use the span of the word ids
    args.words_lo, args.words_hi = int(words.min()), int(words.max())
    results = []
    if not args.skip_engine_alone:
        results.append(run_engine_alone(args, tok, words))
        print_report(results[-1])
    if not args.skip_served:
        results.append(run_served(args, tok, words))
        print_report(results[-1])
    if len(results) == 2:
        ratio = results[1]["tok_per_s"] / results[0]["tok_per_s"]
        print(f"served / engine alone: {ratio:.2f}")
        results.append({"served_over_engine": round(ratio, 3)})
    if args.out:
        meta = {"args": {k: v for k, v in vars(args).items()}, "cpu_count": os.cpu_count()}
        Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
