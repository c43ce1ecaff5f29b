"""DeepSeek V2/V3 (MLA + grouped-routing MoE) against transformers, with the compressed
paged cache and the metadata built by hand (no worker), plus the MLA backend against a
naive decompressed attention and the weight-name variants the loader accepts."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from cvllm.attention.backends import torch_ref_mla
from cvllm.attention.metadata import AttentionMetadata
from cvllm.attention.specs import MLASpec
from cvllm.config import ModelConfig
from cvllm.layers.mla import mla_softmax_scale
from cvllm.models.registry import get_model_class
from cvllm.models.utils import WeightLoadError
from tests.models import deepseek_tiny
from tests.models.test_llama import PROMPTS, PagedRunner, hf_logits

VARIANTS = {
    "v2_lite_grouped": lambda: deepseek_tiny.v2_config(),
    "v2_greedy": lambda: deepseek_tiny.v2_config(topk_method="greedy", attention_bias=False),
    "v3_yarn": lambda: deepseek_tiny.v3_config(),
    "v3_rotate_half": lambda: deepseek_tiny.v3_config(
        rope_interleave=False, rope_parameters=None, q_lora_rank=None, tie_word_embeddings=True
    ),
}


def build_pair(variant, tmp_path):
    hf = deepseek_tiny.build(VARIANTS[variant]())
    hf.save_pretrained(tmp_path, safe_serialization=True)
    hf_config = json.loads((tmp_path / "config.json").read_text())
    mc = ModelConfig(architecture=hf_config["architectures"][0], hf_config=hf_config, dtype="f32")
    model = get_model_class(mc.architecture)(mc)
    model.load_weights(load_file(tmp_path / "model.safetensors").items())
    return hf, model, mc


class MLARunner(PagedRunner):
    """PagedRunner with the caches the model's ``cache_specs`` ask for."""

    def __init__(self, model, mc, block_size=4, num_blocks=64):
        super().__init__(model, mc, block_size, num_blocks)
        specs = model.cache_specs()
        assert all(isinstance(s, MLASpec) for s in specs) and len(specs) == mc.num_layers
        self.kv_caches = [
            (
                torch.zeros(
                    num_blocks, block_size, s.kv_lora_rank + s.qk_rope_head_dim, dtype=s.dtype
                ),
                None,
            )
            for s in specs
        ]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_batched_prefill_logits_match_hf(variant, tmp_path):
    hf, model, mc = build_pair(variant, tmp_path)
    _, logits = MLARunner(model, mc).step([(i, p) for i, p in enumerate(PROMPTS)])
    want = torch.cat([hf_logits(hf, p) for p in PROMPTS])
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("variant", ["v2_lite_grouped", "v3_yarn"])
def test_chunked_prefill_then_greedy_decode_match_hf(variant, tmp_path):
    hf, model, mc = build_pair(variant, tmp_path)
    runner, n_new = MLARunner(model, mc, block_size=4), 12
    out = {0: [], 1: []}
    # Sequence 1's prompt arrives in two chunks while sequence 0 decodes.
    last, _ = runner.step([(0, PROMPTS[0]), (1, PROMPTS[1][:5])])
    out[0].append(int(last[0].argmax()))
    last, _ = runner.step([(0, [out[0][-1]]), (1, PROMPTS[1][5:])])
    out[0].append(int(last[0].argmax()))
    out[1].append(int(last[1].argmax()))
    while len(out[1]) < n_new:
        batch = [(i, [out[i][-1]]) for i in out if len(out[i]) < n_new]
        last, _ = runner.step(batch)
        for (i, _), row in zip(batch, last):
            out[i].append(int(row.argmax()))
    for i in out:
        want = hf.generate(
            torch.tensor([PROMPTS[i]]),
            max_new_tokens=n_new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(PROMPTS[i]) :].tolist()
        assert out[i] == want, f"sequence {i}"


