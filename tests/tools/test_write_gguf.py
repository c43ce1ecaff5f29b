"""tools/write_gguf.py and the quantization plan of tools/gguf_export: a tiny random Llama
written at q4k (embeddings kept at q8_0) and q8_0, read back with gguf-py, each tensor
compared with the exporter's own F32 file and with the transformers weights; MoE expert
stacks quantized per expert."""

import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

import write_gguf
from cvllm.kernels.quant.ggml_types import GgmlType
from cvllm.quantization.ggml_quantizer import quantize
from gguf_export import exporter_for
from gguf_export.common import QuantPlan, llama_cpp_permute

from .conftest import TOOLS

# Relative RMS error bounds per written type (Gaussian-like weights, see tools/quant_error.py).
REL_RMS = {"Q4_K": 0.1, "Q8_0": 0.01, "Q5_0": 0.06}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny random Llama saved as a folder, and its F32 GGUF from the exporter alone."""
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                      max_position_embeddings=128, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    folder = tmp_path_factory.mktemp("llama")
    model.save_pretrained(folder)
    f32 = exporter_for(cfg)(model, folder / "f32.gguf")
    return model, folder, gguf.GGUFReader(str(f32))


def rel_rms(tensor, ref: np.ndarray) -> float:
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return float(np.sqrt(((values - ref) ** 2).mean()) / ref.std())


def check_against_f32(reader, f32, expected_type) -> None:
    """Same tensors, order, shapes and metadata as the F32 export; values close to it."""
    assert [t.name for t in reader.tensors] == [t.name for t in f32.tensors]
    changed = {"general.file_type", "general.quantization_version"}
    for key, field in f32.fields.items():
        if key not in changed and not key.startswith("GGUF."):
            assert reader.fields[key].parts[-1].tolist() == field.parts[-1].tolist(), key
    for ours, ref in zip(reader.tensors, f32.tensors):
        assert ours.tensor_type.name == expected_type(ours.name, ref), ours.name
        assert list(ours.shape) == list(ref.shape), ours.name
        if ours.tensor_type.name == "F32":
            np.testing.assert_array_equal(ours.data, ref.data)
        else:
            assert rel_rms(ours, ref.data) < REL_RMS[ours.tensor_type.name], ours.name


def test_cli_q4k_keeps_embeddings_at_q8_0(llama, tmp_path):
    model, folder, f32 = llama
    out = tmp_path / "q4k.gguf"
    run = subprocess.run([sys.executable, str(TOOLS / "write_gguf.py"), str(folder), str(out),
                          "--type", "q4k", "--keep-embeddings-type", "q8_0", "--device", "cpu"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "Q4_K" in run.stdout and "Q8_0" in run.stdout

    def expected(name, ref):
        if ref.data.ndim == 1:
            return "F32"
        return "Q8_0" if name in ("token_embd.weight", "output.weight") else "Q4_K"

    reader = gguf.GGUFReader(str(out))
    check_against_f32(reader, f32, expected)
    assert reader.fields["general.file_type"].parts[-1][0] == gguf.LlamaFileType.MOSTLY_Q4_K_S
    assert reader.fields["general.quantization_version"].parts[-1][0] == 2


def test_q8_0_bytes_are_cvllm_quantizer_and_close_to_hf(llama, tmp_path):
    model, folder, f32 = llama
    out = tmp_path / "q8.gguf"
    write_gguf.main([str(folder), str(out), "--type", "q8_0", "--device", "cpu"])
    reader = gguf.GGUFReader(str(out))
    check_against_f32(reader, f32, lambda name, ref: "F32" if ref.data.ndim == 1 else "Q8_0")
    ref = {t.name: t for t in f32.tensors}
    for t in reader.tensors:
        if t.tensor_type.name == "Q8_0":
            blocks = quantize(torch.from_numpy(np.array(ref[t.name].data)), GgmlType.Q8_0)
            np.testing.assert_array_equal(t.data, blocks.numpy())
    tensors = {t.name: t for t in reader.tensors}
    layer = model.model.layers[1]
    down = layer.mlp.down_proj.weight.detach().numpy()  # [256, 512], rows as written
    assert rel_rms(tensors["blk.1.ffn_down.weight"], down) < REL_RMS["Q8_0"]
    q = llama_cpp_permute(layer.self_attn.q_proj.weight.detach().numpy(), 4)  # llama.cpp's row order
    assert rel_rms(tensors["blk.1.attn_q.weight"], q) < REL_RMS["Q8_0"]


def test_plan_types_follow_llama_quantize():
    plan = QuantPlan("Q4_K", overrides={"output.weight": "Q6_K"})
    assert plan.type_for("blk.0.attn_q.weight", (512, 256)) == "Q4_K"
    assert plan.type_for("blk.0.ffn_down_exps.weight", (8, 256, 512)) == "Q4_K"
    assert plan.type_for("blk.0.ffn_down.weight", (256, 576)) == "Q5_0"  # not whole 256s
    assert plan.type_for("blk.0.ffn_down.weight", (256, 48)) == "F32"  # not whole 32s
    assert plan.type_for("blk.0.attn_norm.weight", (256,)) == "F32"
    assert plan.type_for("blk.0.attn_q_norm.weight", (4, 64)) == "F32"  # stablelm's per-head
    assert plan.type_for("blk.0.ffn_gate_inp.weight", (8, 256)) == "F32"  # MoE router
    assert plan.type_for("blk.0.attn_q.bias", (256,)) == "F32"
    assert plan.type_for("output.weight", (300, 256)) == "Q6_K"
    assert QuantPlan("Q6_K").type_for("w.weight", (4, 96)) == "Q8_0"
    assert QuantPlan("F16").type_for("w.weight", (4, 96)) == "F16"


def test_type_names():
    assert write_gguf.type_name("q4k") == write_gguf.type_name("Q4_K") == "Q4_K"
    assert write_gguf.type_name("bf16") == "BF16"
    with pytest.raises(ValueError):
        write_gguf.type_name("q7k")


def test_moe_expert_stacks_quantized_per_expert(tmp_path):
    torch.manual_seed(1)
    cfg = Qwen3MoeConfig(hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=64, num_experts=4, num_experts_per_tok=2, vocab_size=256,
                         max_position_embeddings=64)
    model = Qwen3MoeForCausalLM(cfg).eval()
    export = exporter_for(cfg)
    f32 = {t.name: t for t in gguf.GGUFReader(str(export(model, tmp_path / "f32.gguf"))).tensors}
    path = export(model, tmp_path / "q4k.gguf", plan=QuantPlan("Q4_K"))
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type.name == "F32"
    for proj in ("gate", "up", "down"):
        t = tensors[f"blk.0.ffn_{proj}_exps.weight"]
        ref = np.array(f32[t.name].data)  # [E, out, in]
        assert t.tensor_type.name == "Q4_K" and ref.shape[0] == 4
        assert t.data.shape[:2] == ref.shape[:2]  # [E, out, bytes]: each expert's rows
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        for e in range(4):
            err = np.sqrt(((values[e] - ref[e]) ** 2).mean()) / ref[e].std()
            assert err < REL_RMS["Q4_K"], (t.name, e)
