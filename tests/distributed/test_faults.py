"""Faults of a 2-rank job (tiny Llama, CPU, gloo): a worker killed mid-generation turns
``/health`` 503 within 10 s and ends every process within 30 s; an exception on rank 1
(``CVLLM_FAULT_INJECT``) ends the job under spawn and under mpirun instead of hanging;
SIGTERM on rank 0 drains the request in flight (new ones get 503), then every rank
exits 0."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest
import requests

from tests.distributed.tp_helpers import (
    CVLLM, COMMON, Server, generate_args, mpi_env, mpirun_cmd, run_generate, save_tiny_llama,
    stream_completion, wait_gone, TINY_PROMPTS,
)

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def _serve_args(model):
    return ["--w", str(model), "--d", "0,1", *COMMON]


def _stream(base: str, max_tokens: int, out: dict) -> None:
    """One streaming completion; records the chunks' finish reason and any error."""
    body = {"prompt": TINY_PROMPTS[0], "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True}}
    stream_completion(base, body, out)


def _wait_chunks(out: dict, n: int, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while out.get("chunks", 0) < n and "error" not in out and time.time() < deadline:
        time.sleep(0.01)
    assert out.get("chunks", 0) >= n, out


def test_killed_worker_turns_health_503_then_everything_exits(tiny_llama, tmp_path):
    server = Server(CVLLM, _serve_args(tiny_llama), tmp_path / "serve.log")
    try:
        server.wait_healthy()
        pids = [server.proc.pid, *server.descendants()]
        workers = server.workers()
        assert len(workers) == 1 and len(pids) == 3, (workers, pids)  # + the API process
        out: dict = {}
        t = threading.Thread(target=_stream, args=(server.base, 110, out), daemon=True)
        t.start()
        _wait_chunks(out, 2)
        os.kill(workers[0], signal.SIGKILL)
        killed = time.time()
        status = None
        while time.time() - killed < 10:
            status = server.health()
            if status == 503:
                break
            time.sleep(0.1)
        assert status == 503, f"/health answered {status} 10 s after the kill\n{server.text()}"
        left = wait_gone(pids, 30 - (time.time() - killed))
        assert not left, f"still running 30 s after the kill: {left}\n{server.text()}"
        assert server.proc.wait(5) != 0
        # The whole log, not its tail: tracebacks after the death can fill the tail. The
        # final message names the dead rank whichever failure rank 0 noticed first.
        full = server.log.read_text(errors="replace")
        ending = [line for line in full.splitlines() if "ending the job:" in line]
        assert ending and "rank 1" in ending[-1], ending or server.text()
    finally:
        server.stop()


def test_sigterm_drains_then_stops_every_rank(tiny_llama, tmp_path):
    server = Server(CVLLM, _serve_args(tiny_llama), tmp_path / "serve.log")
    try:
        server.wait_healthy()
        pids = [server.proc.pid, *server.descendants()]
        out: dict = {}
        t = threading.Thread(target=_stream, args=(server.base, 110, out), daemon=True)
        t.start()
        _wait_chunks(out, 2)
        server.proc.send_signal(signal.SIGTERM)
        refused = None
        for _ in range(50):  # while the stream runs: /health and new requests get 503
            refused = requests.post(server.base + "/v1/completions", timeout=10, json={
                "prompt": "12", "max_tokens": 2}).status_code
            if refused == 503 or not t.is_alive():
                break
            time.sleep(0.02)
        t.join(60)
        assert refused == 503, f"a new request during the drain got {refused}"
        assert out.get("finish_reason") == "length" and out.get("completion_tokens") == 110, out
        assert not wait_gone(pids, 30), server.text()
        assert server.proc.wait(5) == 0, server.text()
        log = server.log.read_text(errors="replace")  # whole: exit noise can fill the tail
        # The stream, and maybe the first new request: rank 0 passes the signal on to the
        # API process, and a request sent right after it can arrive there first.
        assert re.search(r"draining [12] request", log), log[-3000:]
        assert "SHUTDOWN" in log
    finally:
        server.stop()


def _check_fault_ends_job(proc, started: float, rank: int = 1) -> None:
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert time.time() - started < 60
    assert f"fault injected on rank {rank} at step 3" in proc.stderr, proc.stderr[-3000:]


def test_exception_on_rank1_ends_spawned_job(tiny_llama):
    started = time.time()
    proc = run_generate(CVLLM, generate_args(["--w", str(tiny_llama), "--d", "0,1"],
                                             TINY_PROMPTS, 12),
                        timeout=90, env=mpi_env({"CVLLM_FAULT_INJECT": "rank=1,step=3"}))
    _check_fault_ends_job(proc, started)


def test_exception_on_rank1_ends_mpirun_job(tiny_llama):
    started = time.time()
    proc = run_generate(mpirun_cmd(2), generate_args(["--w", str(tiny_llama)], TINY_PROMPTS, 12),
                        timeout=90, env=mpi_env({"CVLLM_FAULT_INJECT": "rank=1,step=3"}))
    _check_fault_ends_job(proc, started)


@pytest.mark.parametrize("launcher", ["spawn", "mpirun"])
def test_exception_on_rank0_ends_job(tiny_llama, launcher):
    """Rank 0's own step failure (it broadcasts, then fails) ends every rank too."""
    started = time.time()
    env = mpi_env({"CVLLM_FAULT_INJECT": "rank=0,step=3"})
    if launcher == "spawn":
        proc = run_generate(CVLLM, generate_args(["--w", str(tiny_llama), "--d", "0,1"],
                                                 TINY_PROMPTS, 12), timeout=90, env=env)
    else:
        proc = run_generate(mpirun_cmd(2), generate_args(["--w", str(tiny_llama)],
                                                         TINY_PROMPTS, 12), timeout=90, env=env)
    _check_fault_ends_job(proc, started, rank=0)
