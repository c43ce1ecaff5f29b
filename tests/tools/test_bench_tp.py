"""tools/bench_tp.py's parts that need no GPU: the agreement of greedy outputs across TP
sizes (identical, a divergence between tokens in each other's top 5, or a problem) and
its arguments; the whole tool at TP=1 and TP=2 on CPU ranks. The probe against a real
server alone is in test_bench_serving.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import bench_tp

ROOT = Path(__file__).resolve().parents[2]


def _out(tokens, tops):
    return {"tokens": tokens, "top": tops}


def test_compare_greedy_identical_top5_and_problems():
    t = {"a": -0.1, "b": -0.2, "c": -3.0}
    base = [_out(["a", "b"], [t, t]), _out(["a", "b"], [t, t]), _out(["a", "c"], [t, t]),
            _out(["a", "b"], [t, t])]
    other = [_out(["a", "b"], [t, t]),                        # identical
             _out(["b", "a"], [{"b": -0.1, "a": -0.12}, t]),  # near tie: in each other's top 5
             _out(["a", "x"], [t, {"x": -0.1, "q": -1.0}]),   # "c" not in other's top 5
             _out(["a"], [t])]                                # shorter
    res = bench_tp.compare_greedy(base, other)
    assert res["identical"] == 1 and res["diverged_in_top5"] == 1 and not res["agrees"]
    assert len(res["problems"]) == 2 and "token 1" in res["problems"][0]
    assert "lengths" in res["problems"][1]
    d = res["divergences"][0]
    assert (d["prompt"], d["position"], d["base_token"], d["other_token"]) == (1, 0, "a", "b")
    assert d["base_logprobs"] == [-0.1, -0.2] and d["other_logprobs"] == [-0.12, -0.1]
    assert d["base_token_in_other"] == {"rank": 2, "below_best": 0.02}
    assert bench_tp.compare_greedy(base[:1], other[:1])["agrees"]
    # Six near-equal candidates: the base token ranks 6th on the other side, 0.05 nats
    # below its best: a problem under the top-5 rule, with its standing reported.
    wide = {f"t{j}": -1.0 - 0.01 * j for j in range(6)}
    res = bench_tp.compare_greedy([_out(["t5"], [dict(wide, t5=-0.9)])], [_out(["t0"], [wide])])
    assert not res["agrees"] and res["divergences"][0]["base_token_in_other"] == {
        "rank": 6, "below_best": 0.05}
    assert "ranks 6 / 2" in res["problems"][0]
    assert not bench_tp.compare_greedy(base[:2], other[:1])["agrees"]


def test_arguments_and_fixed_prompts():
    args = bench_tp.parse_args(["--isq", "q4k", "--agree-prompts", "0"])
    assert args.isq == "q4k" and args.agree_prompts == 0 and args.agree_tokens == 32
    assert bench_tp.parse_args([]).isq is None
    a, b = bench_tp.agreement_prompts(4, vocab=500), bench_tp.agreement_prompts(4, vocab=500)
    assert a == b and len(a) == 4 and all(0 <= t < 500 for p in a for t in p)


def test_random_weights_are_one_model_at_every_size(tmp_path):
    """The written weights do not depend on where or how often they are drawn: two
    writes give the same bytes (a TP=2 rank and TP=1 load the same model from them)."""
    import bench_model as bm

    cfg = bm.build_config(tiny=True)
    a, b = tmp_path / "a", tmp_path / "b"
    for folder in (a, b):
        bm.write_model_folder(folder, cfg)
        bm.write_random_weights(folder, shard_bytes=40_000)  # several shards
    files = sorted(p.name for p in a.glob("*.safetensors"))
    assert len(files) > 1 and files == sorted(p.name for p in b.glob("*.safetensors"))
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    index = json.loads((a / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.mlp.down_proj.weight" in index and "lm_head.weight" in index


@pytest.mark.slow
@pytest.mark.mpi
def test_tp2_serves_the_tp1_model(tmp_path):
    """The tool end to end on CPU ranks (f32, Q8_0 in-situ): TP=2 gives TP=1's greedy
    tokens exactly. With ``--load-format dummy`` each rank drew its own shard, so a TP=2
    server ran another model (2 x H200, --isq q4k: no prompt agreed, and every top
    log-probability came twice, half a vocabulary apart): the tool now loads seeded
    safetensors at every size."""
    import bench_model as bm

    from tests.distributed.tp_helpers import free_port

    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(bm.build_config(tiny=True)))
    out = tmp_path / "tp.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_tp.py"), "--cpu", "--config", str(cfg),
         "--tp", "1,2", "--input-len", "8", "--output-len", "8", "--batch1-requests", "1",
         "--batch64-requests", "4", "--agree-prompts", "3", "--agree-tokens", "8",
         "--isq", "q8_0", "--port", str(free_port()), "--model-dir", str(tmp_path / "m"),
         "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=str(ROOT),
        env=dict(os.environ, PYTHONPATH=str(ROOT), CVLLM_NO_PROGRESS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    tp1, tp2 = json.loads(out.read_text())["runs"]
    assert "error" not in tp1 and "error" not in tp2, (tp1, tp2)
    assert tp2["agreement"]["agrees"] and tp2["agreement"]["identical"] == 3, tp2["agreement"]
    assert tp1["all_full_length"] and tp2["all_full_length"]
    for run in (tp1, tp2):  # the concurrency-64 round says where its time went
        assert run["batch64_output_tokens_per_s"] > 0 and run["batch64_duration_s"] > 0
        assert 0 < run["batch64_ttft_ms"]["p50"] <= run["batch64_duration_s"] * 1000
        counters = run["batch64_server"]  # and what the server says of it
        assert counters["kv_blocks_total"] > 0 and counters["preemptions_total"] == 0
        assert counters["generation_tokens_total"] >= 5 * 8, counters  # b1 + 4 requests
        assert any(n.startswith("KV cache:") for n in run["startup_notes"]), run["startup_notes"]


def test_a_run_that_went_wrong_keeps_its_logs():
    """The servers' logs are removed after a clean round only: an error, a failed or short
    request, or outputs that part from TP=1 outside the top 5 keep them."""
    ok = {"tp": 2, "failed": 0, "all_full_length": True, "agreement": {"agrees": True}}
    assert not bench_tp._went_wrong(ok) and not bench_tp._went_wrong({"tp": 1})
    for bad in ({"error": "boom"}, {"failed": 1}, {"all_full_length": False},
                {"agreement": {"agrees": False}}):
        assert bench_tp._went_wrong(dict(ok, **bad)), bad
