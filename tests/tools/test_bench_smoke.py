"""tools/bench.py end to end in its tiny CPU mode: the engine phases, the ceilings, the
transformers peer in its child process, and the JSON report's fields."""

import json
import os
import subprocess
import sys

import pytest

from .conftest import TOOLS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "tiny.json"
    env = dict(os.environ, CVLLM_NO_PROGRESS="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(TOOLS / "bench.py"), "--tiny", "--cpu", "--no-plot",
                           "--out", str(out)], capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "report ->" in proc.stdout
    return json.loads(out.read_text())


def test_header(report):
    assert report["schema"] == "cvllm-bench/1" and report["mode"] == "tiny"
    assert report["command"].startswith("python tools/bench.py --tiny")
    assert report["device"]["kind"] == "cpu" and report["device"]["name"]
    assert report["versions"]["torch"] and report["versions"]["transformers"]
    assert report["config"]["architectures"] == ["LlamaForCausalLM"]
    assert report["errors"] == [] and report["skipped"] == []


def test_ceilings_and_model_facts(report):
    for key in ("ceilings", "ceilings_end"):
        assert report[key]["copy_GBps"] > 0 and report[key]["matmul_TFLOPs"] > 0
    model = report["model"]
    assert model["kv_bytes_per_token_source"] == "allocated cache"
    assert model["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # K+V, 2 layers, 2 heads, f32
    assert 0 < model["weight_bytes_per_step"] < model["param_bytes"]
    assert report["engine_options"]["load_format"] == "dummy"


def test_decode_figures(report):
    work = report["workload"]
    rows = {r["batch"]: r for r in report["decode"]}
    assert sorted(rows) == [1, 2, 4]
    for batch, r in rows.items():
        assert not r["truncated"] and r["preemptions"] == 0
        assert r["decode_tokens"] == batch * r["decode_steps"]
        # Window: after every sequence's first token, up to the first one that finishes.
        assert work["decode_tokens"] - 3 <= r["decode_steps"] <= work["decode_tokens"] - 1
        assert r["tokens_per_s"] > 0 and 0 < r["fraction_of_roofline"] < 1
        assert r["roofline_tokens_per_s"] > r["tokens_per_s"]


def test_prefill_figures(report):
    rows = report["prefill"]
    assert [r["num_prompts"] for r in rows] == [1, 2]
    for r in rows:
        assert r["prompt_len"] == report["workload"]["prefill_len"]
        assert r["tokens_per_s"] > 0 and 0 < r["fraction_of_matmul"] < 1
        assert r["flops"] > 2 * report["model"]["matmul_params"] * r["prompt_len"]


def test_hf_peer_and_targets(report):
    peer = report["hf_peer"]
    assert "error" not in peer, peer
    assert "sdpa" in peer["attn_implementation"]
    (row,) = peer["results"]
    assert row["batch"] == 4 and row["all_full_length"] and row["tokens_per_s"] > 0
    vs = report["vs_hf_peer"]["4"]
    assert vs["same_workload"] and vs["ratio"] > 0
    assert set(report["targets"]) == {
        "batch1_decode_fraction_of_roofline>=0.85", "batch64_decode_fraction_of_roofline>=0.70",
        "prefill_fraction_of_matmul>=0.50", "batch64_vs_hf_peer>=3"}


def test_plot_from_the_report(report, tmp_path):
    pytest.importorskip("matplotlib")
    import bench_plot

    png = tmp_path / "plot.png"
    assert bench_plot.plot(report, png) is None
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