def test_mla_backend_matches_decompressed_attention():
    """Absorbed attention over the paged latent cache == softmax(q k^T) v with K/V
    decompressed per head, for a decode + a chunked prefill in one step."""
    torch.manual_seed(0)
    H, R, P, Dn, Dv, bs = 3, 16, 4, 8, 6, 4
    w_uk, w_uv = torch.randn(H, Dn, R), torch.randn(H, Dv, R)
    lat = torch.randn(20, R + P)  # the latents of tokens 0..19 of two sequences
    seqs = {0: (list(range(0, 9)), [5, 2, 7]), 1: (list(range(9, 20)), [1, 0, 6])}
    cache = torch.zeros(8, bs, R + P)
    # Sequence 0: 8 tokens cached, 1 decoded now; sequence 1: 6 cached, 5 new.
    ctx = {0: 8, 1: 6}
    for s, (toks, blocks) in seqs.items():
        for p in range(ctx[s]):
            cache[blocks[p // bs], p % bs] = lat[toks[p]]
    new = [(s, p) for s in (0, 1) for p in range(ctx[s], len(seqs[s][0]))]
    slots = [seqs[s][1][p // bs] * bs + p % bs for s, p in new]
    meta = AttentionMetadata.build(
        slot_mapping=np.array(slots),
        query_start_loc=np.array([0, 1, 6]),
        seq_lens=np.array([9, 11]),
        block_tables=np.array([[5, 2, 7], [1, 0, 6]]),
        device="cpu",
    )
    q_nope, q_pe = torch.randn(len(new), H, Dn), torch.randn(len(new), H, P)
    rows = torch.stack([lat[seqs[s][0][p]] for s, p in new])
    q_lat = torch.einsum("thd,hdr->thr", q_nope, w_uk)
    got = torch_ref_mla.forward(q_lat, q_pe, rows[:, :R], rows[:, R:], cache, meta, 0.3)
    got = torch.einsum("thr,hvr->thv", got, w_uv)  # [T, H, Dv]
    for t, (s, p) in enumerate(new):
        ctx_lat = torch.stack([lat[i] for i in seqs[s][0][: p + 1]])  # [L, R + P]
        k = torch.cat(
            [torch.einsum("lr,hdr->hld", ctx_lat[:, :R], w_uk), ctx_lat[:, R:].expand(H, -1, -1)],
            dim=-1,
        )  # [H, L, Dn + P]
        v = torch.einsum("lr,hvr->hlv", ctx_lat[:, :R], w_uv)  # [H, L, Dv]
        q = torch.cat([q_nope[t], q_pe[t]], dim=-1).unsqueeze(1)  # [H, 1, Dn + P]
        want = (torch.softmax(q @ k.transpose(1, 2) * 0.3, dim=-1) @ v)[:, 0]
        torch.testing.assert_close(got[t], want, atol=1e-4, rtol=1e-4)


def test_softmax_scale_follows_transformers():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    for rp in (
        {"rope_type": "default"},
        deepseek_tiny.V3_YARN,
        {"rope_type": "yarn", "factor": 40.0, "mscale": 0.707, "mscale_all_dim": 0.707},
    ):
        assert mla_softmax_scale(24, rp) == pytest.approx(
            yarn_apply_mscale(rp, 24**-0.5), rel=1e-12
        )


def test_split_kv_b_mtp_and_aliases_load_alike(tmp_path):
    """llama.cpp's k_b/v_b split, stacked experts, the exp_probs_b alias and a stray MTP
    layer load to the same model as the HF checkpoint."""
    hf, model, mc = build_pair("v3_yarn", tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    alt, H, dn, dv = {}, 4, 16, 12
    for k, v in state.items():
        if k.endswith("kv_b_proj.weight"):
            kv = v.view(H, dn + dv, -1)
            alt[k.replace("kv_b_proj", "k_b_proj")] = kv[:, :dn].transpose(1, 2).contiguous()
            alt[k.replace("kv_b_proj", "v_b_proj")] = kv[:, dn:].contiguous()
        elif ".experts." in k:
            continue
        else:
            alt[k.replace("e_score_correction_bias", "e_score_correction.bias")] = v
    for proj in ("gate_proj", "up_proj", "down_proj"):
        alt[f"model.layers.1.mlp.experts.{proj}.weight"] = torch.stack(
            [state[f"model.layers.1.mlp.experts.{e}.{proj}.weight"] for e in range(8)]
        )
    alt["model.layers.2.self_attn.kv_a_proj_with_mqa.weight"] = torch.ones(3)  # MTP: skipped
    other = get_model_class(mc.architecture)(mc)
    other.load_weights(alt.items())
    for (name, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), name
    del (
        alt["model.layers.0.self_attn.v_b_proj.weight"],
        alt["model.layers.1.mlp.experts.up_proj.weight"],
    )
    with pytest.raises(
        WeightLoadError,
        match=r"layers\.0\.self_attn\.v_b_proj\.weight, model\.layers\.1\.mlp\.experts\.0\.up_proj",
    ):
        other.load_weights(alt.items())
    with pytest.raises(
        WeightLoadError, match=r"does not know: model\.layers\.0\.mlp\.bogus\.weight"
    ):
        other.load_weights(
            list(state.items()) + [("model.layers.0.mlp.bogus.weight", torch.ones(1))]
        )


def test_dummy_weights_run_in_bf16():
    cfg = deepseek_tiny.v3_config().to_dict()
    cfg["architectures"] = ["DeepseekV3ForCausalLM"]
    mc = ModelConfig(architecture="DeepseekV3ForCausalLM", hf_config=cfg, dtype="bf16")
    model = get_model_class(mc.architecture)(mc)
    model.init_dummy_weights(3)
    assert model.cache_specs()[0] == MLASpec(32, 16, torch.bfloat16)
    last, _ = MLARunner(model, mc).step([(0, PROMPTS[0])])
    assert torch.isfinite(last).all()


@pytest.mark.parametrize("variant", ["v2_lite_grouped", "v3_gguf"])
def test_gguf_both_kv_b_conventions_load_the_hf_model(variant, tmp_path):
    """Both deepseek2 header/tensor styles (split attn_k_b/attn_v_b with MQA-view lengths,
    and the older whole attn_kv_b with per-head lengths) give the HF config's settings and
    a model with the HF checkpoint's weights."""
    from cvllm.loader.gguf_loader import gguf_config, iter_gguf_weights
    from tools.gguf_export import deepseek2

    if variant == "v3_gguf":
        yarn = dict(deepseek_tiny.V3_YARN, mscale=0.8)
        cfg = deepseek_tiny.v3_config(rope_parameters=yarn)
    else:
        cfg = deepseek_tiny.v2_config()
    hf = deepseek_tiny.build(cfg)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    want = json.loads((tmp_path / "config.json").read_text())
    mc = ModelConfig(architecture=want["architectures"][0], hf_config=want, dtype="f32")
    reference = get_model_class(mc.architecture)(mc)
    reference.load_weights(load_file(tmp_path / "model.safetensors").items())
    for split in (True, False):
        path = deepseek2.export(hf, tmp_path / f"split{split}.gguf", split_kv_b=split)
        got = gguf_config(path)
        for key in (
            "architectures",
            "q_lora_rank",
            "kv_lora_rank",
            "qk_rope_head_dim",
            "qk_nope_head_dim",
            "v_head_dim",
            "num_key_value_heads",
            "n_routed_experts",
            "num_experts_per_tok",
            "n_shared_experts",
            "moe_intermediate_size",
            "first_k_dense_replace",
            "routed_scaling_factor",
            "norm_topk_prob",
            "n_group",
            "topk_group",
            "rope_parameters",
            "attention_bias",
            "mlp_bias",
        ):
            assert got.get(key) == want.get(key, False), (split, key)
        mc2 = ModelConfig(architecture=got["architectures"][0], hf_config=got, dtype="f32")
        model = get_model_class(mc2.architecture)(mc2)
        model.load_weights(iter_gguf_weights(path))
        assert model.variant == reference.variant
        for (name, a), (_, b) in zip(reference.state_dict().items(), model.state_dict().items()):
            assert torch.equal(a, b), (split, name)
