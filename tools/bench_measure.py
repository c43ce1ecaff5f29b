"""What ``tools/bench.py`` measures on the device: the ceilings (copy bandwidth, matmul
rate) and cvllm's decode and prefill phases through the engine, plus the ratios of the
figures to their ceilings. Never imported by ``cvllm``; ``bench.py`` documents the method.

The phases drive ``LLMEngine`` directly (``add_request`` / ``step`` / ``abort_request``)
with token-id prompts, so they time the engine as a server runs it: scheduler, runner,
sampler and detokenizer, one ``step()`` per model step.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, List, Optional

import bench_model as bm

T_START = time.monotonic()


def log(msg: str) -> None:
    print(f"[bench {time.monotonic() - T_START:6.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------- ceilings
def time_fn(fn: Callable[[], Any], use_cuda: bool, reps: int, warmup: int = 3) -> float:
    """Median seconds of ``fn``: CUDA events around each call on a GPU, wall clock on the CPU."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if use_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000.0)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_rate(dev: Any, nbytes: int, use_cuda: bool) -> float:
    """Bytes read + written per second by a device-to-device copy of ``nbytes``."""
    import torch

    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=dev)  # [N]
    dst = torch.empty_like(src)
    return 2 * nbytes / time_fn(lambda: dst.copy_(src), use_cuda, reps=20)


def matmul_rate(dev: Any, n: int, dtype: Any, use_cuda: bool) -> float:
    """FLOP/s of an ``n x n @ n x n`` matmul (random inputs: zeros would draw less power)."""
    import torch

    a = torch.randn(n, n, device=dev, dtype=dtype)  # [n, n]
    b = torch.randn(n, n, device=dev, dtype=dtype)
    return 2.0 * n**3 / time_fn(lambda: a @ b, use_cuda, reps=20 if use_cuda else 5)


def measure_ceilings(use_cuda: bool, dtype_name: str) -> Dict[str, Any]:
    """Copy bandwidth (1 GiB buffers on a GPU) and bf16 matmul rate (8192^3 on a GPU)."""
    import torch

    dev = torch.device("cuda" if use_cuda else "cpu")
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[dtype_name]
    nbytes, n = ((1 << 30), 8192) if use_cuda else ((64 << 20), 384)
    bandwidth = copy_rate(dev, nbytes, use_cuda)
    flops = matmul_rate(dev, n, dtype, use_cuda)
    if use_cuda:
        torch.cuda.empty_cache()
    return {"copy_bytes_per_s": bandwidth, "copy_GBps": bandwidth / 1e9,
            "copy_buffer_bytes": nbytes, "matmul_flops_per_s": flops,
            "matmul_TFLOPs": flops / 1e12, "matmul_n": n, "matmul_dtype": dtype_name,
            "timing": "cuda events, median of 20" if use_cuda else "wall clock, median"}


# ---------------------------------------------------------------- cvllm phases
def random_prompts(rng: Any, n: int, length: int, vocab: int) -> List[List[int]]:
    return [rng.integers(0, vocab, length).tolist() for _ in range(n)]


def abort_all(engine: Any, ids: List[str]) -> None:
    for rid in ids:
        engine.abort_request(rid)
    guard = 0
    while engine.has_unfinished() and guard < 10_000:  # let the scheduler drop them
        engine.step()
        guard += 1


class DecodeWindow:
    """Counts one decode phase's tokens: window from all-started to first-finished."""

    def __init__(self, ids: List[str], prompt_len: int):
        self.counts = {rid: 0 for rid in ids}
        self.prompt_len = prompt_len
        self.t0: Optional[float] = None
        self.t1: Optional[float] = None
        self.tokens = self.steps = self.kv_tokens = 0
        self.step_times: List[float] = []

    def add(self, outs: List[Any], now: float, dt: float) -> bool:
        """Feed one step's outputs; True once the window is closed."""
        finished, emitted = False, 0
        for o in outs:
            prev = self.counts.get(o.request_id)
            if prev is None:
                continue
            k = len(o.delta_token_ids)
            self.counts[o.request_id] = prev + k
            if self.t0 is not None:
                emitted += k
                # the step that produced output token j attended over prompt + j - 1 tokens
                self.kv_tokens += sum(self.prompt_len + j - 1
                                      for j in range(prev + 1, prev + k + 1))
            finished = finished or o.finished
        if self.t0 is not None and emitted:
            self.tokens += emitted
            self.steps += 1
            self.step_times.append(dt)
        if self.t0 is None:
            if all(c >= 1 for c in self.counts.values()):
                self.t0 = now
            return False
        if finished:
            self.t1 = now
            return True
        return False


