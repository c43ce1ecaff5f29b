"""``--seed`` seeds the sampling of requests that give no seed of their own: two engines
with the same seed give the same sampled tokens, a different seed different ones (a tiny
random Llama on the CPU, and on a GPU when there is one; rows at temperature 1, no
per-request seed)."""

from __future__ import annotations

import pytest
import torch

from cvllm.engine.llm import LLM
from cvllm.sampling_params import SamplingParams
from tests.worker.tiny_llama import write_tiny_llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("seed"))


def _tokens(model_dir, seed: int, cpu: bool = True):
    llm = LLM(weight_path=str(model_dir), cpu=cpu, max_num_seqs=4, kvcache_mem_mb=8,
              max_model_len=128, seed=seed)
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    return [r.token_ids for r in llm.generate([[5, 6, 7], [9, 10, 11, 12]], params)]


def _check(model_dir, cpu: bool) -> None:
    first = _tokens(model_dir, 3, cpu)
    assert _tokens(model_dir, 3, cpu) == first
    assert _tokens(model_dir, 4, cpu) != first


def test_engine_seed_makes_unseeded_sampling_reproducible(model_dir):
    _check(model_dir, cpu=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_engine_seed_makes_unseeded_sampling_reproducible_on_the_gpu(model_dir):
    _check(model_dir, cpu=False)
