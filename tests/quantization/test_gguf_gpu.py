"""Quantized weights on the GPU, end to end (bf16, CUDA graphs on): a Q4_K GGUF (Q6_K LM
head) kept quantized against the same file dequantized, ``--isq q4k`` against that GGUF,
the device bytes against the file's, and a Q4_K MoE model.

Tolerance: greedy ids equal, or at the first divergence each side's token is in the
other's top 5 (the kept path's Triton kernels and the dequantized path's cuBLAS sum in a
different order, then round to bf16; tiny random models have near ties). ``--isq q4k``
and the GGUF load the same bytes into the same kernels: ids equal exactly. Device bytes
of the quantized weights <= 1.05x the file's bytes for them (the kernels' repacked layout).
"""

from __future__ import annotations

import pytest
import torch

from cvllm.engine.llm import LLM
from cvllm.sampling_params import SamplingParams
from cvllm.utils import tuning
from tests.models.family_harness import PROMPTS, save_tiny
from tests.worker.tiny_llama import word_tokenizer
from tests.quantization.test_default_model_quantized import agree_or_top5

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA GPU")]


def _save(hf, folder):
    """The HF folder with a word-level tokenizer (the GPU machines have no default model)."""
    folder = save_tiny(hf, folder, gguf_tokenizer=False)
    word_tokenizer(hf.config.vocab_size).save_pretrained(folder)
    return folder


def _decisive_(hf) -> None:
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.1)


@pytest.fixture(scope="module")
def q4k_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tools.gguf_export import llama as gguf_llama
    from tools.gguf_export.common import QuantPlan

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(
        hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=256,
        tie_word_embeddings=False))
    _decisive_(hf)
    folder = _save(hf, tmp_path_factory.mktemp("gpu_q4k"))
    path = folder / "q4k.gguf"
    gguf_llama.export(hf, path, plan=QuantPlan("Q4_K", {"output.weight": "Q6_K"}))
    return folder, path


def _run(**kw):
    llm = LLM(dtype="bf16", max_model_len=256, kvcache_mem_mb=64, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=5, ignore_eos=True)
    return llm, llm.generate(PROMPTS, params)


def test_kept_q4k_matches_dequantized_and_isq(q4k_llama):
    folder, path = q4k_llama
    llm, kept = _run(weight_file=str(path), weight_path=str(folder))
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.graphs
    _, floats = _run(weight_file=str(path), weight_path=str(folder), dequantize=True)
    problems = [agree_or_top5(k, f) for k, f in zip(kept, floats)]
    assert not any(problems), problems
    _, isq = _run(weight_path=str(folder), isq="q4k")
    assert [o.token_ids for o in isq] == [o.token_ids for o in kept]


def test_norms_round_the_gemv_input_once(q4k_llama):
    """Each layer's two RMSNorms write the int8 input of the Q4_K GEMV after them
    (``pair_norm_outputs``); the greedy tokens are those of the GEMVs rounding it
    themselves (the same rounding; float32 sums may differ in the last bit)."""
    from cvllm.layers.layernorm import RMSNorm

    folder, path = q4k_llama
    llm, paired = _run(weight_file=str(path), weight_path=str(folder))
    norms = [m for m in llm.engine.runner.model.modules() if type(m) is RMSNorm]
    assert sum(m.q8_wps == 4 for m in norms) == 4  # 2 layers x 2 (not the final norm)
    with tuning.configure(ggml_norm_q8=False):
        llm, unpaired = _run(weight_file=str(path), weight_path=str(folder))
    assert not any(m.q8_wps for m in llm.engine.runner.model.modules()
                   if type(m) is RMSNorm)
    assert [o.token_ids for o in paired] == [o.token_ids for o in unpaired]


def test_device_bytes_within_five_percent_of_the_file(q4k_llama):
    import gguf

    from cvllm.quantization.summary import weight_summary

    folder, path = q4k_llama
    reader = gguf.GGUFReader(str(path))
    file_bytes = {t.tensor_type.name: 0 for t in reader.tensors}
    for t in reader.tensors:
        file_bytes[t.tensor_type.name] += int(t.n_bytes)
    llm = LLM(weight_file=str(path), weight_path=str(folder), dtype="bf16", max_model_len=256,
              kvcache_mem_mb=64)
    per_type, _ = weight_summary(llm.engine.runner.model)
    for name in ("Q4_K", "Q6_K"):
        assert per_type[name][1] <= 1.05 * file_bytes[name], (name, per_type, file_bytes)
        assert per_type[name][1] >= file_bytes[name] * 0.99


def test_q4k_moe_kept_matches_dequantized(tmp_path):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tools.gguf_export import qwen3moe as gguf_qwen3moe
    from tools.gguf_export.common import QuantPlan

    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=4,
        num_experts_per_tok=2, vocab_size=256, max_position_embeddings=256,
        norm_topk_prob=True, tie_word_embeddings=False))
    _decisive_(hf)
    folder = _save(hf, tmp_path)
    path = folder / "moe-q4k.gguf"
    gguf_qwen3moe.export(hf, path, plan=QuantPlan("Q4_K"))
    _, kept = _run(weight_file=str(path), weight_path=str(folder))
    _, floats = _run(weight_file=str(path), weight_path=str(folder), dequantize=True)
    problems = [agree_or_top5(k, f) for k, f in zip(kept, floats)]
    assert not any(problems), problems
