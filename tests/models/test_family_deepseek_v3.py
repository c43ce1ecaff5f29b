"""DeepSeek V3 served by cvllm matches transformers: MLA with q LoRA and the compressed
cache, YaRN with mscale/mscale_all_dim (softmax scale and rope both scaled), one dense then
one MoE layer, 8 sigmoid-routed experts with e_score_correction_bias and grouped top-k
(noaux_tc: n_group 4, topk_group 2), a shared expert, norm_topk_prob and
routed_scaling_factor 2.5; and its GGUF copy (llama.cpp arch ``deepseek2``, with
``exp_probs_b``, split ``attn_k_b``/``attn_v_b``; the older whole ``attn_kv_b`` is
checked in test_deepseek_v2.py)."""

from tests.models import deepseek_tiny
from tests.models.family_harness import check_against_hf, check_gguf_against_hf, save_tiny


def test_deepseek_v3_family(tmp_path):
    hf = deepseek_tiny.build(deepseek_tiny.v3_config(), seed=1)
    check_against_hf(hf, save_tiny(hf, tmp_path))


def test_deepseek_v3_gguf(tmp_path):
    """transformers has no GGUF loader for deepseek2, so only cvllm reads the file.
    llama.cpp stores one YaRN mscale (mscale_all_dim) and assumes mscale equals it."""
    from tools.gguf_export import deepseek2

    yarn = dict(deepseek_tiny.V3_YARN, mscale=0.8)
    hf = deepseek_tiny.build(deepseek_tiny.v3_config(rope_parameters=yarn), seed=3)
    folder = save_tiny(hf, tmp_path)
    deepseek2.export(hf, folder / "tiny.gguf")
    check_gguf_against_hf(hf, folder, "tiny.gguf", transformers_loads=False)
