"""Shared by the multi-rank launch, fault and e2e tests: tiny random models saved once,
``cvllm`` command lines, a ``cvllm serve`` process driven over HTTP, and the Open MPI
environment for running as root in CI."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import pytest

from cvllm.distributed.launch_env import find_free_port_pair

CVLLM = [sys.executable, "-m", "cvllm"]
TINY_PROMPTS = ["12 34 56", "!?#"]
"""Prompts whose ids (the default tokenizer's) fit a 256-token tiny vocabulary."""
COMMON = ["--cpu", "--max-model-len", "128", "--mem", "16", "--temperature", "0",
          "--max-num-seqs", "8"]


def mpi_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", CVLLM_NO_PROGRESS="1",
               TOKENIZERS_PARALLELISM="false")
    env.update(extra or {})
    return env


def mpirun_cmd(n: int) -> List[str]:
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun is not installed (apt-get install -y openmpi-bin libopenmpi-dev)")
    return ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(n),
            "--mca", "btl_tcp_if_include", "lo", "--bind-to", "none", *CVLLM]


def torchrun_cmd(n: int) -> List[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
            "--master-port", str(find_free_port_pair()), "-m", "cvllm"]  # health: + 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def save_tiny_llama(folder: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.models.family_harness import randomize_, save_tiny

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=128))
    randomize_(hf)
    return save_tiny(hf, folder)


def save_tiny_qwen3_moe(folder: Path) -> Path:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tests.models.family_harness import randomize_, save_tiny

    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_experts=8,
        num_experts_per_tok=2, vocab_size=256, max_position_embeddings=128,
        norm_topk_prob=True))
    randomize_(hf)
    return save_tiny(hf, folder)


def generate_args(model_args: Sequence[str], prompts: Sequence[str], max_tokens: int,
                  chat: bool = False, logprobs: int = 0) -> List[str]:
    args = ["generate", *model_args, *COMMON, "--max-tokens", str(max_tokens), "--json",
            "--chat" if chat else "--no-chat", "--logprobs", str(logprobs)]
    for p in prompts:
        args += ["--prompt", p]
    return args


def run_generate(prefix: Sequence[str], args: Sequence[str], timeout: float = 120,
                 env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """Run ``prefix + args``; ``prefix`` ends with the program (``CVLLM``,
    ``mpirun_cmd(n)``, ``torchrun_cmd(n)``)."""
    cmd = [*prefix, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=env or mpi_env(), cwd=str(Path(__file__).resolve().parents[2]))


def json_rows(proc: subprocess.CompletedProcess) -> List[dict]:
    """The ``generate --json`` objects, one per prompt."""
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-4000:]}"
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert rows, f"no JSON output\n{proc.stderr[-4000:]}"
    return rows


def token_ids(proc: subprocess.CompletedProcess) -> List[List[int]]:
    return [r["token_ids"] for r in json_rows(proc)]


def assert_greedy_within_near_tie(ref: List[dict], got: List[dict], tol: float) -> None:
    """Greedy generations (``generate --json --logprobs k`` rows) that may part only at a
    near-tie: tokens equal up to the first position where they differ, each equal
    token's log-probability within ``tol`` of the reference's; at that position each
    side's token is in the other side's top-k, less likely than that side's own token by
    at most ``tol``. After it the texts are free to differ (their contexts do)."""
    assert len(got) == len(ref)
    for r, g in zip(ref, got):
        a, b = r["token_ids"], g["token_ids"]
        n = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
        for j in range(n):
            assert abs(r["logprobs"][j] - g["logprobs"][j]) <= tol, (j, a, b)
        if n == len(a) == len(b):
            continue
        assert n < min(len(a), len(b)), f"same tokens, other lengths: {a} {b}"
        top_r = {t: lp for t, lp in r["top_logprobs"][n]}
        top_g = {t: lp for t, lp in g["top_logprobs"][n]}
        assert b[n] in top_r and a[n] in top_g, f"not a near-tie at {n}: {a} {b}"
        assert top_r[a[n]] - top_r[b[n]] <= tol, (n, top_r, a, b)
        assert top_g[b[n]] - top_g[a[n]] <= tol, (n, top_g, a, b)


class Server:
    """A ``cvllm serve`` process (any launcher prefix) and its log."""

    def __init__(self, prefix: Sequence[str], args: Sequence[str], log: Path,
                 env: Optional[Dict[str, str]] = None, subcommand: Sequence[str] = ("serve",)
                 ) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [*prefix, *subcommand, *args, "--port", str(self.port)]
        self._f = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._f, stderr=subprocess.STDOUT,
                                     env=env or mpi_env(), start_new_session=True,
                                     cwd=str(Path(__file__).resolve().parents[2]))

    def wait_healthy(self, timeout: float = 120) -> None:
        import requests

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited early ({self.proc.returncode}):\n{self.text()}")
            try:
                if requests.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        pytest.fail(f"server never became healthy:\n{self.text()}")

    def health(self) -> Optional[int]:
        import requests

        try:
            return requests.get(self.base + "/health", timeout=2).status_code
        except requests.RequestException:
            return None

    def descendants(self) -> List[int]:
        import psutil

        try:
            return [p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def api_pids(self) -> List[int]:
        """The API-server process (``cvllm serve``'s default), if there is one."""
        import psutil

        out = []
        for pid in self.descendants():
            try:
                if "cvllm.server.api_process" in " ".join(psutil.Process(pid).cmdline()):
                    out.append(pid)
            except psutil.NoSuchProcess:
                pass
        return out

    def workers(self) -> List[int]:
        """The rank processes below the launched one (the API-server process, a child of
        rank 0, is not a rank)."""
        import psutil

        api = set(self.api_pids())
        return [pid for pid in self.descendants() if pid not in api]

    def text(self) -> str:
        self._f.flush()
        return self.log.read_text(errors="replace")[-6000:]

    def stop(self) -> None:
        import signal

        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)
        self._f.close()


def stream_completion(base: str, body: dict, out: dict) -> None:
    """POST a streaming ``/v1/completions`` ``body`` and record into ``out``: ``status``,
    ``chunks`` (data chunks), ``finish_reason``, ``completion_tokens`` (from a usage chunk),
    ``done`` (``[DONE]`` came) and ``error`` (an error chunk, or the client's exception)."""
    import requests

    try:
        with requests.post(base + "/v1/completions", json=body, stream=True, timeout=60) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line == b"data: [DONE]":
                    out["done"] = True
                elif line.startswith(b"data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        out["error"] = chunk["error"]
                        continue
                    out["chunks"] = out.get("chunks", 0) + 1
                    choice = chunk["choices"]
                    if choice and choice[0].get("finish_reason"):
                        out["finish_reason"] = choice[0]["finish_reason"]
                    if chunk.get("usage"):
                        out["completion_tokens"] = chunk["usage"]["completion_tokens"]
    except requests.RequestException as e:
        out["error"] = repr(e)


def wait_gone(pids: Sequence[int], timeout: float) -> List[int]:
    """Wait until none of ``pids`` runs (zombies count as gone); returns those left."""
    import psutil

    deadline = time.time() + timeout
    left = list(pids)
    while left and time.time() < deadline:
        left = [p for p in left if _alive(psutil, p)]
        time.sleep(0.1)
    return left


def _alive(psutil, pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
