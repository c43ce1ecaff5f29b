"""KV cache sizing on CUDA (``worker/memory.py``), with torch.cuda mocked on the CPU: the
budget arithmetic and its refusal, the profile step's shape, that ``measure`` runs the
real model and sampler on it and reads the peaks right, and that the runner gives the
result to ``plan_kv_cache`` (which still refuses a budget that cannot hold one
max-length sequence). Also rank 0's one device-to-host copy per step
(``worker/output_copy.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cvllm.attention.metadata import AttentionMetadata
from cvllm.config import (CacheConfig, ConfigError, DeviceConfig, EngineConfig, ModelConfig,
                          SchedulerConfig)
from cvllm.layers.sampler import SamplerOutput
from cvllm.worker import memory
from cvllm.worker import model_runner as mr
from cvllm.worker import runner_setup as rs
from cvllm.worker.output_copy import OutputCopy
from tests.worker.tiny_llama import LLAMA_CFG

GIB = 1 << 30


def test_budget_is_the_fraction_of_what_is_left():
    p = memory.MemoryProfile(total=80 * GIB, non_torch=GIB, weights=16 * GIB,
                             peak_activation=2 * GIB, graph_margin=GIB // 2)
    assert memory.kv_cache_budget(p, 0.7, 8192) == int(0.7 * (60.5 * GIB))
    assert memory.kv_cache_budget(p, 1.0, 8192) == int(60.5 * GIB)


def test_no_memory_left_is_refused_with_the_numbers():
    p = memory.MemoryProfile(total=24 * GIB, non_torch=GIB, weights=22 * GIB,
                             peak_activation=GIB, graph_margin=GIB // 4)
    with pytest.raises(ConfigError,
                       match="no GPU memory is left.*weights take 22.00 GiB.*8192 tokens"):
        memory.kv_cache_budget(p, 0.9, 8192)


def test_profile_step_shape():
    assert memory.dummy_seq_lens(8192, 256, 8192) == [8192]
    assert memory.dummy_seq_lens(100, 4, 30) == [30, 30, 30, 10]
    assert memory.dummy_seq_lens(1000, 2, 100) == [100, 100]  # what the limits allow
    ids, pos, kw, blocks = memory.dummy_step([20, 3, 16], block_size=8, num_groups=1)
    assert blocks == 3 + 1 + 2 and ids.shape == pos.shape == (39,)
    assert pos.tolist()[:21] == list(range(20)) + [0]
    assert len(set(kw["slot_mapping"].tolist())) == 39  # no slot written twice
    meta = AttentionMetadata.build(device="cpu", **kw)
    assert meta.num_tokens == 39 and meta.num_decodes == 0 and meta.max_seq_len == 20
    # with contexts: one decode over 20 cached tokens, then a 3-token chunk after 5
    ids, pos, kw, blocks = memory.dummy_step([1, 3], block_size=8, num_groups=1,
                                             contexts=[20, 5])
    assert blocks == 3 + 1 and pos.tolist() == [20, 5, 6, 7]
    assert kw["slot_mapping"].tolist() == [20, 24 + 5, 24 + 6, 24 + 7]
    meta = AttentionMetadata.build(device="cpu", **kw)
    assert meta.num_decodes == 1 and meta.decode_max_seq_len == 21
    assert meta.prefill_max_seq_len == 8 and meta.prefill_max_query_len == 3


def _tiny_llama(max_model_len=128):
    from cvllm.models.registry import get_model_class

    mc = ModelConfig("LlamaForCausalLM", dict(LLAMA_CFG), dtype="f32", max_model_len=max_model_len)
    model = get_model_class(mc.architecture)(mc)
    model.init_dummy_weights(0)
    return mc, model.eval()


class FakeCuda:
    """The torch.cuda calls ``worker/memory.py`` makes, answered from fixed numbers: each
    profile step's peak is ``weights + its cache + next(peaks)``."""

    def __init__(self, weights, peaks, free, total, reserved):
        self.weights, self.peaks = weights, list(peaks)
        self.free, self.total, self.reserved = free, total, reserved
        self.cache_bytes = 0

    def install(self, monkeypatch):
        cuda = memory.torch.cuda
        for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
            monkeypatch.setattr(cuda, name, lambda *a, **k: None)
        monkeypatch.setattr(cuda, "memory_allocated", lambda *a: self.weights)
        monkeypatch.setattr(cuda, "max_memory_allocated",
                            lambda *a: self.weights + self.cache_bytes + self.peaks.pop(0))
        monkeypatch.setattr(cuda, "mem_get_info", lambda *a: (self.free, self.total))
        monkeypatch.setattr(cuda, "memory_reserved", lambda *a: self.reserved)
        alloc = memory.allocate_kv_caches

        def allocate(*a, **k):  # the throw-away cache counts towards the fake peak
            caches = alloc(*a, **k)
            self.cache_bytes = memory.kv_caches_nbytes(caches)
            return caches

        monkeypatch.setattr(memory, "allocate_kv_caches", allocate)


