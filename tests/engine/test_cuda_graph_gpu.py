"""CUDA graphs, the Triton backend and KV sizing through the real engine on a GPU
(skipped without one). Tiny random models written in-process (Llama: one KV group;
Gemma 2: sliding and full layers, two groups, softcaps), served from their folders.

- Graphs on and off give identical tokens over mixed batches (chunked prefills next to
  decodes, rows finishing at different steps so decode batches of every size pad to
  the capture sizes, greedy and seeded sampling), and every replay's hidden states equal
  the same padded step launched eagerly, bit for bit. Every size's logits are rows of
  one static buffer.
- Greedy decode steps take the graph's argmax; penalized rows count their placeholder
  token from the patched inputs, and the overlapped loop equals the synchronous one.
- The Triton engine matches the torch reference engine: greedy tokens in float32, the
  first step's logits in bf16.
- Without --mem, the cache is sized from the profile and a budget too small for one
  max-length sequence is refused.
"""

from __future__ import annotations

import gc

import pytest
import torch

from cvllm.config import ConfigError
from cvllm.sampling_params import SamplingParams
from cvllm.worker.cuda_graph import OWN_LOGITS_ROWS, capture_sizes
from tests.worker.tiny_llama import write_tiny_gemma2, write_tiny_llama

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

WRITERS = {"llama": write_tiny_llama, "gemma2": write_tiny_gemma2}
LENS = [3, 7, 20, 45, 64, 90, 130, 5, 11, 200, 33, 1]
NEW = [40, 25, 60, 10, 33, 8, 50, 70, 12, 30, 5, 45]
MAX_NUM_SEQS = 16


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in LENS]


def _params(sampled: bool):
    return [SamplingParams(temperature=0.8 if sampled and i % 2 else 0.0, seed=100 + i,
                           max_tokens=n, ignore_eos=True) for i, n in enumerate(NEW)]


def _llm(folder, **kw):
    from cvllm.engine.llm import LLM

    kw.setdefault("kvcache_mem_mb", 256)
    kw.setdefault("dtype", "bf16")
    return LLM(weight_path=str(folder), max_num_seqs=MAX_NUM_SEQS, max_model_len=512,
               prefill_chunk_size=64, **kw)


def _release() -> None:
    """Free the engines the caller dropped (their KV caches and graph pools)."""
    gc.collect()
    torch.cuda.empty_cache()


def _check_replays_against_eager(graphs, limit=40):
    """Wrap ``graphs.run``: after each replay, launch the same padded step eagerly (it
    rewrites the same K/V values) and require identical logits."""
    seen, run = [], graphs.run

    def checked(step, bs, prev=None):
        out = run(step, bs, prev)
        if bs in graphs.graphs and len(seen) < limit:
            replayed, rows = out.clone(), graphs.buffers.prev_rows[:bs].clone()
            graphs.buffers.prev_rows[:bs] = -1  # the replay patched the ids in place already
            eager = graphs._forward(bs)
            graphs.buffers.prev_rows[:bs] = rows
            B = int(step.seq_lens.shape[0])
            assert torch.equal(replayed[:B], eager[:B]), f"replay != eager at {B} -> {bs}"
        seen.append((int(step.seq_lens.shape[0]), bs))
        return out

    graphs.run = checked
    return seen


@pytest.mark.parametrize("family", sorted(WRITERS))
def test_graphs_on_and_off_give_identical_tokens(tmp_path, family):
    folder = WRITERS[family](tmp_path)
    prompts, params = _prompts(), _params(sampled=True)
    results = {}
    for graphs_on in (True, False):
        llm = _llm(folder, disable_cuda_graph=not graphs_on)
        graphs = llm.engine.runner.graphs
        assert graphs is not None and graphs.sizes == capture_sizes(MAX_NUM_SEQS)
        assert set(graphs.graphs) == (set(graphs.sizes) if graphs_on else set())
        if graphs_on:  # one static logits buffer above OWN_LOGITS_ROWS, not one per size
            big = [o for bs, o in graphs.outputs.items() if bs > OWN_LOGITS_ROWS]
            assert len({o.data_ptr() for o in big}) == min(1, len(big))
            own = [o.data_ptr() for bs, o in graphs.outputs.items() if bs <= OWN_LOGITS_ROWS]
            assert len(set(own)) == len(own) and not set(own) & {o.data_ptr() for o in big}
        seen = _check_replays_against_eager(graphs)
        results[graphs_on] = [r.token_ids for r in llm.generate(prompts, params)]
        padded = {(b, bs) for b, bs in seen}
        assert any(b < bs for b, bs in padded), padded  # some batches really were padded
        assert 1 in {bs for _, bs in padded} and len({bs for _, bs in padded}) >= 3, padded
        del llm, graphs
        _release()
    assert [len(t) for t in results[True]] == NEW
    assert results[True] == results[False]


