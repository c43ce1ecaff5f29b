"""Prefix caching on a GPU (skipped without one): the Triton backend with CUDA graphs,
the tiny random Llama (one KV group) and Gemma 2 (sliding + full groups, softcaps) of
test_cuda_graph_gpu.py, float32. Greedy tokens with the prefix cache on equal those with
it off for prompts that share prefixes (choices of one prompt admitted in one step, so
a prefill reads K/V that another row of the same step writes), under a KV cache about
4x oversubscribed (``family_harness.check_prefix_cache``), also with an FP8 cache."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_cuda_graph_gpu import WRITERS, _release
from tests.models.family_harness import check_prefix_cache

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("family", sorted(WRITERS))
def test_prefix_cache_on_and_off_identical(tmp_path, family, fp8):
    check_prefix_cache(WRITERS[family](tmp_path), cpu=False, fp8_kvcache=fp8)
    _release()