def run_decode(engine: Any, batch: int, prompt_len: int, tokens: int, rng: Any, vocab: int,
               timeout: float, tag: str) -> Dict[str, Any]:
    from cvllm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    ids = [f"{tag}-b{batch}-{i}" for i in range(batch)]
    preempt0 = getattr(engine.scheduler, "num_preemptions_total", 0)
    for rid, prompt in zip(ids, random_prompts(rng, batch, prompt_len, vocab)):
        engine.add_request(rid, prompt, params)
    win = DecodeWindow(ids, prompt_len)
    t_start = now = time.perf_counter()
    deadline, next_log = t_start + timeout, t_start + 10
    truncated = False
    try:
        while engine.has_unfinished():
            t = time.perf_counter()
            outs = engine.step()
            now = time.perf_counter()
            if win.add(outs, now, now - t):
                break
            if now > deadline:
                truncated, win.t1 = True, now
                break
            if now > next_log and win.t0 is not None:
                log(f"  batch {batch}: {win.tokens // batch}/{tokens} tokens, "
                    f"{win.tokens / (now - win.t0):.1f} tok/s so far")
                next_log = now + 10
    finally:
        abort_all(engine, ids)  # the rest of a cut window; no-op for finished requests
    dt = (win.t1 or now) - (win.t0 or t_start)
    res = {"batch": batch, "prompt_len": prompt_len, "output_tokens": tokens,
           "truncated": truncated, "decode_tokens": win.tokens, "decode_steps": win.steps,
           "decode_window_s": dt,
           "kv_tokens_read": win.kv_tokens, "startup_s": (win.t0 or now) - t_start,
           "preemptions": getattr(engine.scheduler, "num_preemptions_total", 0) - preempt0}
    if win.steps and dt > 0:
        res.update({"tokens_per_s": win.tokens / dt,
                    "tokens_per_s_per_seq": win.tokens / dt / batch,
                    "ms_per_step": 1000 * dt / win.steps,
                    "ms_per_step_median": 1000 * statistics.median(win.step_times)})
    return res


def run_prefill(engine: Any, num: int, length: int, rng: Any, vocab: int, timeout: float,
                tag: str) -> float:
    """Seconds to prefill ``num`` prompts of ``length`` tokens (and sample one token each)."""
    from cvllm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    ids = [f"{tag}-p{num}-{i}" for i in range(num)]
    prompts = random_prompts(rng, num, length, vocab)
    t = time.perf_counter()
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished():
        engine.step()
        if time.perf_counter() - t > timeout:
            abort_all(engine, ids)
            raise TimeoutError(f"prefill of {num} x {length} tokens took over {timeout:.0f}s")
    return time.perf_counter() - t


def meta_model(cfg: Dict[str, Any], dtype_bytes: int) -> Any:
    """cvllm's model class for ``cfg`` on the meta device: shapes and dtypes, no memory."""
    import torch

    from cvllm.config import ModelConfig
    from cvllm.models.registry import get_model_class

    dtype = "bf16" if dtype_bytes == 2 else "f32"
    mc = ModelConfig(architecture=cfg["architectures"][0], hf_config=cfg, dtype=dtype,
                     max_model_len=min(int(cfg.get("max_position_embeddings") or 4096), 8192))
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if dtype_bytes == 2 else torch.float32)
    try:
        with torch.device("meta"):
            return get_model_class(mc.architecture)(mc)
    finally:
        torch.set_default_dtype(prev)


def engine_facts(llm: Any, cfg: Dict[str, Any], dtype_bytes: int) -> Dict[str, Any]:
    """What the ceilings need from the built engine, read from it where it exposes it."""
    import torch

    engine = llm.engine
    runner = getattr(engine, "runner", None)
    model = getattr(runner, "model", None)
    facts: Dict[str, Any] = {"name": cfg.get("architectures", ["?"])[0]}
    if not isinstance(model, torch.nn.Module):  # the runner moved it: count a meta copy
        model = meta_model(cfg, dtype_bytes)
        facts["params_source"] = "meta-device copy of the model class"
    facts.update(bm.model_costs(model, cfg))
    kv = bm.kv_bytes_per_token_from_config(cfg, dtype_bytes)
    facts["kv_bytes_per_token_source"] = "config"
    try:
        from cvllm.attention.kv_cache import kv_caches_nbytes

        slots = runner.num_blocks * engine.block_size
        kv = kv_caches_nbytes(runner.kv_caches) // slots
        facts["kv_bytes_per_token_source"] = "allocated cache"
        facts["kv_capacity_tokens"] = slots
    except Exception as e:  # the engine's insides moved: keep the config's figure
        facts["kv_bytes_per_token_note"] = f"from config ({type(e).__name__}: {e})"
    facts["kv_bytes_per_token"] = int(kv)
    facts["attention_backends"] = sorted({getattr(m.backend, "name", type(m.backend).__name__)
                                          for m in model.modules() if hasattr(m, "backend")})
    return facts


def decode_figures(res: Dict[str, Any], facts: Dict[str, Any], ceil: Dict[str, Any]) -> None:
    if not res.get("tokens_per_s"):
        return
    roof = bm.decode_roofline(facts["weight_bytes_per_step"], facts["kv_bytes_per_token"],
                              res["decode_steps"], res["kv_tokens_read"], res["decode_window_s"],
                              ceil["copy_bytes_per_s"])
    res.update(roof)
    res["roofline_tokens_per_s"] = res["batch"] * ceil["copy_bytes_per_s"] / roof["bytes_per_step"]


def prefill_figures(res: Dict[str, Any], facts: Dict[str, Any], cfg: Dict[str, Any],
                    ceil: Dict[str, Any]) -> None:
    flops = bm.prefill_flops(facts, cfg, res["num_prompts"], res["prompt_len"])
    tokens = res["num_prompts"] * res["prompt_len"]
    res.update({"tokens_per_s": tokens / res["seconds"], "flops": flops,
                "achieved_TFLOPs": flops / res["seconds"] / 1e12,
                "fraction_of_matmul": flops / res["seconds"] / ceil["matmul_flops_per_s"],
                "ceiling_tokens_per_s": tokens * ceil["matmul_flops_per_s"] / flops})
