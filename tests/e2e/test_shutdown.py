"""Shutdown on time (issue 14, item 6): real ``cvllm serve`` processes (tiny Llama on the
CPU; 1 rank, and 2 ranks under mpirun) with long streams in flight.

SIGTERM drains for at most ``--shutdown-timeout`` (2 s here), then aborts what is left:
every stream ends with ``finish_reason: "abort"`` and ``data: [DONE]``, a non-streamed
request gets a 503 error body, and every process exits within the timeout plus 5 s. A
second SIGTERM exits within 5 s.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Dict, List

import pytest
import requests

from tests.distributed.tp_helpers import (
    CVLLM, COMMON, Server, mpirun_cmd, stream_completion, wait_gone,
)

pytestmark = pytest.mark.slow

SHUTDOWN_TIMEOUT_S = 2.0
BOUND_S = 5.0
MAX_TOKENS = 3900  # far more than the 2 s of the drain can produce
PROMPT = "12 34 56"


@pytest.fixture(scope="module")
def long_tiny_llama(tmp_path_factory) -> Path:
    """The fault tests' tiny Llama with a 4k context, so a stream can run for seconds."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.models.family_harness import randomize_, save_tiny

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=4096))
    randomize_(hf)
    return save_tiny(hf, tmp_path_factory.mktemp("long_tiny_llama"))


def _args(model: Path, timeout_s: float) -> List[str]:
    common = list(COMMON)
    common[common.index("--max-model-len") + 1] = "4096"
    return ["--w", str(model), *common, "--shutdown-timeout", str(timeout_s)]


def _start(model: Path, tmp_path: Path, timeout_s: float, ranks: int) -> Server:
    prefix = mpirun_cmd(ranks) if ranks > 1 else CVLLM
    server = Server(prefix, _args(model, timeout_s), tmp_path / "serve.log")
    server.wait_healthy()
    return server


def _rank_pids(server: Server, ranks: int) -> List[int]:
    """The rank processes, rank 0 first (mpirun: by OMPI_COMM_WORLD_RANK)."""
    import psutil

    if ranks == 1:
        return [server.proc.pid]
    by_rank: Dict[int, int] = {}
    for pid in server.descendants():
        try:
            rank = psutil.Process(pid).environ().get("OMPI_COMM_WORLD_RANK")
        except psutil.Error:
            continue
        if rank is not None and "cvllm" in " ".join(psutil.Process(pid).cmdline()):
            by_rank[int(rank)] = pid
    assert sorted(by_rank) == list(range(ranks)), (by_rank, server.text())
    return [by_rank[r] for r in range(ranks)]


def _stream(base: str, out: dict) -> None:
    """One long streaming completion: its finish reason, whether [DONE] came, errors."""
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True, "ignore_eos": True,
            "temperature": 0}
    stream_completion(base, body, out)
    out["ended"] = time.monotonic()


def _full(base: str, out: dict) -> None:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
    try:
        r = requests.post(base + "/v1/completions", json=body, timeout=60)
        out["status"], out["body"] = r.status_code, r.json()
    except (requests.RequestException, ValueError) as e:
        out["error"] = repr(e)


def _start_clients(base: str, n_streams: int = 2):
    streams = [{} for _ in range(n_streams)]
    full: dict = {}
    threads = [threading.Thread(target=_stream, args=(base, s), daemon=True) for s in streams]
    threads.append(threading.Thread(target=_full, args=(base, full), daemon=True))
    for t in threads:
        t.start()
    deadline = time.time() + 30
    while time.time() < deadline and not all(s.get("chunks", 0) >= 3 or "error" in s
                                             for s in streams):
        time.sleep(0.02)
    assert all(s.get("chunks", 0) >= 3 for s in streams), streams
    time.sleep(0.3)  # the non-streamed request is in the engine too
    return streams, full, threads


def _check_aborted(streams, full, threads, log: str) -> None:
    for t in threads:
        t.join(15)
    for s in streams:
        assert s.get("finish_reason") == "abort" and s.get("done") and "error" not in s, \
            f"{s}\n{log}"
    assert full.get("status") == 503, f"{full}\n{log}"
    assert full["body"]["error"]["type"] == "server_error", full


def _wait_exit(server: Server, pids: List[int], since: float, bound: float) -> float:
    left = wait_gone(pids, bound + 5 - (time.monotonic() - since))
    gone_at = time.monotonic() - since
    assert not left, f"still running {gone_at:.1f} s after the signal: {left}\n{server.text()}"
    server.proc.wait(5)
    return gone_at


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.mpi)])
def test_sigterm_aborts_what_is_left_at_the_shutdown_timeout(long_tiny_llama, tmp_path, ranks):
    server = _start(long_tiny_llama, tmp_path, SHUTDOWN_TIMEOUT_S, ranks)
    try:
        pids = _rank_pids(server, ranks)
        api = server.api_pids()
        assert len(api) == 1, server.text()  # cvllm serve's default: HTTP in its own process
        streams, full, threads = _start_clients(server.base)
        signalled = time.monotonic()
        for pid in pids:  # mpirun and torchrun forward a signal to every rank
            os.kill(pid, signal.SIGTERM)
        gone_at = _wait_exit(server, pids + api, signalled, SHUTDOWN_TIMEOUT_S + BOUND_S)
        _check_aborted(streams, full, threads, server.text())
        # The drain did wait for the timeout before aborting.
        assert min(s["ended"] for s in streams) - signalled >= SHUTDOWN_TIMEOUT_S - 0.2, streams
        assert gone_at <= SHUTDOWN_TIMEOUT_S + BOUND_S, gone_at
        print(f"\n{ranks} rank(s): every process gone {gone_at:.2f} s after SIGTERM "
              f"(--shutdown-timeout {SHUTDOWN_TIMEOUT_S:.0f})")
        text = server.text()
        assert "drain timed out" in text and "still running at the exit deadline" not in text
        assert server.proc.returncode == 0, text  # a clean exit, mpirun's too
    finally:
        server.stop()


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.mpi)])
def test_second_sigterm_exits_within_5_s(long_tiny_llama, tmp_path, ranks):
    server = _start(long_tiny_llama, tmp_path, 60.0, ranks)
    try:
        pids = _rank_pids(server, ranks)
        api = server.api_pids()
        streams, full, threads = _start_clients(server.base)
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        time.sleep(0.5)
        second = time.monotonic()
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        gone_at = _wait_exit(server, pids + api, second, BOUND_S)
        _check_aborted(streams, full, threads, server.text())
        assert gone_at <= BOUND_S, gone_at
        print(f"\n{ranks} rank(s): every process gone {gone_at:.2f} s after the second SIGTERM")
    finally:
        server.stop()
