"""ModelRunner and per-layer cache specs: the model's ``cache_specs()`` decide what
``kv_caches[i]`` holds, --mem counts the bytes of every layer and state slot, the default
specs honour sliding windows, and state slots of sequences starting afresh are zeroed
before the forward."""

import numpy as np
import pytest
import torch
from torch import nn

from cvllm.attention.kv_cache import kv_caches_nbytes
from cvllm.attention.specs import FullAttentionSpec, MLASpec, SlidingWindowSpec, StateSpec
from cvllm.config import (
    CacheConfig,
    ConfigError,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from cvllm.core.kv_cache_manager import KVCacheManager
from cvllm.core.scheduler_output import ScheduledSeq, SchedulerOutput
from cvllm.core.sequence import Sequence
from cvllm.core.step_builder import build_step_input
from cvllm.core.wire_format import StepInputError
from cvllm.layers.attention import Attention
from cvllm.sampling_params import SamplingParams
from cvllm.worker import model_runner as mr
from cvllm.worker import runner_setup as rs

F32 = torch.float32
HIDDEN = 8
SPECS = [
    FullAttentionSpec(2, 8, F32),
    SlidingWindowSpec(2, 8, F32, 8),
    MLASpec(12, 4, F32),
    StateSpec(((3, 5), (2, 4)), (F32, F32)),
]


class SpecModel(nn.Module):
    """Declares SPECS; its forward records what it was given."""

    specs = SPECS

    def __init__(self, model_config, quant_config=None):
        super().__init__()
        self.calls = []

    def cache_specs(self):
        return list(self.specs)

    def init_dummy_weights(self, seed):
        pass

    def forward(self, input_ids, positions, attn_metadata, kv_caches):
        states = [tuple(t.clone() for t in c) for c, s in zip(kv_caches, self.specs)
                  if isinstance(s, StateSpec)]
        self.calls.append((attn_metadata, states))
        for c, s in zip(kv_caches, self.specs):
            if isinstance(s, StateSpec):  # a layer writing its slots
                for t in c:
                    t[attn_metadata.state_slots] = 1.0
        return torch.zeros(input_ids.shape[0], HIDDEN)


class WindowedModel(nn.Module):
    """No cache_specs(): one Attention module per layer, alternating windows."""

    def __init__(self, model_config, quant_config=None):
        super().__init__()
        self.attns = nn.ModuleList(
            Attention(4, 8, 0.3, 2, sliding_window=w) for w in (None, 6, None)
        )

    def init_dummy_weights(self, seed):
        pass


def _config(layers, mem=None, num_blocks=None, max_model_len=64, max_num_seqs=4):
    hf = dict(hidden_size=16, num_hidden_layers=layers, num_attention_heads=2,
              num_key_value_heads=2, vocab_size=64, max_position_embeddings=max_model_len)
    return EngineConfig(
        model=ModelConfig("Fake", hf),
        cache=CacheConfig(block_size=8, kvcache_mem_mb=mem, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, prefill_chunk_size=16),
        device=DeviceConfig(), load_format="dummy",
    )


def _runner(monkeypatch, cls, config):
    monkeypatch.setattr(rs, "get_model_class", lambda arch: cls)
    return mr.ModelRunner(config, source=None)


def test_caches_follow_the_specs_and_mem_counts_every_layer(monkeypatch):
    runner = _runner(monkeypatch, SpecModel, _config(4, mem=1))
    layout = runner.kv_layout
    full, sliding = layout.groups
    assert (full.sliding_window, full.layer_ids) == (None, (0, 2))
    assert (sliding.sliding_window, sliding.layer_ids) == (8, (1,))
    assert layout.num_state_slots == 4 and runner.num_blocks == full.num_blocks
    k, v = runner.kv_caches[0]
    assert k.shape == (full.num_blocks, 8, 2, 8)
    assert runner.kv_caches[1].k.shape == (sliding.num_blocks, 8, 2, 8)
    assert runner.kv_caches[2][0].shape == (full.num_blocks, 8, 16)
    assert runner.kv_caches[2][1] is None
    assert [t.shape for t in runner.kv_caches[3]] == [(4, 3, 5), (4, 2, 4)]
    used = kv_caches_nbytes(runner.kv_caches)
    full_block = 8 * (2 * 2 * 8 * 4 + 16 * 4)
    assert 1 << 20 >= used > (1 << 20) - full_block - 8 * 2 * 2 * 8 * 4
    assert runner.config.cache.num_blocks == full.num_blocks


def test_too_small_cache_is_refused(monkeypatch):
    with pytest.raises(ConfigError, match="cannot hold one sequence of --max-model-len 64"):
        _runner(monkeypatch, SpecModel, _config(4, num_blocks=7))


def test_default_specs_come_from_the_attention_layers(monkeypatch):
    runner = _runner(monkeypatch, WindowedModel, _config(3, num_blocks=8))
    assert runner.cache_specs == [FullAttentionSpec(2, 8, F32), SlidingWindowSpec(2, 8, F32, 6),
                                  FullAttentionSpec(2, 8, F32)]
    assert runner.kv_layout.windows == [None, 6]


def test_default_specs_without_attention_modules_are_full_from_config(monkeypatch):
    class Bare(nn.Module):
        def __init__(self, mc, quant_config=None):
            super().__init__()

        def init_dummy_weights(self, seed):
            pass

    runner = _runner(monkeypatch, Bare, _config(2, num_blocks=8))
    assert runner.cache_specs == [FullAttentionSpec(2, 8, F32)] * 2


def _step(runner):
    kv = KVCacheManager.from_layout(runner.kv_layout)
    cont = Sequence(0, "a", list(range(1, 11)), SamplingParams())
    kv.allocate(cont, 10)
    kv.assign_state_slot(cont)
    cont.num_computed_tokens = 6  # a continuing chunk
    new = Sequence(1, "b", [3, 4, 5], SamplingParams())
    kv.allocate(new, 3)
    kv.assign_state_slot(new)
    out = SchedulerOutput(1, [ScheduledSeq(cont, 4, True), ScheduledSeq(new, 3, True)])
    return build_step_input(out, 8, runner.kv_layout.windows), cont, new


def test_fresh_state_slots_are_zeroed_before_the_forward(monkeypatch):
    runner = _runner(monkeypatch, SpecModel, _config(4, num_blocks=8))
    for t in runner.kv_caches[3]:
        t.fill_(5.0)
    step, cont, new = _step(runner)
    runner.execute(step)
    meta, (states,) = runner.model.calls[-1]
    assert meta.state_slots.tolist() == [cont.state_slot, new.state_slot]
    assert meta.has_initial_state.tolist() == [True, False]
    assert meta.view(8).sliding_window == 8 and meta.view(None) is meta
    for t in states:
        assert torch.all(t[new.state_slot] == 0)  # fresh: zeroed
        assert torch.all(t[cont.state_slot] == 5)  # continuing: kept
        others = [s for s in range(4) if s not in (cont.state_slot, new.state_slot)]
        assert torch.all(t[others] == 5)  # nobody else's slot touched


def test_runner_rejects_steps_that_do_not_fit_its_cache(monkeypatch):
    runner = _runner(monkeypatch, SpecModel, _config(4, num_blocks=8))
    step, _, _ = _step(runner)
    step.kv_group_windows = np.array([0, 9], np.int32)
    with pytest.raises(StepInputError, match="KV groups"):
        runner.execute(step)
    step, _, _ = _step(runner)
    step.state_slots = np.array([0, 4], np.int32)
    with pytest.raises(StepInputError, match="state slot"):
        runner.execute(step)
