"""Start-up compiles the prefill kernels' variants (worker/memory.warm_up_prefill): serving
short prompts and prefix-cache suffixes afterwards compiles nothing more (each compile
stalled every stream for about a second on an H100)."""

from __future__ import annotations

import gc

import pytest
import torch

from cvllm.sampling_params import SamplingParams
from tests.worker.tiny_llama import write_tiny_llama

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _compiled_kernels():
    """Names of the Triton kernels compiled from now on (a list that grows)."""
    import triton

    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        pytest.skip("this Triton has no jit_post_compile_hook")
    names = []

    def hook(*args, **kwargs):
        fn = kwargs.get("fn")
        names.append(getattr(fn, "name", None) or getattr(getattr(fn, "fn", None), "__name__", "?"))
        # the specialization (which arguments were classed aligned / divisible by 16)
        _compiled_kernels.last_configs = (kwargs.get("compile") or {}).get("configs")
        return False

    runtime.jit_post_compile_hook = hook
    return names


def _hook_sees_compiles(names) -> None:
    """The hook fires on a kernel no other test compiled (a fresh specialization)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _warm_up_probe(x_ptr, N: tl.constexpr):
        tl.store(x_ptr + tl.arange(0, N), tl.arange(0, N))

    x = torch.empty(64, dtype=torch.int32, device="cuda")
    _warm_up_probe[(1,)](x, N=64)
    torch.cuda.synchronize()
    assert any("probe" in n for n in names), names


def test_short_prompts_and_prefix_hits_compile_no_prefill_kernel(tmp_path):
    from cvllm.engine.llm import LLM

    names = _compiled_kernels()
    try:
        _hook_sees_compiles(names)
        llm = LLM(weight_path=str(write_tiny_llama(tmp_path)), max_model_len=256,
                  max_num_seqs=8, kvcache_mem_mb=64)
        names.clear()  # (earlier tests in this process may have compiled some already)
        greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        base = list(range(10, 58))
        prompts = [base[:12], base[:20], base[:48], base[:33] + [3], base + [5, 6], base[:9]]
        llm.generate(prompts, greedy)  # fresh prompts, then hits with short suffixes
        llm.generate([base + [7] * 20, base + [8]], greedy)
        assert not [n for n in names if "prefill" in n], names
    finally:
        import triton

        triton.knobs.runtime.jit_post_compile_hook = None
        gc.collect()
        torch.cuda.empty_cache()


def _step_until_decoding(engine, request_ids) -> None:
    """Step until every request named has its prompt computed (it decodes from then on)."""
    for _ in range(64):
        seqs = [s for s in engine.scheduler.running if s.request_id in request_ids]
        if len(seqs) == len(request_ids) and all(s.num_uncomputed_tokens <= 1 for s in seqs):
            return
        engine.step()
    pytest.fail(f"{sorted(request_ids)} never all reached decode")


def test_mixed_steps_with_long_contexts_compile_no_attention_kernel(tmp_path):
    """Eager mixed steps: 1..6 sequences decoding beside prefix-cache hits on contexts whose
    block tables are 16 and 40-odd blocks wide, then 1..2 decoding over 1,200-odd keys. The batch's make-up moves the metadata
    slices' alignment, the table width and the split count from step to step; none may
    pick a kernel variant start-up did not compile (``kernels/jit.py``)."""
    from cvllm.engine.llm import LLM

    names = _compiled_kernels()
    try:
        _hook_sees_compiles(names)
        llm = LLM(weight_path=str(write_tiny_llama(tmp_path)), max_model_len=2048,
                  max_num_seqs=16, kvcache_mem_mb=256)
        engine = llm.engine
        base = [10 + (i * 7) % 400 for i in range(1400)][:700]
        long = [10 + (i * 11) % 400 for i in range(1400)]  # a decode over > 1024 keys
        llm.generate([base[:256], base], SamplingParams(temperature=0.0, max_tokens=1))
        names.clear()
        for k in range(1, 7):
            decoding = [f"d{k}-{i}" for i in range(k)]
            for i, rid in enumerate(decoding):
                engine.add_request(rid, base[:60 + 97 * i] + [k, i], SamplingParams(
                    temperature=0.0, max_tokens=24, ignore_eos=True))
            _step_until_decoding(engine, set(decoding))
            engine.add_request(f"hit{k}", base + [k] * (13 * k), SamplingParams(
                temperature=0.0, max_tokens=3, ignore_eos=True))
            engine.add_request(f"hit256-{k}", base[:256] + [k] * k, SamplingParams(
                temperature=0.0, max_tokens=3, ignore_eos=True))
            while engine.has_unfinished():
                engine.step()
        # one or two sequences decoding over more than 1,024 keys: the merge's wide tile
        for k in (1, 2):
            decoding = [f"long{k}-{i}" for i in range(k)]
            for i, rid in enumerate(decoding):
                engine.add_request(rid, long[:1200 + 50 * i] + [k, i], SamplingParams(
                    temperature=0.0, max_tokens=16, ignore_eos=True))
            _step_until_decoding(engine, set(decoding))
            engine.add_request(f"hit-long{k}", base + [k] * 5, SamplingParams(
                temperature=0.0, max_tokens=3, ignore_eos=True))
            while engine.has_unfinished():
                engine.step()
        torch.cuda.synchronize()
        assert not [n for n in names if any(w in n for w in ("prefill", "decode", "merge"))], \
            (names, getattr(_compiled_kernels, "last_configs", None))
    finally:
        import triton

        triton.knobs.runtime.jit_post_compile_hook = None
        gc.collect()
        torch.cuda.empty_cache()



_CAPTURE_PROBE = """
import json, sys, torch, triton
from cvllm.engine.llm import LLM
during = []
def hook(*args, **kwargs):
    if torch.cuda.is_current_stream_capturing():
        during.append(getattr(kwargs.get("fn"), "name", "?"))
    return False
triton.knobs.runtime.jit_post_compile_hook = hook
llm = LLM(weight_path=sys.argv[1], max_model_len=256, max_num_seqs=8, kvcache_mem_mb=64)
graphs = llm.engine.runner.graphs
print(json.dumps({"graphs": len(graphs.graphs) if graphs else 0, "during": during}))
"""


def test_decode_graphs_capture_without_compiling(tmp_path):
    """The pre-capture warm-up launches as the capture does (``pdl.graph_launches``;
    ``launch_pdl`` is a compile option), so nothing compiles while a graph is captured.
    In a fresh process: kernels other tests compiled would hide a compile here."""
    import json
    import os
    import subprocess
    import sys

    import triton

    if not hasattr(getattr(getattr(triton, "knobs", None), "runtime", None),
                   "jit_post_compile_hook"):
        pytest.skip("this Triton has no jit_post_compile_hook")
    folder = write_tiny_llama(tmp_path)
    proc = subprocess.run([sys.executable, "-c", _CAPTURE_PROBE, str(folder)],
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, CVLLM_NO_PROGRESS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["graphs"] > 0, report
    assert not report["during"], report
