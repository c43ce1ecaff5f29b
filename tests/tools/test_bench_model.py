"""The arithmetic behind tools/bench.py's ceilings, and its measuring helpers, on the CPU."""

from types import SimpleNamespace

import pytest

import bench_hf_peer
import bench_measure
import bench_model as bm


@pytest.fixture(scope="module")
def llama8b():
    cfg = bm.build_config()
    return cfg, bm.model_costs(bench_measure.meta_model(cfg, 2), cfg)


def test_8b_shape_counts_like_llama31(llama8b):
    cfg, costs = llama8b
    assert cfg["rope_scaling"]["rope_type"] == "llama3"
    assert costs["params"] == 8_030_261_248  # Meta-Llama-3.1-8B
    assert costs["param_bytes"] == 2 * costs["params"]
    embed = 128256 * 4096
    # A decode step reads every weight but the untied input embedding table.
    assert costs["weight_bytes_per_step"] == 2 * (costs["params"] - embed)
    assert costs["matmul_params"] == costs["params"] - 2 * embed - (32 * 2 + 1) * 4096
    assert bm.kv_bytes_per_token_from_config(cfg, 2) == 2 * 32 * 8 * 128 * 2


def test_tied_embedding_counts_once():
    cfg = bm.build_config(tiny=True, overrides={"tie_word_embeddings": True})
    costs = bm.model_costs(bench_measure.meta_model(cfg, 4), cfg)
    untied = bm.model_costs(bench_measure.meta_model(bm.build_config(tiny=True), 4),
                            bm.build_config(tiny=True))
    table = cfg["vocab_size"] * cfg["hidden_size"]
    assert costs["params"] == untied["params"] - table
    assert costs["weight_bytes_per_step"] == untied["weight_bytes_per_step"]  # LM head reads it


def test_shape_flags_recompute_head_dim():
    cfg = bm.build_config(overrides={"hidden_size": 1024, "num_attention_heads": 16})
    assert cfg["head_dim"] == 64
    cfg = bm.build_config(overrides={"hidden_size": 1024, "head_dim": 128})
    assert cfg["head_dim"] == 128


def test_prefill_flops():
    cfg = {"num_attention_heads": 2, "head_dim": 4, "hidden_size": 8, "num_hidden_layers": 3}
    costs = {"matmul_params": 100, "lm_head_params": 10}
    # linear 2*100*(2*5) + LM head 2*10*2 + attention 2*3*2*4*5*6*2
    assert bm.prefill_flops(costs, cfg, 2, 5) == 2000 + 40 + 2880


def test_decode_roofline():
    r = bm.decode_roofline(weight_bytes=1000, kv_bytes_per_token=10, steps=4, kv_tokens_read=20,
                           seconds=2.0, bandwidth_bps=3000.0)
    assert r["bytes_per_step"] == 1050
    assert r["fraction_of_roofline"] == pytest.approx(4200 / 2 / 3000)
    assert r["weights_only_fraction"] == pytest.approx(4000 / 2 / 3000)


def _out(rid, n, finished=False):
    return SimpleNamespace(request_id=rid, delta_token_ids=[7] * n, finished=finished)


def test_decode_window_times_only_full_decode_steps():
    win = bench_measure.DecodeWindow(["a", "b"], prompt_len=10)
    assert not win.add([_out("a", 1)], now=1.0, dt=1.0)  # b still prefilling
    assert not win.add([_out("a", 1), _out("b", 1)], now=2.0, dt=1.0)  # all started: t0
    assert win.t0 == 2.0 and win.tokens == 0
    assert not win.add([_out("a", 1), _out("b", 1)], now=3.0, dt=1.0)
    assert win.add([_out("a", 1, True), _out("b", 1)], now=4.0, dt=1.0)  # a done: window ends
    assert (win.t1, win.tokens, win.steps) == (4.0, 4, 2)
    # a's tokens 3, 4 attended over 12, 13 positions; b's 2, 3 over 11, 12
    assert win.kv_tokens == 12 + 13 + 11 + 12


def test_hf_decode_window():
    outs = [SimpleNamespace(timestamps=[1.0, 2.0, 3.0, 4.0], generated_tokens=[1] * 4),
            SimpleNamespace(timestamps=[1.5, 2.5, 3.5, 4.5], generated_tokens=[1] * 4)]
    r = bench_hf_peer.decode_window(outs, tokens=4)
    assert r["all_full_length"] and r["decode_window_s"] == 2.5  # 1.5 .. 4.0
    assert r["decode_tokens"] == 3 + 2  # (2, 3, 4] and (2.5, 3.5]
    assert r["tokens_per_s"] == pytest.approx(5 / 2.5)


def test_model_folder_tokenizer_covers_the_vocabulary(tmp_path):
    from transformers import AutoTokenizer

    cfg = bm.build_config(tiny=True)
    bm.write_model_folder(tmp_path, cfg)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(tok) == cfg["vocab_size"]
    assert tok.decode([5, 511]) == "t5 t511"
    assert tok.encode("t3 t4", add_special_tokens=False) == [3, 4]
    assert tok.eos_token_id == cfg["eos_token_id"]


def test_device_slug():
    import bench

    assert bench.device_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert bench.device_slug("NVIDIA H200") == "h200"


def test_best_ceiling_fraction():
    """A decode row's fraction against the higher of the run's two copy rates."""
    import bench

    data = {"ceilings": {"copy_bytes_per_s": 4.0e12}, "ceilings_end": {"copy_bytes_per_s": 4.2e12},
            "decode": [{"batch": 1, "fraction_of_roofline": 0.6}, {"batch": 64}]}
    bench.best_ceiling_fractions(data)
    assert abs(data["decode"][0]["fraction_of_best_roofline"] - 0.6 * 4.0 / 4.2) < 1e-12
    assert "fraction_of_best_roofline" not in data["decode"][1]
    data["ceilings_end"] = {"copy_bytes_per_s": 3.9e12}  # slower at the end: the start's
    bench.best_ceiling_fractions(data)
    assert data["decode"][0]["fraction_of_best_roofline"] == 0.6
    data.pop("ceilings_end")
    data["decode"][0].pop("fraction_of_best_roofline")
    bench.best_ceiling_fractions(data)  # the end's not measured: nothing to compare
    assert "fraction_of_best_roofline" not in data["decode"][0]
