"""``cvllm serve``'s API process (the default; ``docs/architecture.md``, "Two processes")
with real processes (tiny Llama on the CPU): a signal that reaches both processes (systemd
signals every process of a unit, ``pkill -f cvllm`` matches both) counts once and drains;
a taken port ends ``cvllm serve`` with that message and exit status 2, leaving nothing
behind; the API process dying ends the job with status 1; rank 0 dying ends the API
process; ``--no-api-process`` serves from one process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import requests

from tests.distributed.tp_helpers import CVLLM, Server, mpi_env, stream_completion, wait_gone
from tests.e2e.test_shutdown import _args, long_tiny_llama  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow


def _server(model, tmp_path, *extra, env=None) -> Server:
    server = Server(CVLLM, _args(model, 30.0) + list(extra), tmp_path / "serve.log", env=env)
    server.wait_healthy()
    return server


def _stream(base: str, max_tokens: int, out: dict) -> None:
    stream_completion(base, {"prompt": "12 34 56", "max_tokens": max_tokens, "stream": True,
                             "ignore_eos": True, "temperature": 0}, out)


def test_a_signal_to_every_process_drains_once(long_tiny_llama, tmp_path):  # noqa: F811
    server = _server(long_tiny_llama, tmp_path)
    try:
        (api,) = server.api_pids()
        out: dict = {}
        t = threading.Thread(target=_stream, args=(server.base, 300, out), daemon=True)
        t.start()
        deadline = time.time() + 30
        while out.get("chunks", 0) < 3 and "error" not in out and time.time() < deadline:
            time.sleep(0.02)
        for pid in (server.proc.pid, api):  # as systemd or pkill would
            os.kill(pid, signal.SIGTERM)
        t.join(30)
        # drained: the stream ran to its length (a second signal would have aborted it)
        assert out.get("finish_reason") == "length" and out.get("done"), (out, server.text())
        assert not wait_gone([server.proc.pid, api], 10), server.text()
        assert server.proc.wait(5) == 0, server.text()
        assert "second SIGTERM" not in server.text()
    finally:
        server.stop()


def test_a_taken_port_is_a_clear_error(long_tiny_llama, tmp_path):  # noqa: F811
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = subprocess.run([*CVLLM, "serve", *_args(long_tiny_llama, 30.0), "--port", str(port)],
                              capture_output=True, text=True, timeout=180,
                              env=dict(os.environ, CVLLM_NO_PROGRESS="1"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr, proc.stderr[-3000:]
    leftovers = subprocess.run(["pgrep", "-f", f"cvllm.server.api_process"],
                               capture_output=True, text=True).stdout.split()
    assert not [p for p in leftovers if int(p) != os.getpid()], leftovers


def test_the_api_process_dying_ends_the_job(long_tiny_llama, tmp_path):  # noqa: F811
    server = _server(long_tiny_llama, tmp_path)
    try:
        (api,) = server.api_pids()
        os.kill(api, signal.SIGKILL)
        assert server.proc.wait(20) == 1, server.text()
        assert "the API process exited with -9" in server.text()
    finally:
        server.stop()


def test_rank_0_dying_ends_the_api_process(long_tiny_llama, tmp_path):  # noqa: F811
    """... and leaves no copy of the tokenizer behind: rank 0 removes the folder it
    exported for the API process once that process listens (a SIGKILL runs no cleanup;
    65 such folders of 3.5 MB each had piled up in one machine's /tmp)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    server = _server(long_tiny_llama, tmp_path, env=dict(mpi_env(), TMPDIR=str(tmp)))
    try:
        (api,) = server.api_pids()
        # /health may answer a moment before rank 0 hears LISTENING and removes it
        deadline = time.time() + 10
        while list(tmp.glob("cvllm-api-*")) and time.time() < deadline:
            time.sleep(0.05)
        assert not list(tmp.glob("cvllm-api-*")), list(tmp.iterdir())
        os.kill(server.proc.pid, signal.SIGKILL)
        assert not wait_gone([api], 10), server.text()
        with pytest.raises(requests.RequestException):
            requests.get(server.base + "/health", timeout=2)
        assert not list(tmp.glob("cvllm-api-*")), list(tmp.iterdir())
    finally:
        server.stop()


def test_one_process_serves_too(long_tiny_llama, tmp_path):  # noqa: F811
    server = _server(long_tiny_llama, tmp_path, "--no-api-process")
    try:
        assert server.api_pids() == []
        r = requests.post(server.base + "/v1/completions", timeout=60, json={
            "prompt": "12 34", "max_tokens": 4, "ignore_eos": True, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        server.stop()


def test_the_api_process_imports_no_torch():
    """It serves without torch (its start-up and memory): the modules it runs, imported
    in a fresh interpreter, leave torch out."""
    code = ("import sys, cvllm.server.api_process, cvllm.server.remote_engine, "
            "cvllm.server.app, cvllm.server.lifecycle, cvllm.engine.tokenizer, "
            "cvllm.server.agent_setup; from transformers import PreTrainedTokenizerFast; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == "False", out.stderr[-2000:]