def test_measure_runs_the_model_and_reads_the_peaks(monkeypatch):
    _, model = _tiny_llama()
    specs = rs.model_cache_specs(model, _engine_config(), torch.float32)
    fake = FakeCuda(weights=5 * GIB, peaks=[777, 55], free=50 * GIB, total=80 * GIB,
                    reserved=20 * GIB)
    fake.install(monkeypatch)
    seen, forward = [], model.forward
    monkeypatch.setattr(model, "forward", lambda ids, pos, meta, c: seen.append(
        (ids.shape[0], meta.num_seqs, meta.num_decodes)) or forward(ids, pos, meta, c))
    p = memory.measure(model, specs, block_size=16, num_tokens=100, max_seqs=4, max_len=40,
                       decode_rows=8, device=torch.device("cpu"))
    assert seen == [(100, 3, 0), (8, 8, 8)]  # the largest step, then the largest decode
    assert (p.peak_activation, p.graph_margin) == (777, 55 + memory.GRAPH_POOL_SLACK)
    assert (p.total, p.weights, p.non_torch) == (80 * GIB, 5 * GIB, 10 * GIB)


def _engine_config(mem=None, fraction=0.7, max_model_len=128, max_num_seqs=4):
    mc = ModelConfig("LlamaForCausalLM", dict(LLAMA_CFG), dtype="f32", max_model_len=max_model_len)
    return EngineConfig(
        model=mc,
        cache=CacheConfig(block_size=16, kvcache_mem_mb=mem, gpu_memory_fraction=fraction),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, prefill_chunk_size=64),
        device=DeviceConfig(), load_format="dummy",
    )


def _runner_as_if_cuda(monkeypatch, config, profile):
    """A CPU runner whose next ``_plan`` takes the CUDA branch with ``profile``."""
    runner = mr.ModelRunner(_engine_config(mem=1), source=None)
    runner.config = config
    runner.device = torch.device("cuda")
    calls = []
    monkeypatch.setattr(memory, "measure", lambda *a, **k: calls.append(k) or profile)
    return runner, calls


def _plan(runner, capture):
    """The runner's KV cache layout, sized as at its start-up (``runner_setup.size_kv_cache``)."""
    return rs.size_kv_cache(runner.config, runner.model, runner.cache_specs, runner.device,
                            capture)


def test_runner_sizes_the_cache_from_the_profile(monkeypatch):
    per_block = 2 * 2 * 16 * 2 * 32 * 4  # K+V, layers, tokens, kv heads, head_dim, f32
    profile = memory.MemoryProfile(total=100 * per_block + 10, non_torch=0, weights=0,
                                   peak_activation=10, graph_margin=0)
    config = _engine_config(fraction=0.5)
    runner, calls = _runner_as_if_cuda(monkeypatch, config, profile)
    layout = _plan(runner, capture=True)
    assert layout.groups[0].num_blocks == 50
    assert calls[0]["num_tokens"] == 64 and calls[0]["max_len"] == 64
    # graph pool margin: the largest decode (4 rows) or mixed step (64 tokens, the budget)
    assert calls[0]["decode_rows"] == 64
    _plan(runner, capture=False)
    assert calls[1]["decode_rows"] == 0
    runner.config.cuda_graph_max_tokens = 0  # no mixed graphs: the largest decode size
    _plan(runner, capture=True)
    assert calls[2]["decode_rows"] == 4
    # 8 blocks of 16 tokens cannot hold one 128-token sequence: refused, clearly.
    small = memory.MemoryProfile(total=14 * per_block, non_torch=0, weights=0,
                                 peak_activation=0, graph_margin=0)
    runner, _ = _runner_as_if_cuda(monkeypatch, config, small)
    with pytest.raises(ConfigError, match="cannot hold one sequence of --max-model-len 128"):
        _plan(runner, capture=False)


# ----- one device-to-host copy per step -----------------------------------------------------


def test_output_copy_packs_ids_and_logprobs_into_one_copy():
    oc = OutputCopy(torch.device("cpu"))
    out = SamplerOutput(sampled=torch.tensor([5, 70000]), logprobs=torch.tensor([-0.5, -1.25]))
    res = oc.fetch(out, with_logprobs=False, num_top=0)
    assert res.token_ids.tolist() == [5, 70000] and res.token_ids.dtype == np.int64
    assert res.logprobs is None and oc.num_copies == 1
    out.top_logprob_ids = torch.tensor([[5, 6], [70000, 1]])
    out.top_logprob_values = torch.tensor([[-0.5, -2.0], [-1.25, -3.0]])
    res = oc.fetch(out, with_logprobs=True, num_top=2)
    assert oc.num_copies == 2
    assert res.token_ids.tolist() == [5, 70000] and res.logprobs.tolist() == [-0.5, -1.25]
    assert res.top_ids.tolist() == [[5, 6], [70000, 1]]
    assert res.top_logprobs.tolist() == [[-0.5, -2.0], [-1.25, -3.0]]


def test_engine_makes_one_copy_per_sampling_step(tmp_path):
    from cvllm.engine.llm import LLM
    from cvllm.sampling_params import SamplingParams
    from tests.worker.tiny_llama import write_tiny_llama

    llm = LLM(weight_path=str(write_tiny_llama(tmp_path)), cpu=True, max_num_seqs=4,
              kvcache_mem_mb=8, prefill_chunk_size=8, max_model_len=128)
    runner = llm.engine.runner
    sampled_steps, launch = [], runner.launch
    runner.launch = lambda step, seqs=None: (
        lambda p: sampled_steps.append(p._output is not None) or p)(launch(step, seqs))
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.8, max_tokens=4, ignore_eos=True, logprobs=2)]
    res = llm.generate([list(range(3, 15)), [9, 10, 11]], params)
    assert [len(r.token_ids) for r in res] == [6, 4]
    assert runner.output_copy.num_copies == sum(sampled_steps) < len(sampled_steps)
