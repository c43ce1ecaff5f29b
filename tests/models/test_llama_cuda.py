"""The Llama model on a CUDA device against HF on the same device (skipped without one)."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from cvllm.attention.kv_cache import KVCacheSpec, allocate_kv_cache
from cvllm.attention.metadata import AttentionMetadata
from cvllm.config import ModelConfig
from cvllm.models.registry import get_model_class

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CFG = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=512,
    max_position_embeddings=256,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
)
PROMPTS = [list(range(5, 40)), [7, 1, 200, 45, 13, 8, 91], list(range(300, 364))]


def build(tmp_path, dtype_name, torch_dtype):
    torch.manual_seed(0)
    cfg = LlamaConfig(**CFG)
    cfg._attn_implementation = "eager"
    LlamaForCausalLM(cfg).save_pretrained(tmp_path, safe_serialization=True)
    hf = (
        LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch_dtype, attn_implementation="eager")
        .cuda()
        .eval()
    )
    mc = ModelConfig(
        "LlamaForCausalLM", json.loads((tmp_path / "config.json").read_text()), dtype=dtype_name
    )
    with torch.device("cuda"):
        model = get_model_class(mc.architecture)(mc)
    model.load_weights(load_file(tmp_path / "model.safetensors").items())
    return hf, model, mc


def prefill_logits(model, mc, dtype):
    caches = allocate_kv_cache(
        KVCacheSpec(mc.num_layers, mc.num_kv_heads, mc.head_dim, 16, dtype), 32, "cuda"
    )
    ids, pos, slots, qsl, lens, tables, nb = [], [], [], [0], [], [], 0
    for p in PROMPTS:
        blocks = list(range(nb, nb + -(-len(p) // 16)))
        nb += len(blocks)
        tables.append(blocks + [-1] * (8 - len(blocks)))
        ids += p
        pos += range(len(p))
        slots += [blocks[i // 16] * 16 + i % 16 for i in range(len(p))]
        qsl.append(len(ids))
        lens.append(len(p))
    meta = AttentionMetadata.build(
        slot_mapping=slots, query_start_loc=qsl, seq_lens=lens, block_tables=tables, device="cuda"
    )
    with torch.no_grad():
        hidden = model(
            torch.tensor(ids, device="cuda"), torch.tensor(pos, device="cuda"), meta, caches
        )
        return model.compute_logits(hidden)  # [T, V]


@pytest.mark.parametrize(
    "dtype_name,torch_dtype,atol", [("f32", torch.float32, 1e-3), ("bf16", torch.bfloat16, 0.1)]
)
def test_cuda_prefill_matches_hf(tmp_path, dtype_name, torch_dtype, atol):
    hf, model, mc = build(tmp_path, dtype_name, torch_dtype)
    assert model.lm_head.weight.device.type == "cuda" and model.lm_head.weight.dtype == torch_dtype
    logits = prefill_logits(model, mc, torch_dtype)
    with torch.no_grad():
        want = torch.cat([hf(torch.tensor([p], device="cuda")).logits[0].float() for p in PROMPTS])
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, want, atol=atol, rtol=0)
    agree = (logits.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agree > 0.97


def test_cuda_dummy_weights_run():
    mc = ModelConfig("LlamaForCausalLM", {k: v for k, v in CFG.items()}, dtype="bf16")
    with torch.device("cuda"):
        model = get_model_class(mc.architecture)(mc)
    model.init_dummy_weights(3)
    assert torch.isfinite(prefill_logits(model, mc, torch.bfloat16)).all()
