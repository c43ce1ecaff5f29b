"""LlamaForCausalLM (and the Mistral alias) against Hugging Face transformers.

Tiny random HF models are saved with ``save_pretrained`` and loaded into cvllm through
their safetensors state dict; the paged KV cache and the metadata are driven by hand."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from cvllm.attention.kv_cache import KVCacheSpec, allocate_kv_cache
from cvllm.attention.metadata import AttentionMetadata
from cvllm.config import ModelConfig
from cvllm.models.registry import get_model_class
from cvllm.models.utils import WeightLoadError

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    max_position_embeddings=128,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
VARIANTS = {
    "llama3_rope": lambda: LlamaConfig(**TINY, rope_parameters=LLAMA3_ROPE),
    "tied_bias": lambda: LlamaConfig(
        **TINY, tie_word_embeddings=True, attention_bias=True, mlp_bias=True
    ),
    "mistral_window": lambda: MistralConfig(**TINY, sliding_window=5),
}
PROMPTS = [
    [3, 17, 99, 4, 250],
    [7, 7, 1, 200, 45, 13, 8, 91, 120, 64, 5],
    [100, 2, 33, 44, 55, 66, 77, 88],
]


def build_pair(variant, tmp_path):
    torch.manual_seed(0)
    cfg = VARIANTS[variant]()
    cfg._attn_implementation = "eager"
    hf_cls = MistralForCausalLM if isinstance(cfg, MistralConfig) else LlamaForCausalLM
    hf = hf_cls(cfg).eval()
    with torch.no_grad():  # HF inits biases to zero; make them count
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    hf_config = json.loads((tmp_path / "config.json").read_text())
    mc = ModelConfig(architecture=hf_config["architectures"][0], hf_config=hf_config, dtype="f32")
    model = get_model_class(mc.architecture)(mc)
    model.load_weights(load_file(tmp_path / "model.safetensors").items())
    return hf, model, mc


class PagedRunner:
    """The scheduler's and worker's job in miniature: blocks, slots, metadata, caches."""

    def __init__(self, model, mc, block_size=4, num_blocks=64, seed=0):
        spec = KVCacheSpec(mc.num_layers, mc.num_kv_heads, mc.head_dim, block_size, torch.float32)
        self.model, self.block_size = model, block_size
        self.kv_caches = allocate_kv_cache(spec, num_blocks, "cpu")
        self.free = list(
            np.random.default_rng(seed).permutation(num_blocks)
        )  # non-contiguous tables
        self.blocks, self.computed = {}, {}

    def step(self, batch):
        """``batch``: (seq_id, new token ids) per sequence. Returns logits of each
        sequence's last new token ``[B, V]`` and of every token ``[T, V]``."""
        ids, positions, slots, qsl, seq_lens = [], [], [], [0], []
        for seq_id, toks in batch:
            start = self.computed.get(seq_id, 0)
            blocks = self.blocks.setdefault(seq_id, [])
            while len(blocks) * self.block_size < start + len(toks):
                blocks.append(self.free.pop())
            for p in range(start, start + len(toks)):
                slots.append(blocks[p // self.block_size] * self.block_size + p % self.block_size)
            ids += toks
            positions += range(start, start + len(toks))
            qsl.append(len(ids))
            seq_lens.append(start + len(toks))
            self.computed[seq_id] = start + len(toks)
        width = max(len(self.blocks[s]) for s, _ in batch)
        tables = np.array([self.blocks[s] + [-1] * (width - len(self.blocks[s])) for s, _ in batch])
        meta = AttentionMetadata.build(
            slot_mapping=np.array(slots),
            query_start_loc=np.array(qsl),
            seq_lens=np.array(seq_lens),
            block_tables=tables,
            device="cpu",
        )
        with torch.no_grad():
            hidden = self.model(
                torch.tensor(ids), torch.tensor(positions), meta, self.kv_caches
            )  # [T, hidden]
            all_logits = self.model.compute_logits(hidden)  # [T, V]
        return all_logits[torch.tensor(qsl[1:]) - 1], all_logits


def hf_logits(hf, prompt):
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0]  # [L, V]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_batched_prefill_logits_match_hf(variant, tmp_path):
    hf, model, mc = build_pair(variant, tmp_path)
    _, logits = PagedRunner(model, mc).step([(i, p) for i, p in enumerate(PROMPTS)])
    assert logits.dtype == torch.float32 and logits.shape == (sum(map(len, PROMPTS)), 256)
    want = torch.cat([hf_logits(hf, p) for p in PROMPTS])
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("variant", ["llama3_rope", "mistral_window"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_chunked_prefill_matches_hf(variant, block_size, tmp_path):
    hf, model, mc = build_pair(variant, tmp_path)
    prompt = PROMPTS[1]
    runner = PagedRunner(model, mc, block_size=block_size)
    runner.step([(0, prompt[:6])])
    last, _ = runner.step([(0, prompt[6:])])
    torch.testing.assert_close(last[0], hf_logits(hf, prompt)[-1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_decode_matches_hf_generate(variant, tmp_path):
    hf, model, mc = build_pair(variant, tmp_path)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    n_new = 16
    runner = PagedRunner(model, mc)
    out = {0: [], 1: [], 2: []}
    pending = {i: p for i, p in enumerate(PROMPTS)}
    # Prompt 2 joins at the third step, so that step mixes decodes with a prefill.
    for step in range(n_new + 2):
        batch = [(i, [out[i][-1]]) for i in out if out[i] and len(out[i]) < n_new]  # decodes first
        batch += [(i, pending.pop(i)) for i in list(pending) if i < 2 or step >= 2]
        if not batch:
            break
        last, _ = runner.step(batch)
        for (i, _), row in zip(batch, last):
            out[i].append(int(row.argmax()))
    for i, p in enumerate(PROMPTS):
        want = hf.generate(torch.tensor([p]), max_new_tokens=n_new, do_sample=False)[
            0, len(p) :
        ].tolist()
        assert out[i] == want, f"prompt {i}"


def test_load_errors_list_unknown_and_missing(tmp_path):
    _, model, _ = build_pair("llama3_rope", tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # ignored
    model.load_weights(state.items())
    with pytest.raises(
        WeightLoadError, match=r"does not know: model\.layers\.9\.mlp\.up_proj\.weight"
    ):
        model.load_weights(
            list(state.items()) + [("model.layers.9.mlp.up_proj.weight", torch.ones(1))]
        )
    missing = {
        k: v
        for k, v in state.items()
        if k not in ("lm_head.weight", "model.layers.1.self_attn.k_proj.weight")
    }
    with pytest.raises(
        WeightLoadError, match=r"lm_head\.weight, model\.layers\.1\.self_attn\.k_proj\.weight"
    ):
        model.load_weights(missing.items())
    bad = dict(state, **{"model.norm.weight": torch.ones(3)})
    with pytest.raises(WeightLoadError, match=r"model\.norm\.weight: shape mismatch"):
        model.load_weights(bad.items())


def test_dummy_weights_are_deterministic_and_run():
    mc = ModelConfig(architecture="LlamaForCausalLM", hf_config=dict(TINY), dtype="bf16")
    a, b = (get_model_class(mc.architecture)(mc) for _ in range(2))
    a.init_dummy_weights(7)
    b.init_dummy_weights(7)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert pa.dtype == torch.bfloat16 and torch.equal(pa, pb), name
    runner = PagedRunner(a, mc)
    runner.kv_caches = allocate_kv_cache(KVCacheSpec(2, 2, 16, 4, torch.bfloat16), 64, "cpu")
    last, _ = runner.step([(0, PROMPTS[0])])
    assert torch.isfinite(last).all()
