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


def test_a_lone_hit_is_copied_and_read_in_place(tiny, monkeypatch):
    """On the CPU a sequence admitted alone takes its hit as copies in consecutive blocks
    (``copy_prefix_hits``): its decode steps attend over views of the cache, never a
    gather, and its tokens and log-probabilities are those of the shared hit and of no
    cache at all (float32, the same kernels on the same values: equal to 1e-6)."""
    import cvllm.attention.backends.torch_ref as torch_ref

    gathers = []
    real_gather = torch_ref._gather_rows
    monkeypatch.setattr(torch_ref, "_gather_rows",
                        lambda *a, **k: gathers.append(1) or real_gather(*a, **k))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    runs = {}
    for name, kw in (("copy", {}), ("share", {}), ("none", {"disable_prefix_cache": True})):
        engine = _llm(tiny, **kw).engine
        if name == "share":
            engine.scheduler.config.copy_prefix_hits = False
        assert engine.scheduler.config.copy_prefix_hits == (name != "share")  # the CPU's
        _run(engine, "warm", SHARED + [1, 2])
        engine.add_request("x", SHARED + [4, 5, 6], params)
        copies, outs = [], []
        while engine.has_unfinished():
            before = len(gathers)
            outs += engine.step()
            seq = next(iter(engine.scheduler.running), None)
            if seq is not None and seq.num_computed_tokens > len(SHARED) + 3:
                copies.append((list(seq.group_block_ids(0)), len(gathers) - before))
        runs[name] = outs
        if name == "copy":
            ids, _ = copies[-1]
            assert ids == list(range(ids[0], ids[0] + len(ids)))  # consecutive
            assert all(n == 0 for _, n in copies)  # decodes read the cache in place
            assert engine.metrics().prefix_cache_hits_total == len(SHARED)
            m = engine.metrics()
            assert m.kv_blocks_free == m.kv_blocks_total
        if name == "share":
            assert any(n > 0 for _, n in copies)  # the shared hit's blocks are gathered
    final = {k: v[-1] for k, v in runs.items()}
    assert final["copy"].num_cached_tokens == final["share"].num_cached_tokens == len(SHARED)
    ids = {k: [t for o in v if o.request_id == "x" for t in o.delta_token_ids]
           for k, v in runs.items()}
    assert ids["copy"] == ids["share"] == ids["none"]
    lps = {k: [lp for o in v if o.request_id == "x" for lp in o.logprobs]
           for k, v in runs.items()}
    assert len(lps["copy"]) == 6
    for other in ("share", "none"):
        assert len(lps[other]) == 6
        for a, b in zip(lps["copy"], lps[other]):
            assert a.token_id == b.token_id and a.top_ids.keys() == b.top_ids.keys()
            assert abs(a.logprob - b.logprob) < 1e-6
            assert all(abs(a.top_ids[t] - b.top_ids[t]) < 1e-6 for t in a.top_ids)


def test_the_runner_refuses_copies_outside_its_cache(tiny):
    import numpy as np

    from cvllm.core.step_input import StepInput
    from cvllm.core.wire_format import StepInputError

    runner = _llm(tiny).engine.runner
    for bad in ([[0, runner.num_blocks]], [[-1, 2]]):
        step = StepInput.empty(1)
        step.block_copies = np.asarray(bad, np.int32)
        with pytest.raises(StepInputError, match="copies a block outside"):
            runner.execute(step)
