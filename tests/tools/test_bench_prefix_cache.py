"""tools/bench_prefix_cache.py in a short CPU run on the default model: the second
request of a round takes the first one's full blocks and reports the numbers."""

import json

import pytest

import bench_prefix_cache  # tools/, on sys.path through conftest

pytestmark = pytest.mark.slow


def test_short_run_reports_a_hit(tmp_path, default_gguf):
    out = tmp_path / "pc.json"
    summary = bench_prefix_cache.main(["--f", str(default_gguf), "--prefix-len", "100",
                                       "--suffix-len", "8", "--max-tokens", "2", "--rounds", "1",
                                       "--max-model-len", "256", "--out", str(out)])
    (row,) = summary["rounds"]
    assert row["cold"]["cached_tokens"] == 0 and row["hit"]["cached_tokens"] == 96
    assert row["cold"]["ttft_s"] > 0 and row["hit"]["ttft_s"] > 0
    assert summary["prefix_cache_hits_total"] >= 96
    assert json.loads(out.read_text())["prefix_len"] == 100
