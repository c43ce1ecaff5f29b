import torch
from transformers import LlamaConfig, LlamaForCausalLM
from tests.models.family_harness import check_against_hf, randomize_, save_tiny

def test_llama_family(tmp_path):
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=128)
    hf = LlamaForCausalLM(cfg)
    randomize_(hf)
    check_against_hf(hf, save_tiny(hf, tmp_path))


def test_llama_gguf(tmp_path):
    from tests.gguf_export import llama as gguf_llama
    from tests.models.family_harness import check_gguf_against_hf

    torch.manual_seed(1)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    hf = LlamaForCausalLM(cfg)
    randomize_(hf)
    folder = save_tiny(hf, tmp_path)
    gguf_llama.export(hf, folder / "tiny.gguf")
    check_gguf_against_hf(hf, folder, "tiny.gguf")
