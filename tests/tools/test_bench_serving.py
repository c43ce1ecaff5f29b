"""tools/bench_serving.py against a real ``cvllm serve`` (CPU, a tiny Llama with random
weights from tools/bench_model.py's folder writer): counts, token totals and latencies."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

import bench_model as bm
import bench_serving

from .conftest import TOOLS

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = bm.write_model_folder(tmp_path_factory.mktemp("tiny-llama"), bm.build_config(tiny=True))
    port = _free_port()
    log = folder / "serve.log"
    env = dict(os.environ, CVLLM_NO_PROGRESS="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "cvllm", "serve", "--w", str(folder), "--load-format", "dummy",
           "--cpu", "--port", str(port), "--max-model-len", "256", "--mem", "32"]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited early:\n{log.read_text()}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                pytest.fail(f"server never became healthy:\n{log.read_text()}")
            time.sleep(0.3)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _bench(base, tmp_path, *extra):
    out = tmp_path / "serving.json"
    cmd = [sys.executable, str(TOOLS / "bench_serving.py"), "--base-url", base, "--out", str(out),
           "--timeout", "120", "--request-timeout", "60", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text())


def test_token_prompts_fixed_lengths(server, tmp_path):
    rep = _bench(server, tmp_path, "--num-requests", "8", "--concurrency", "4", "--input-len", "32",
                 "--output-len", "16", "--token-range", "3,500", "--per-request")
    assert (rep["num_requests"], rep["completed"], rep["failed"]) == (8, 8, 0)
    assert rep["errors"] == {}
    assert rep["total_prompt_tokens"] == 8 * 32
    assert rep["total_output_tokens"] == 8 * 16 and rep["all_full_length"]
    assert rep["request_throughput"] > 0 and rep["output_throughput"] > 0
    for r in rep["requests"]:
        assert r["ok"] and r["output_tokens"] == 16 and r["finish_reason"] == "length"
        assert 0 < r["ttft_s"] <= r["latency_s"]
        assert len(r["itl_s"]) == r["text_chunks"] - 1
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "latency_ms"):
        p = rep[key]
        assert 0 <= p["p50"] <= p["p90"] <= p["p99"] <= p["max"]
    assert rep["ttft_ms"]["max"] <= rep["latency_ms"]["max"]
    assert rep["ttft_ms"]["p50"] <= rep["latency_ms"]["p50"]


def test_chat_endpoint_text_prompts(server, tmp_path):
    rep = _bench(server, tmp_path, "--endpoint", "chat", "--num-requests", "3", "--concurrency", "2",
                 "--input-len", "8", "--output-len", "5")
    assert rep["completed"] == 3 and rep["total_output_tokens"] == 15
    assert rep["config"]["prompt_kind"] == "text"


def test_refuses_remote_servers_without_allow_remote(capsys):
    with pytest.raises(SystemExit):
        bench_serving.parse_args(["--base-url", "http://10.1.2.3:8000"])
    assert "loopback" in capsys.readouterr().err
    args = bench_serving.parse_args(["--base-url", "http://[::1]:8000"])
    assert args.token_range == (100, 10000)


def test_percentiles():
    p = bench_serving.percentiles([0.001, 0.002, 0.003, 0.004, 0.005])
    assert p["p50"] == pytest.approx(3.0) and p["max"] == pytest.approx(5.0)
    assert p["p90"] == pytest.approx(4.6)
    assert bench_serving.percentiles([])["p50"] is None


def test_random_workload_reports_hit_rates(server, tmp_path):
    rep = _bench(server, tmp_path, "--num-requests", "2", "--concurrency", "1", "--input-len", "8",
                 "--output-len", "2", "--token-range", "3,500")
    assert rep["schema"] == "cvllm-bench-serving/1" and rep["config"]["concurrency"] == 1
    assert rep["config"]["workload"] == "random" and rep["completed"] == 2
    assert 0 <= rep["hit_rate"] <= 1 and rep["total_cached_tokens"] >= 0
    assert rep["prefix_cache_metrics"]["queries"] > 0


def test_multi_turn_sweep_hits_the_prefix_cache(server, tmp_path):
    sweep = _bench(server, tmp_path, "--workload", "multi-turn", "--conversations", "2",
                   "--turns", "3", "--system-tokens", "40", "--user-tokens", "6",
                   "--output-len", "3", "--sweep", "1,2")
    assert sweep["schema"] == "cvllm-bench-serving-sweep/1" and sweep["workload"] == "multi-turn"
    assert [r["concurrency"] for r in sweep["levels"]] == [1, 2]
    for row, rep in zip(sweep["levels"], sweep["reports"]):
        assert (row["completed"], row["failed"]) == (6, 0) and rep["errors"] == {}
        assert row["output_throughput"] > 0
        assert row["ttft_ms_p50"] <= row["ttft_ms_p99"] and row["itl_ms_p50"] <= row["itl_ms_p99"]
        assert 0 < row["hit_rate"] <= 1 and 0 < row["metrics_hit_rate"] <= 1
        turns = rep["turns"]
        assert [t["turn"] for t in turns] == [1, 2, 3]
        # each turn resends the history: prompts grow, and later turns find it cached
        assert turns[0]["prompt_tokens"] < turns[1]["prompt_tokens"] < turns[2]["prompt_tokens"]
        assert all(t["cached_tokens"] > 0 for t in turns[1:])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert sweep["plot"] is None and not (tmp_path / "serving.png").exists()
    else:
        assert sweep["plot"] and (tmp_path / "serving.png").stat().st_size > 0


def test_concurrency_list_is_a_sweep_and_bounds():
    args = bench_serving.parse_args(["--concurrency", "1,4,16"])
    assert args.sweep == [1, 4, 16] and args.concurrency == 1
    args = bench_serving.parse_args(["--workload", "multi-turn"])
    assert args.sweep is None and args.concurrency == 8 and args.endpoint == "chat"
    assert (args.conversations, args.turns, args.system_tokens) == (64, 6, 2048)
    with pytest.raises(SystemExit):
        bench_serving.parse_args(["--sweep", "0,2"])


def test_plot_sweep_without_matplotlib_says_why(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    why = bench_serving.plot_sweep({"levels": [{"concurrency": 1, "completed": 1}]},
                                   tmp_path / "x.png")
    assert "matplotlib is not installed" in why and not (tmp_path / "x.png").exists()


def test_bench_tp_greedy_outputs_through_the_server(server):
    """tools/bench_tp.py's agreement probe: greedy completions of token-id prompts with
    their top-5 log-probabilities, the same twice (greedy is deterministic), compared."""
    import bench_tp

    prompts = bench_tp.agreement_prompts(3, vocab=bm.build_config(tiny=True)["vocab_size"])
    first = bench_tp.greedy_outputs(server, prompts, 6)
    assert len(first) == 3 and all(len(o["tokens"]) == 6 for o in first)
    assert all(len(top) >= 1 and o["tokens"][i] in top
               for o in first for i, top in enumerate(o["top"]))
    res = bench_tp.compare_greedy(first, bench_tp.greedy_outputs(server, prompts, 6))
    assert res["agrees"] and res["identical"] == 3, res
