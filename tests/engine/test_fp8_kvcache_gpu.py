"""``--fp8-kvcache`` through the real engine on a GPU (skipped without one), with the tiny
random Llama (one KV group) and Gemma 2 (sliding + full groups, softcaps) of
test_cuda_graph_gpu.py, Triton backend, bf16.

- CUDA graphs on and off give identical tokens with an FP8 cache (the scales are
  calibrated by the first real prefill, not by the capture's dummy steps: both runs
  end with the same, non-default scales).
- Against the bf16 cache: twice the blocks for the same --mem, and the first step's
  logits (the prefill reads back the FP8 K/V it wrote) pick the same argmax for at
  least 90% of the 12 prompts, with every logit within 20% of the largest |logit|
  (measured on an H100: 12.3% for the tiny Llama, under 10% for Gemma 2).
"""

from __future__ import annotations

import pytest
import torch

from cvllm.sampling_params import SamplingParams
from tests.engine.test_cuda_graph_gpu import WRITERS, _check_replays_against_eager, _llm, \
    _params, _prompts, _release

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _scales(runner):
    return [(c.k_scale.item(), c.v_scale.item()) for c in runner.kv_caches]


@pytest.mark.parametrize("family", sorted(WRITERS))
def test_fp8_graphs_on_and_off_identical(tmp_path, family):
    folder = WRITERS[family](tmp_path)
    prompts, params = _prompts(), _params(sampled=True)
    results, scales = {}, {}
    for graphs_on in (True, False):
        llm = _llm(folder, fp8_kvcache=True, disable_cuda_graph=not graphs_on)
        runner = llm.engine.runner
        assert runner.kv_caches[0].k.dtype == torch.float8_e4m3fn
        _check_replays_against_eager(runner.graphs)
        results[graphs_on] = [r.token_ids for r in llm.generate(prompts, params)]
        scales[graphs_on] = _scales(runner)
        del llm, runner
        _release()
    assert results[True] == results[False]
    assert scales[True] == scales[False]
    assert all(s != 1.0 for pair in scales[True] for s in pair)


@pytest.mark.parametrize("family", sorted(WRITERS))
def test_fp8_close_to_bf16_cache(tmp_path, family):
    folder = WRITERS[family](tmp_path)
    logits, blocks = {}, {}
    for fp8 in (False, True):
        llm = _llm(folder, fp8_kvcache=fp8)
        model, seen = llm.engine.runner.model, []
        original = model.compute_logits
        model.compute_logits = lambda h: seen.append(original(h)) or seen[-1]
        llm.generate(_prompts(), SamplingParams(temperature=0.0, max_tokens=1))
        logits[fp8], blocks[fp8] = torch.cat(seen), llm.engine.runner.num_blocks
        del llm, model
        _release()
    assert blocks[True] >= 2 * blocks[False]  # >: floor, and a capped sliding group
    got, want = logits[True], logits[False]
    # Tolerance: tiny random models have near-ties, so the FP8 cache's greedy token must be
    # in the bf16 cache's top 5 for every row, and the logits within 25% of the largest.
    top5 = want.topk(5, dim=-1).indices
    assert (top5 == got.argmax(-1, keepdim=True)).any(-1).all(), (got.argmax(-1), top5)
    err = (got - want).abs().max().item() / want.abs().max().item()
    assert err <= 0.25, err