@pytest.mark.parametrize("family", sorted(WRITERS))
def test_triton_engine_matches_torch_ref_engine(tmp_path, family):
    folder = WRITERS[family](tmp_path)
    prompts = _prompts()
    greedy = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in NEW]
    tokens, first_logits = {}, {}
    for backend in ("torch_ref", "auto"):
        llm = _llm(folder, dtype="f32", attention_backend=backend)
        runner = llm.engine.runner
        assert (runner.graphs is None) == (backend == "torch_ref")
        tokens[backend] = [r.token_ids for r in llm.generate(prompts, greedy)]
        del llm, runner
        _release()
        llm = _llm(folder, dtype="bf16", attention_backend=backend)
        model, seen = llm.engine.runner.model, []
        original = model.compute_logits
        model.compute_logits = lambda h: seen.append(original(h)) or seen[-1]
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1))
        first_logits[backend] = torch.cat(seen)  # [prompts, V], in scheduling order
        del llm, model
        _release()
    assert tokens["auto"] == tokens["torch_ref"]
    got, want = first_logits["auto"], first_logits["torch_ref"]
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, atol=0.02 * scale, rtol=0)
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree


def test_graph_steps_sample_in_the_graph_and_count_placeholders_for_penalties(tmp_path):
    """A greedy decode step's ids are the graph's own argmax (``buffers.sampled``, where
    the next step's placeholders are patched from); a penalized row recomputes them, and
    in the overlapped loop counts its placeholder token from the step's patched inputs
    (the graph has overwritten the previous ids): the overlapped loop gives the tokens
    of the one-step-at-a-time loop. One request at a time, so every step has one shape."""
    folder = write_tiny_llama(tmp_path)
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    penal = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                           repetition_penalty=1.3, frequency_penalty=-2.0, presence_penalty=-2.0)
    llm = _llm(folder, dtype="f32")
    engine, runner = llm.engine, llm.engine.runner
    buf, forward, seen = runner.graphs.buffers.sampled, runner.sampler.forward, []

    def recording(logits, t, *a, stats=None, **k):
        out = forward(logits, t, *a, stats=stats, **k)
        seen.append((stats is not None, out.sampled.data_ptr() == buf.data_ptr()))
        return out

    runner.sampler.forward = recording
    tokens = {}
    for overlap in (True, False):
        engine.overlap = overlap
        tokens[overlap] = [llm.generate([p], sp)[0].token_ids
                           for p in _prompts()[:3] for sp in (plain, penal)]
    assert tokens[True] == tokens[False]
    assert tokens[True][0::2] != tokens[True][1::2]  # the penalties changed something
    assert (True, True) in seen and (True, False) in seen and (False, False) in seen, set(seen)
    del llm, engine, runner
    _release()


def test_cache_is_sized_from_the_profile_and_too_small_is_refused(tmp_path):
    folder = write_tiny_llama(tmp_path)
    total = torch.cuda.mem_get_info()[1]
    llm = _llm(folder, kvcache_mem_mb=None, gpu_memory_fraction=0.02)
    runner = llm.engine.runner
    from cvllm.attention.kv_cache import kv_caches_nbytes

    used = kv_caches_nbytes(runner.kv_caches)
    assert 0.005 * total < used <= 0.02 * total, (used, total)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4
    del llm, runner
    _release()
    with pytest.raises(ConfigError, match="cannot hold one sequence of --max-model-len 512"):
        _llm(folder, kvcache_mem_mb=None, gpu_memory_fraction=1e-7)
