"""CUDA graphs of steps with prompt tokens (``worker/mixed_graph.py``) through the real
engine on a GPU (skipped without one). Tiny random models written in-process (Llama: one
KV group; Gemma 2: sliding and full layers, two groups, softcaps; Qwen2-MoE: fused
experts), served from their folders:

- every size is captured as one piece more than the model has attention layers;
- each replay's hidden states equal the same padded step launched eagerly, bit for bit
  (chunked prefills beside decodes, prefix-cache hits);
- graphs on and off give identical tokens, and graphs on give the tokens of the eager
  unpadded path (``--cuda-graph-max-tokens 0``) in float32;
- the FP8 cache calibrates at the first real prefill (its write is in the eager part).
"""

from __future__ import annotations

import gc

import pytest
import torch

from cvllm.sampling_params import SamplingParams
from tests.worker.tiny_llama import write_tiny_gemma2, write_tiny_llama

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _write_moe(tmp_path):
    """The Qwen2-MoE family test's tiny model (8 experts, top-2, a shared expert)."""
    from tests.models.test_family_qwen2_moe import _tiny
    from tests.worker.tiny_llama import word_tokenizer

    hf = _tiny(0, vocab_size=512, max_position_embeddings=512)  # the prompts' ids and lengths
    folder = tmp_path / "qwen2_moe"
    hf.save_pretrained(folder, safe_serialization=True)
    word_tokenizer(hf.config.vocab_size).save_pretrained(folder)
    return folder


WRITERS = {"llama": write_tiny_llama, "gemma2": write_tiny_gemma2}
LENS = [3, 7, 20, 45, 64, 90, 130, 5, 11, 200, 33, 1]
NEW = [40, 25, 60, 10, 33, 8, 50, 70, 12, 30, 5, 45]


def _prompts():
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(3, 500, (48,), generator=g).tolist()  # prefix-cache hits
    return [(shared if i % 3 == 0 else []) + torch.randint(3, 500, (n,), generator=g).tolist()
            for i, n in enumerate(LENS)]


def _params():
    return [SamplingParams(temperature=0.8 if i % 2 else 0.0, seed=100 + i, max_tokens=n,
                           ignore_eos=True) for i, n in enumerate(NEW)]


def _llm(folder, **kw):
    from cvllm.engine.llm import LLM

    kw.setdefault("kvcache_mem_mb", 256)
    kw.setdefault("dtype", "bf16")
    return LLM(weight_path=str(folder), max_num_seqs=16, max_model_len=512,
               prefill_chunk_size=64, **kw)


def _release() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _check_replays_against_eager(mixed, limit=40):
    """Wrap ``mixed.run``: after each replay, run the same padded step eagerly on the
    same static inputs (it rewrites the same K/V values) and require identical hidden
    states."""
    seen, run = [], mixed.run

    def checked(step, T, meta, prev=None):
        out = run(step, T, meta, prev)
        n = int(step.input_ids.shape[0])
        if T in mixed.graphs and len(seen) < limit:
            replayed = out[:n].clone()
            eager = mixed.model(mixed.input_ids[:T], mixed.positions[:T], meta, mixed.kv_caches)
            assert torch.equal(replayed, eager[:n]), f"replay != eager at {n} -> {T}"
        seen.append((n, T))
        return out

    mixed.run = checked
    return seen


@pytest.mark.parametrize("family", sorted(WRITERS))
def test_mixed_graphs_on_and_off_give_identical_tokens(tmp_path, family):
    folder = WRITERS[family](tmp_path)
    prompts, params = _prompts(), _params()
    results = {}
    for graphs_on in (True, False):
        llm = _llm(folder, disable_cuda_graph=not graphs_on)
        runner = llm.engine.runner
        mixed = runner.mixed
        assert mixed is not None and mixed.sizes == [16, 32, 64]  # the step budget: 64
        if graphs_on:
            from cvllm.layers.attention import Attention

            layers = sum(isinstance(m, Attention) for m in runner.model.modules())
            for T in mixed.sizes:
                assert len(mixed.holes[T]) == layers and len(mixed.graphs[T]) == layers + 1
        else:
            assert not mixed.graphs
        seen = _check_replays_against_eager(mixed)
        results[graphs_on] = [r.token_ids for r in llm.generate(prompts, params)]
        assert len({T for _, T in seen}) >= 2 and any(n < T for n, T in seen), seen
        del llm, runner, mixed
        _release()
    assert [len(t) for t in results[True]] == NEW
    assert results[True] == results[False]


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen2_moe"])
def test_mixed_graphs_give_the_eager_unpadded_tokens_in_f32(tmp_path, family):
    folder = _write_moe(tmp_path) if family == "qwen2_moe" else WRITERS[family](tmp_path)
    prompts = _prompts()
    greedy = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in NEW]
    tokens = {}
    for max_tokens in (512, 0):
        llm = _llm(folder, dtype="f32", cuda_graph_max_tokens=max_tokens)
        runner = llm.engine.runner
        assert (runner.mixed is None) == (max_tokens == 0)
        if max_tokens:
            assert runner.mixed.graphs, "no mixed graphs captured"
        tokens[max_tokens] = [r.token_ids for r in llm.generate(prompts, greedy)]
        del llm, runner
        _release()
    assert tokens[512] == tokens[0]


def test_fp8_cache_calibrates_at_the_first_real_prefill(tmp_path):
    folder = write_tiny_llama(tmp_path)
    greedy = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)] * 3
    prompts = _prompts()[:3]
    out = {}
    for max_tokens in (512, 0):
        llm = _llm(folder, fp8_kvcache=True, cuda_graph_max_tokens=max_tokens)
        runner = llm.engine.runner
        scales = [s for c in runner.kv_caches for s in (c.k_scale, c.v_scale)]
        assert all(c.scales_pending for c in runner.kv_caches)
        out[max_tokens] = ([r.token_ids for r in llm.generate(prompts, greedy)],
                           [s.clone() for s in scales])
        assert not any(c.scales_pending for c in runner.kv_caches)
        del llm, runner
        _release()
    (tok_a, sc_a), (tok_b, sc_b) = out[512], out[0]
    for a, b in zip(sc_a, sc_b):  # calibrated on the same first prefill
        torch.testing.assert_close(a, b, rtol=0.05, atol=0)
    assert sum(x == y for a, b in zip(tok_a, tok_b) for x, y in zip(a, b)) >= 0.8 * 24
