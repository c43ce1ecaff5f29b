"""Tensor parallelism in bf16: greedy outputs of a random Llama-shaped model at TP=2 (and
TP=4 on a machine with 4 GPUs) agree with TP=1 over the first 32 tokens, or, where bf16
rounding makes them part, each side's token is in the other side's top 5 at the first
difference (the rule issue 4 uses for bf16 against transformers).

Why the second clause: the TP ranks sum their partial outputs in a different order than
one device does, so bf16 results differ in the last bits, and a random model is chaotic
enough that the last bits flip a greedy token within a few dozen steps. It is rounding,
not sharding: on the CPU, a 1024-wide 8-layer random Llama (init 0.3) parts between its
own TP=1 bf16 and TP=1 f32 runs as early as between TP=1 and TP=2 in bf16 (first
differences at tokens 3, 7, 11 and 7, 7, 4 of three prompts), while TP=2 equals TP=1
exactly in f32 (tests/e2e/test_tp_generate.py). On two H200s the same model's TP=2 and
TP=1 bf16 runs first differed at tokens 12, 3 and 1, with CUDA graphs on and off alike.

CPU (CI): 2 ranks spawned with ``--cpu --d 0,1`` (gloo). GPU: ``--d 0,1[,2,3]`` (NCCL,
CUDA graphs with the LM head's all-gather inside, overlapped loop).
"""

from __future__ import annotations

import json
import os
from typing import List

import pytest

from tests.distributed.tp_helpers import CVLLM, run_generate

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.mpi]

PROMPTS = ["t5 t9 t100 t7", "t3 t3 t400 t12 t8 t900", "t42"]
NEW_TOKENS = 32


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.worker.tiny_llama import write_tiny_llama

    folder = tmp_path_factory.mktemp("tp_bf16_llama")
    big = _gpus() >= 2  # the CPU gets a smaller model: CI time
    return write_tiny_llama(
        folder, hidden_size=1024 if big else 256, intermediate_size=2816 if big else 512,
        num_hidden_layers=8 if big else 4, num_attention_heads=16 if big else 8,
        num_key_value_heads=8 if big else 4, head_dim=64 if big else 32,
        vocab_size=8192 if big else 1024, max_position_embeddings=1024, initializer_range=0.1,
        torch_dtype="bfloat16")


def _generate(model_dir, devices: str, cpu: bool) -> List[dict]:
    args = ["generate", "--w", str(model_dir), "--d", devices, "--dtype", "bf16",
            "--max-model-len", "256", "--temperature", "0", "--max-tokens", str(NEW_TOKENS),
            "--json", "--no-chat", "--logprobs", "5"]
    if cpu:
        args += ["--cpu", "--mem", "16"]
    for p in PROMPTS:
        args += ["--prompt", p]
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", CVLLM_NO_PROGRESS="1")
    proc = run_generate(CVLLM, args, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def agree_or_top5(a: dict, b: dict) -> str:
    """'' when ``a`` and ``b`` agree over their common tokens, or at the first difference
    each side's token is among the other's top 5; else why not."""
    for i, (x, y) in enumerate(zip(a["token_ids"], b["token_ids"])):
        if x != y:
            top_a = {t for t, _ in a["top_logprobs"][i]}
            top_b = {t for t, _ in b["top_logprobs"][i]}
            if y in top_a and x in top_b:
                return ""
            return f"token {i}: {x} vs {y}; top5 {sorted(top_a)} / {sorted(top_b)}"
    if len(a["token_ids"]) != len(b["token_ids"]):
        return f"lengths {len(a['token_ids'])} vs {len(b['token_ids'])} with equal tokens"
    return ""


def _check(model_dir, tp: int, cpu: bool) -> None:
    want = _generate(model_dir, "0", cpu)
    got = _generate(model_dir, ",".join(str(i) for i in range(tp)), cpu)
    assert len(got) == len(want) == len(PROMPTS)
    assert all(len(r["top_logprobs"]) == len(r["token_ids"]) > 0 for r in want + got)
    problems = [agree_or_top5(a, b) for a, b in zip(want, got)]
    assert not any(problems), problems


def test_cpu_tp2_bf16_agrees_with_tp1(model_dir):
    if _gpus() >= 2:
        pytest.skip("the GPU tests below cover this machine")
    _check(model_dir, 2, cpu=True)


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [2, 4])
def test_gpu_tp_bf16_agrees_with_tp1(model_dir, tp):
    if _gpus() < tp:
        pytest.skip(f"needs {tp} GPUs, this machine has {_gpus()}")
    _check(model_dir, tp, cpu=False)


def test_the_rule_itself():
    a = {"token_ids": [1, 2, 3], "top_logprobs": [[[1, 0]], [[2, 0], [9, -1]], [[3, 0]]]}
    b = {"token_ids": [1, 9, 4], "top_logprobs": [[[1, 0]], [[9, 0], [2, -1]], [[4, 0]]]}
    assert agree_or_top5(a, a) == "" and agree_or_top5(a, b) == ""
    c = {"token_ids": [1, 7, 4], "top_logprobs": [[[1, 0]], [[7, 0]], [[4, 0]]]}
    assert "token 1" in agree_or_top5(a, c)
    assert "lengths" in agree_or_top5(a, {"token_ids": [1, 2], "top_logprobs": [[], []]})
