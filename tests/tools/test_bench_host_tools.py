"""Smoke tests of the serving-path and bitmask benchmarks on the CPU (tiny workloads):
each runs end to end and reports figures that fit together."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools"
ENV = dict(os.environ, PYTHONPATH=str(ROOT), CVLLM_NO_PROGRESS="1")

pytestmark = pytest.mark.slow


def _run(args, timeout=240):
    proc = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True,
                          env=ENV, timeout=timeout, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("api_process", [False, True])
def test_bench_host_breaks_the_step_down(default_gguf, tmp_path, api_process):
    out = tmp_path / "host.json"
    _run([TOOLS / "bench_host.py", "--concurrency", "8", "--output-len", "12",
          "--device-ms", "5", "--out", out] + (["--api-process"] if api_process else []))
    engine, served, ratio = json.loads(out.read_text())["results"]
    for rep in (engine, served):
        assert rep["output_tokens"] == 8 * 12
        assert {"schedule", "launch", "wait_device", "outputs_detokenize"} <= set(
            rep["engine_phase_ms_per_step"])
    cpu = served["thread_cpu_ms_per_step"]
    if api_process:  # the HTTP side's CPU is the API process's, not a thread of this one
        assert {"engine_thread", "api_writer_thread", "api_process"} <= set(cpu)
        assert "event_loop_thread" not in cpu and cpu["api_process"] > 0
    else:
        assert "event_loop_thread" in cpu
    assert served["client"]["completed"] == 8 and served["client"]["failed"] == 0
    assert 0 < ratio["served_over_engine"]


def test_bench_served_compares_the_same_workload(tmp_path):
    sys.path.insert(0, str(TOOLS))
    import bench_model as bm

    from tests.distributed.tp_helpers import free_port

    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(bm.build_config(tiny=True)))
    out = tmp_path / "served.json"
    _run([TOOLS / "bench_served.py", "--config", cfg, "--concurrency", "4", "--input-len", "8",
          "--output-len", "8", "--rounds", "1", "--port", free_port(), "--servers", "api,one",
          "--out", out])
    rep = json.loads(out.read_text())
    assert rep["engine"]["rounds"][0]["output_tokens"] == 4 * 8
    assert set(rep["servers"]) == {"api", "one"}
    assert rep["servers"]["one"]["flags"] == ["--no-api-process"]
    for run in rep["servers"].values():
        best = run["served"]["best"]
        assert best["completed"] == 4 and best["all_full_length"]
        assert run["served_over_engine"] > 0 and 0 < best["client_cpu_fraction"] < 2
    assert rep["served"] == rep["servers"]["api"]["served"]


@pytest.mark.mpi
def test_bench_served_at_tp2(tmp_path):
    """``--tp 2``: the engine alone as a 2-rank SPMD job under torchrun (rank 0 reports),
    served through ``cvllm serve --d 0,1``; CPU ranks here, GPUs 0 and 1 on a GPU machine."""
    sys.path.insert(0, str(TOOLS))
    import bench_model as bm

    from tests.distributed.tp_helpers import free_port

    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(bm.build_config(tiny=True)))
    out = tmp_path / "served.json"
    _run([TOOLS / "bench_served.py", "--cpu", "--tp", "2", "--config", cfg, "--concurrency", "4",
          "--input-len", "8", "--output-len", "8", "--rounds", "1", "--port", free_port(),
          "--out", out])
    rep = json.loads(out.read_text())
    assert rep["tp"] == 2 and rep["device"] == "cpu"
    assert rep["engine"]["rounds"][0]["output_tokens"] == 4 * 8
    assert rep["served"]["best"]["completed"] == 4 and rep["served"]["best"]["all_full_length"]


def test_bench_bitmask_runs_free_and_constrained(default_gguf, tmp_path):
    out = tmp_path / "bitmask.json"
    _run([TOOLS / "bench_bitmask.py", "--batches", "2", "--tokens", "6", "--repeats", "1",
          "--out", out])
    (row,) = json.loads(out.read_text())["rows"]
    assert row["batch"] == 2 and row["free_ms_per_step"] > 0 and row["constrained_ms_per_step"] > 0


def test_bench_ttft_breaks_first_tokens_down(default_gguf, tmp_path):
    out = tmp_path / "ttft.json"
    _run([TOOLS / "bench_ttft.py", "--device-ms", "2", "--eager-ms", "3", "--out", out,
          "--endpoint", "chat", "--workload", "multi-turn", "--conversations", "4", "--turns", "2",
          "--system-tokens", "120", "--user-tokens", "8", "--output-len", "6",
          "--concurrency", "2", "--warmup", "0"])
    (rnd,) = json.loads(out.read_text())["rounds"]
    assert rnd["client"]["completed"] == 8 and rnd["client"]["failed"] == 0
    assert rnd["client"]["hit_rate"] > 0  # turn 2 resends turn 1 and the system prompt
    for phase in ("submit_to_arrive", "arrive_to_scheduled", "scheduled_to_first_out",
                  "first_out_to_yield"):
        assert rnd[phase]["n"] == 8 and rnd[phase]["p50"] >= 0
    whole = rnd["submit_to_first_yield"]
    assert whole["n"] == 8 and whole["max"] <= rnd["client"]["ttft_ms"]["max"] + 1
    assert rnd["step_interval_ms"]["with_prompt_tokens"]["n"] >= 1
