"""Tensor parallelism on GPUs (NCCL): greedy outputs of a random bf16 Llama-shaped model at
TP=2 (and TP=4 where there are 4 GPUs) agree with TP=1 in the first 32 tokens.

The model: 1024 hidden, 8 layers, 16 heads / 8 KV heads, 8192 vocabulary, HF's own random
init with ``initializer_range`` 0.3, saved in bf16.

Status (2 x H200, 2026-11-21): this test FAILS. TP=2 agrees with TP=1 for the first 12, 3
and 1 tokens of the three prompts (the first sampled token always agrees), the same with
CUDA graphs off; with ``initializer_range`` 0.1 the first divergences came at tokens 21
and 2. The same sharding is exact on the CPU in f32 (tests/e2e/test_tp_generate.py,
tests/distributed/test_tp_forward.py), so the suspect is bf16 rounding of the partial
sums before the all-reduce, not unproven; the next GPU session should compare TP=2 logits
with TP=1 per layer (and in f32 on the GPU) to settle it. ``cvllm generate --d 0[,1,..]``
spawns one process per GPU; CUDA graphs (with the LM head's all-gather inside) and the
overlapped loop are on, as in production.
"""

from __future__ import annotations

import os

import pytest

from tests.distributed.tp_helpers import CVLLM, run_generate, token_ids

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]

PROMPTS = ["t5 t9 t100 t7", "t3 t3 t4000 t12 t8 t900", "t42"]
NEW_TOKENS = 32


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.worker.tiny_llama import write_tiny_llama

    folder = tmp_path_factory.mktemp("tp_gpu_llama")
    return write_tiny_llama(folder, hidden_size=1024, intermediate_size=2816,
                            num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
                            head_dim=64, vocab_size=8192, max_position_embeddings=1024,
                            initializer_range=0.3, torch_dtype="bfloat16")


def _generate(model_dir, devices: str):
    args = ["generate", "--w", str(model_dir), "--d", devices, "--dtype", "bf16",
            "--max-model-len", "256", "--temperature", "0", "--max-tokens", str(NEW_TOKENS),
            "--json", "--no-chat"]
    for p in PROMPTS:
        args += ["--prompt", p]
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", CVLLM_NO_PROGRESS="1")
    return token_ids(run_generate(CVLLM, args, timeout=300, env=env))


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_greedy_matches_tp1(model_dir, tp):
    if _gpus() < tp:
        pytest.skip(f"needs {tp} GPUs, this machine has {_gpus()}")
    want = _generate(model_dir, "0")
    got = _generate(model_dir, ",".join(str(i) for i in range(tp)))
    assert all(0 < len(t) <= NEW_TOKENS for t in want)  # EOS (id 2) may end one early
    assert got == want
