"""tools/bench_measure.py's phases on a real tiny engine (CPU, random weights): the decode
window, the time limits, and an engine left empty after each phase."""

import time

import numpy as np
import pytest

import bench_measure as bmeas
import bench_model as bm


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from cvllm.engine.llm import LLM

    cfg = bm.build_config(tiny=True)
    folder = bm.write_model_folder(tmp_path_factory.mktemp("tiny"), cfg)
    llm = LLM(weight_path=str(folder), load_format="dummy", cpu=True, max_model_len=2048,
              max_num_seqs=8, kvcache_mem_mb=16)
    return llm.engine


def test_decode_phase_counts_the_window(engine):
    rng = np.random.default_rng(0)
    res = bmeas.run_decode(engine, 3, 8, 10, rng, 512, timeout=60, tag="t")
    assert not res["truncated"] and res["preemptions"] == 0
    assert res["decode_steps"] == 9 and res["decode_tokens"] == 27  # tokens 2..10 of 3 seqs
    assert res["kv_tokens_read"] == 3 * sum(8 + j - 1 for j in range(2, 11))
    assert res["tokens_per_s"] > 0
    assert not engine.has_unfinished()


def test_decode_phase_stops_at_its_limit(engine, monkeypatch):
    step = engine.step

    def slow_step():  # 1900 steps now take >= 9.5 s: the 1 s limit must cut them
        time.sleep(0.005)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)
    rng = np.random.default_rng(1)
    res = bmeas.run_decode(engine, 2, 8, 1900, rng, 512, timeout=1.0, tag="cut")
    assert res["truncated"] and 0 < res["decode_steps"] < 1899
    assert res["decode_tokens"] == 2 * res["decode_steps"]
    assert not engine.has_unfinished()  # the rest was aborted


def test_prefill_phase_times_out_cleanly(engine):
    rng = np.random.default_rng(2)
    assert bmeas.run_prefill(engine, 2, 64, rng, 512, timeout=60, tag="p") > 0
    with pytest.raises(TimeoutError):
        bmeas.run_prefill(engine, 8, 1500, rng, 512, timeout=0.0, tag="slow")
    assert not engine.has_unfinished()


def test_engine_facts_read_the_engine(engine):
    llm = type("L", (), {"engine": engine})()
    facts = bmeas.engine_facts(llm, bm.build_config(tiny=True), 4)
    assert facts["kv_bytes_per_token"] == 512
    assert facts["kv_bytes_per_token_source"] == "allocated cache"
    assert facts["attention_backends"] == ["torch_ref"]
