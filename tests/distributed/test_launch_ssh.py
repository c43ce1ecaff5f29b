"""``launch/ssh_launch.sh`` with two "nodes" on this machine: an ssh stand-in runs each
node's command locally, so the script's own logic (hostfile parsing, ``--num-nodes /
--node-rank / --master-addr`` per node, node 0 last, SIGTERM forwarded to rank 0, the
others hung up) runs for real. The 2-rank job (tiny Llama, one CPU rank per node) must
serve a completion equal to a 1-rank run's, then drain and exit on SIGTERM."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import requests

from cvllm.distributed.launch_env import find_free_port_pair
from tests.distributed.tp_helpers import (
    COMMON, CVLLM, TINY_PROMPTS, Server, generate_args, mpi_env, run_generate,
    save_tiny_llama, token_ids, wait_gone,
)

pytestmark = pytest.mark.mpi
ROOT = Path(__file__).resolve().parents[2]

FAKE_SSH = """#!/usr/bin/env bash
# ssh stand-in: drop the options and the host, run the command here.
while [[ "$1" == -* ]]; do [[ "$1" == "-o" ]] && shift; shift; done
shift
exec bash -c "$*"
"""


def test_ssh_launch_two_nodes(tmp_path):
    model = save_tiny_llama(tmp_path / "llama")
    ssh = tmp_path / "fake_ssh"
    ssh.write_text(FAKE_SSH)
    ssh.chmod(0o755)
    hosts = tmp_path / "hosts"
    hosts.write_text("# two nodes\nlocalhost slots=1\n127.0.0.1 slots=1\n")
    env = mpi_env({"SSH": str(ssh), "CVLLM_CMD": " ".join(CVLLM),
                   "CVLLM_MASTER_PORT": str(find_free_port_pair())})  # health: port + 1
    server = Server([str(ROOT / "launch" / "ssh_launch.sh"), str(hosts), "--"],
                    ["--w", str(model), *COMMON], tmp_path / "ssh.log", env=env,
                    subcommand=())  # ssh_launch.sh adds "serve" itself
    try:
        server.wait_healthy()
        text = server.text()
        assert "--num-nodes 2 --node-rank 1 --master-addr localhost" in " ".join(
            server_cmdlines(server))
        assert "(ssh, local rank 0 of 1, node 1 of 2)" in text
        assert "tensor parallel over 2 ranks" in text and "[node 1]" in text
        r = requests.post(server.base + "/v1/completions", timeout=60, json={
            "prompt": TINY_PROMPTS[0], "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200
        pids = [server.proc.pid, *server.descendants()]
        server.proc.send_signal(signal.SIGTERM)
        assert not wait_gone(pids, 30), server.text()
        assert "draining" in server.text() and "SHUTDOWN" in server.text()
    finally:
        server.stop()
    ref = token_ids(run_generate(CVLLM, generate_args(["--w", str(model)], TINY_PROMPTS[:1], 8)))
    got = r.json()["choices"][0]["text"]
    from cvllm import loader

    tok = loader.load_tokenizer(loader.resolve_model_source())
    assert got == tok.decode(ref[0])


def server_cmdlines(server):
    import psutil

    out = []
    for pid in server.descendants():
        try:
            out.append(" ".join(psutil.Process(pid).cmdline()))
        except psutil.NoSuchProcess:
            pass
    return out
