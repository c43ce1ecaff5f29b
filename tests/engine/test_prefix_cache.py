"""Prefix caching through the engine on a tiny random Llama: ``num_cached_tokens`` on the
request outputs and the metrics counters, the flags (``--disable-prefix-cache``,
``--prefix-cache-max-tokens``), the FP8 cache (blocks reused with their scales), and
models with state layers running without it (one log line)."""

import logging

import pytest

from cvllm.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from cvllm.core.kv_cache_manager import KVCacheGroupConfig, KVCacheLayout
from cvllm.engine.llm import LLM
from cvllm.engine.llm_engine import LLMEngine
from cvllm.sampling_params import SamplingParams
from tests.distributed.tp_helpers import save_tiny_llama
from tests.models.family_harness import check_prefix_cache

BS = 8
SHARED = [(5 * i + 3) % 250 for i in range(40)]  # 5 full blocks


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("prefix_llama"))


def _llm(folder, **kw):
    return LLM(weight_path=str(folder), cpu=True, dtype="f32", max_model_len=128,
               kvcache_mem_mb=4, block_size=BS, **kw)


def _run(engine, request_id, prompt, max_tokens=3):
    """One request to the end; its outputs."""
    engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                          ignore_eos=True))
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == request_id]
    assert outs[-1].finished
    return outs


def test_cached_tokens_reach_the_outputs_and_the_metrics(tiny):
    engine = _llm(tiny).engine
    first = _run(engine, "a", SHARED + [1, 2, 3])
    assert all(o.num_cached_tokens == 0 for o in first)
    second = _run(engine, "b", SHARED[:36] + [9, 9])  # shares 4 full blocks
    assert {o.num_cached_tokens for o in second} == {32}
    again = _run(engine, "c", SHARED + [1, 2, 3])  # 43 tokens: 5 blocks cached
    assert again[-1].num_cached_tokens == 40
    assert [o.delta_token_ids for o in again] == [o.delta_token_ids for o in first]
    m = engine.metrics()
    assert m.prefix_cache_queries_total == 43 + 38 + 43
    assert m.prefix_cache_hits_total == 32 + 40
    assert m.kv_blocks_cached > 0 and m.kv_blocks_free == m.kv_blocks_total


def test_flags_turn_it_off_or_cap_it(tiny):
    off = _llm(tiny, disable_prefix_cache=True).engine
    assert not off.kv_cache_manager.enable_caching
    _run(off, "a", SHARED)
    assert _run(off, "b", SHARED)[-1].num_cached_tokens == 0
    assert off.metrics().prefix_cache_queries_total == 0
    capped = _llm(tiny, prefix_cache_max_tokens=2 * BS).engine
    _run(capped, "a", SHARED + [1])
    assert capped.metrics().kv_blocks_cached == 2
    # Blocks are released tail first and the cap keeps the most recent: the head ones.
    assert _run(capped, "b", SHARED + [1])[-1].num_cached_tokens == 2 * BS


def test_fp8_cache_reuses_blocks_with_their_scales(tiny):
    check_prefix_cache(tiny, fp8_kvcache=True)


def test_models_with_state_layers_run_without_it(caplog):
    hf = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=256)
    config = EngineConfig(ModelConfig("Qwen3NextForCausalLM", hf), CacheConfig(),
                          SchedulerConfig(), DeviceConfig())
    hybrid = KVCacheLayout(16, (KVCacheGroupConfig(None, 64),), num_state_slots=4)
    with caplog.at_level(logging.INFO, logger="cvllm.engine"):
        assert not LLMEngine._prefix_caching(config, hybrid)
    assert "prefix caching is off for Qwen3NextForCausalLM" in caplog.text
    assert LLMEngine._prefix_caching(config, KVCacheLayout.single(64, 16))
