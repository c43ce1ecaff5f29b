"""The CPU's flat decode loop (``models/flat_decode.py``) computes what the model's forward
computes, bit for bit: at every pure-decode step of a generation the module path runs
first, then the flat loop on the same inputs (it rewrites the same K/V values into the
same slots), and the two hidden states must be equal (``torch.equal``: the loop calls the
same functions in the same order, so no tolerance). Covered: one stream (attention over
views of consecutive blocks), several streams of different lengths (gathered blocks), a
sliding window shorter than the context (Mistral), q/k/v biases (Qwen2), per-head q/k
norms (Qwen3), weights kept quantized by ``--isq`` at Q4_0 (the int4 kernel called
directly) and Q8_0 (two planes), bf16 activations and an FP8 KV cache; then every family
of ``tools/greedy_tokens.py``: compared where the loop serves it, no loop built elsewhere."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import pytest
import torch

from cvllm.engine.llm import LLM
from cvllm.sampling_params import SamplingParams
from tests.worker.tiny_llama import LLAMA_CFG, VOCAB, word_tokenizer
from tools.greedy_tokens import FAMILIES, save_family

PROMPTS = [[1, 5, 9, 13, 17], [1] + [7] * 20 + [3], [1, 22, 40]]
"""Lengths 5, 22 and 3: across block boundaries (block size 8), decoded together."""


def _save(folder: Path, arch: str, **overrides) -> Path:
    """A tiny random HF model of ``arch`` (llama, mistral, qwen2, qwen3) with a tokenizer."""
    import transformers

    names = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3",
             "qwen3_moe": "Qwen3Moe"}
    cfg = {k: v for k, v in LLAMA_CFG.items() if k not in ("architectures", "model_type")}
    cfg.update(overrides)
    torch.manual_seed(0)
    config = getattr(transformers, f"{names[arch]}Config")(**cfg)
    model = getattr(transformers, f"{names[arch]}ForCausalLM")(config)
    with torch.no_grad():  # norms apart from ones: a swapped or skipped one shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(folder, safe_serialization=True)
    word_tokenizer(VOCAB).save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    return folder


def _llm(folder: Optional[Path], **kw) -> LLM:
    opts = dict(weight_path=str(folder), cpu=True, dtype="f32", max_model_len=128,
                kvcache_mem_mb=8, block_size=8)
    opts.update(kw)
    return LLM(**opts)


def _checked_generation(llm: LLM, prompts: List[List[int]], tokens: int = 10) -> int:
    """Generate with every pure-decode step run by both paths, compared; the number of
    steps compared."""
    runner = llm.engine.runner
    flat, compared = runner.flat, []
    assert flat is not None

    def both(input_ids, positions, meta, kv_caches):
        ref = runner.model(input_ids, positions, meta, kv_caches)  # [T, hidden]
        out = flat(input_ids, positions, meta, kv_caches)
        assert out.dtype == ref.dtype and out.shape == ref.shape
        diff = (out.float() - ref.float()).abs().max().item()
        assert torch.equal(out, ref), f"step {len(compared)}: max |diff| {diff:.3e}"
        compared.append(input_ids.shape[0])
        return out

    runner.flat = both
    try:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        outs = llm.generate(prompts, params)
    finally:
        runner.flat = flat
    assert all(len(o.token_ids) == tokens for o in outs)
    return len(compared)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return _save(tmp_path_factory.mktemp("flat-llama"), "llama")


@pytest.mark.parametrize("kw", [{}, {"isq": "q4_0"}, {"isq": "q8_0"}, {"dtype": "bf16"},
                                {"fp8_kvcache": True}],
                         ids=["f32", "q4_0", "q8_0", "bf16", "fp8-kv"])
def test_flat_decode_equals_module_path_llama(llama_dir: Path, kw) -> None:
    llm = _llm(llama_dir, **kw)
    assert _checked_generation(llm, PROMPTS[:1]) == 9  # one stream: cache views
    assert _checked_generation(llm, PROMPTS) >= 9  # three streams: gathered blocks


def test_flat_decode_sliding_window_biases_and_qk_norms(tmp_path: Path) -> None:
    mistral = _llm(_save(tmp_path / "mistral", "mistral", sliding_window=6))
    assert _checked_generation(mistral, PROMPTS) >= 9  # contexts past the window
    qwen2 = _llm(_save(tmp_path / "qwen2", "qwen2"))
    assert qwen2.engine.runner.model.model.layers[0].self_attn.qkv_proj.bias is not None
    assert _checked_generation(qwen2, PROMPTS) >= 9
    qwen3 = _llm(_save(tmp_path / "qwen3", "qwen3"), isq="q4_0")
    assert _checked_generation(qwen3, PROMPTS[:1]) == 9
    assert _checked_generation(qwen3, PROMPTS) >= 9


def test_flat_decode_only_where_the_layers_are_llamas(tmp_path: Path, llama_dir: Path) -> None:
    # Qwen3-MoE's layers route tokens to experts: their own MLP, so no flat loop.
    moe = _llm(_save(tmp_path / "moe", "qwen3_moe", num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=64))
    assert moe.engine.runner.flat is None
    assert moe.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=3))
    # --disable-cuda-graph: every step through the modules on the CPU too
    assert _llm(llama_dir, disable_cuda_graph=True).engine.runner.flat is None


FLAT_FAMILIES = {"llama", "llama_tied_bias_yarn", "llama_isq_q4_0", "mistral", "phi3", "qwen2",
                 "qwen3", "qwen3_isq_q4_0"}
"""The families of ``tools/greedy_tokens.py`` whose blocks the flat loop serves."""


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_flat_decode_equals_the_blocks_of_every_family(tmp_path: Path, family: str) -> None:
    """Every family's tiny model (``tools/greedy_tokens.py``): where the flat loop serves
    it, equal to the blocks' forwards at every decode step; elsewhere not built."""
    llm = _llm(None, **save_family(family, tmp_path / family))
    if family not in FLAT_FAMILIES:
        assert llm.engine.runner.flat is None
        return
    assert _checked_generation(llm, PROMPTS) >= 9


def test_a_subclass_that_overrides_what_the_loop_copies_is_refused(llama_dir: Path) -> None:
    """Eligibility follows the classes' code: override any method the loop reproduces
    (the model's, a layer's attention, its rotation) and the model keeps its forward."""
    from cvllm.models.flat_decode import build_flat_decoder

    model = _llm(llama_dir).engine.runner.model
    assert build_flat_decoder(model) is not None
    attn = model.model.layers[1].self_attn
    for obj, method in ((model, "forward"), (attn, "forward"),
                        (attn.rotary_emb, "_rotate_neox_full"), (attn.rotary_emb, "_neox_rows")):
        cls = type(obj)

        def changed(self, *args, _orig=getattr(cls, method), **kwargs):
            return _orig(self, *args, **kwargs)  # what a subclass might add goes here

        obj.__class__ = type(f"Changed{cls.__name__}", (cls,), {method: changed})
        try:
            assert build_flat_decoder(model) is None, (cls.__name__, method)
        finally:
            obj.__class__ = cls
    assert build_flat_decoder(model) is not None
