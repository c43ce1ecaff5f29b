"""``--isq`` and tensor parallelism with K-quant weights, end to end through ``cvllm
generate`` on the CPU.

- ``--isq q4k`` on an HF folder gives exactly the outputs of the GGUF written from the
  same weights at Q4_K (LM head at Q6_K, as ``--isq`` keeps it): the quantizer is one
  function and rows are quantized independently, so both load the same bytes; the greedy
  ids must be equal.
- The Q4_K GGUF at TP=2 (two CPU ranks, gloo) gives the TP=1 greedy ids: the row-parallel
  layers split their input on whole 256-blocks.
- ``--isq`` with a GGUF file, an unknown ``--isq`` name, and a TP split that would cut a
  block are refused at start-up with a message naming the problem.

Tolerance: greedy ids equal. The tiny model is made decisive (weights N(0, 0.1), a
256-token vocabulary) so that float summation order between ranks cannot flip a token.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.tp_helpers import CVLLM, generate_args, run_generate, token_ids

pytestmark = [pytest.mark.slow]
PROMPTS = ["12 34 56", "!?#"]
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer Llama whose rows are whole Q4_K blocks at TP 1 and 2 (hidden 512, MLP
    1024), saved as an HF folder and as a Q4_K GGUF written by tools/gguf_export."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.models.family_harness import save_tiny
    from tools.gguf_export import llama as gguf_llama
    from tools.gguf_export.common import QuantPlan

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(
        hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
        tie_word_embeddings=False))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.1)
    folder = save_tiny(hf, tmp_path_factory.mktemp("isq_tp"))
    gguf_path = folder / "tiny-q4k.gguf"
    gguf_llama.export(hf, gguf_path, plan=QuantPlan("Q4_K", {"output.weight": "Q6_K"}))
    return folder, gguf_path


def _ids(model_args, extra=()):
    return token_ids(run_generate(CVLLM, generate_args([*model_args, *extra], PROMPTS,
                                                       NEW_TOKENS)))


def test_isq_q4k_equals_the_q4k_gguf_of_the_same_weights(tiny):
    import gguf

    folder, gguf_path = tiny
    reader = gguf.GGUFReader(str(gguf_path))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.ffn_down.weight"] == "Q4_K" and types["output.weight"] == "Q6_K"
    from_gguf = _ids(["--f", str(gguf_path), "--w", str(folder)])
    from_isq = _ids(["--w", str(folder)], ["--isq", "q4k"])
    assert from_isq == from_gguf
    assert all(len(ids) == NEW_TOKENS for ids in from_isq)


def test_k_quant_gguf_two_ranks_match_one_rank(tiny):
    folder, gguf_path = tiny
    model = ["--f", str(gguf_path), "--w", str(folder)]
    one = _ids(model)
    proc = run_generate(CVLLM, generate_args([*model, "--d", "0,1"], PROMPTS, NEW_TOKENS))
    assert token_ids(proc) == one, proc.stderr[-3000:]
    assert "tensor parallel over 2 ranks" in proc.stderr
    assert "Q4_K" in proc.stderr  # the start-up log names the weight types


def test_bad_quantization_requests_are_refused(tiny):
    folder, gguf_path = tiny
    proc = run_generate(CVLLM, generate_args(["--f", str(gguf_path), "--isq", "q4k"],
                                             PROMPTS, 2))
    assert proc.returncode == 2 and "is a GGUF file" in proc.stderr, proc.stderr[-2000:]
    proc = run_generate(CVLLM, generate_args(["--w", str(folder), "--isq", "q7k"], PROMPTS, 2))
    assert proc.returncode == 2 and "unknown --isq type 'q7k'" in proc.stderr, proc.stderr[-2000:]
    # 512 input features over 4 ranks: 128 per rank cuts Q4_K's 256-blocks.
    proc = run_generate(CVLLM, generate_args(["--f", str(gguf_path), "--w", str(folder), "--d",
                                              "0,1,2,3"], PROMPTS, 2))
    assert proc.returncode != 0
    assert "would cut quantization blocks of 256; rank counts that work: [1, 2]" in proc.stderr, \
        proc.stderr[-3000:]
