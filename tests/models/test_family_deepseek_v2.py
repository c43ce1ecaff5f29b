"""DeepSeek V2 served by cvllm matches transformers: MLA with the compressed cache and no
q LoRA (V2-Lite style), one dense then one MoE layer (first_k_dense_replace=1), 8 softmax-
routed experts with group_limited_greedy (n_group 4, topk_group 1), 2 shared experts,
routed_scaling_factor 1.5, attention and MLP biases; and its GGUF copy (llama.cpp arch
``deepseek2``, split ``attn_k_b``/``attn_v_b``)."""

from tests.models import deepseek_tiny
from tests.models.family_harness import check_against_hf, check_gguf_against_hf, save_tiny


def test_deepseek_v2_family(tmp_path):
    hf = deepseek_tiny.build(deepseek_tiny.v2_config(), seed=0)
    check_against_hf(hf, save_tiny(hf, tmp_path))


def test_deepseek_v2_gguf(tmp_path):
    """transformers has no GGUF loader for deepseek2, so only cvllm reads the file."""
    from tools.gguf_export import deepseek2

    hf = deepseek_tiny.build(deepseek_tiny.v2_config(attention_bias=False, mlp_bias=False), seed=2)
    folder = save_tiny(hf, tmp_path)
    deepseek2.export(hf, folder / "tiny.gguf")
    check_gguf_against_hf(hf, folder, "tiny.gguf", transformers_loads=False)
