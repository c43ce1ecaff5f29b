"""tools/bench_fairness.py in a short CPU run on the default model: the long prompt, the
decoding stream and the short request all report their numbers."""

import json

import pytest

import bench_fairness  # tools/, on sys.path through conftest

pytestmark = pytest.mark.slow


def test_short_run_reports_gap_and_ttft(tmp_path, default_gguf):
    out = tmp_path / "fair.json"
    summary = bench_fairness.main(["--f", str(default_gguf), "--long-prompt", "300",
                                   "--max-num-batched-tokens", "64", "--short-delay", "0",
                                   "--max-model-len", "512", "--out", str(out)])
    assert summary["max_num_batched_tokens"] == 64 and summary["overlap"] is False
    assert summary["stream_tokens_during_prefill"] >= 300 // 64
    assert 0 < summary["stream_max_gap_s"] and 0 < summary["short_ttft_s"]
    assert summary["short_ttft_s"] < summary["long_ttft_s"]
    assert json.loads(out.read_text())["long_prompt"] == 300
