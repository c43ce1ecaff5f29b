#!/usr/bin/env python3
"""Greedy tokens of every model family cvllm serves, on the CPU, as one JSON: the record
that a refactor of the model code changed no output.

    python -m tools.greedy_tokens --out before.json        # from the repository root
    python -m tools.greedy_tokens --out after.json --compare before.json
    python -m tools.greedy_tokens --compare-only before.json after.json
    python -m tools.greedy_tokens --families llama,qwen3   # a subset (names: --list)

Each family is a tiny random Hugging Face model of its architecture (the shapes and
switches of the parity tests in ``tests/models/``: sliding windows shorter than the
prompts, biases, q/k norms, softcaps, partial rotary, MoE, MLA, hybrid linear attention),
saved with ``save_pretrained`` and served by cvllm's offline ``LLM`` (loader -> runner ->
scheduler -> sampler) in float32, plus the default GGUF model (SmolLM2-135M-Instruct
Q4_1) when it is in ``~/.cache/cvllm/models``. Every model generates ``--tokens`` greedy
tokens for three prompts as one batch and for the first prompt alone, twice: with the
CPU's flat decode loop where the model qualifies (the default), and with
``--disable-cuda-graph`` (every step through the modules). The JSON holds, per family
and mode, the token ids, and whether the flat loop served the decode steps.

``--compare`` exits 1 and names each difference (tokens, or which path decoded) when two
records differ; ``tests/tools/test_greedy_tokens.py`` compares the two committed under
``docs/benchmarks/``. About two minutes on two cores (one torch thread).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import torch

PROMPTS: List[List[int]] = [
    [3, 17, 99, 4, 250, 31, 8],
    [7, 7, 1, 200, 45, 13, 8, 91, 120, 64, 5, 19, 23, 150, 77, 60, 2, 11, 34],
    [100, 2, 33, 44, 55, 66, 77, 88, 99, 110, 121, 132, 143],
]
"""Lengths 7, 19 and 13 (blocks of 8: across block boundaries); ids below 256."""
MODES = {"default": {}, "disable_cuda_graph": {"disable_cuda_graph": True}}
DEFAULT_GGUF = Path("~/.cache/cvllm/models/SmolLM2-135M-Instruct.Q4_1.gguf").expanduser()
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
            initializer_range=0.2, tie_word_embeddings=False)
"""Weights large enough that logits are far from flat (greedy tokens away from ties);
untied, so that a token's own embedding does not dominate its next one."""


def _randomize(hf: torch.nn.Module, seed: int, std: float = 0.1) -> None:
    """Norms, biases and other vectors away from their initial 1 / 0, so that they count."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name or p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=g) * std)


def _build(cls_name: str, cfg_name: str, seed: int = 0, **kw) -> torch.nn.Module:
    import transformers

    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_name)(**kw)
    hf = getattr(transformers, cls_name)(cfg)
    _randomize(hf, seed)
    return hf


def _deepseek(version: int) -> torch.nn.Module:
    """tests/models/deepseek_tiny.py's shapes: a dense then a MoE layer, grouped routing,
    shared experts, v_head_dim != qk_nope_head_dim; V3 with q LoRA and YaRN."""
    common = dict(TINY, intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=4,
                  kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=12,
                  n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                  first_k_dense_replace=1)
    if version == 2:
        kw = dict(common, q_lora_rank=None, n_shared_experts=2, topk_method="group_limited_greedy",
                  topk_group=1, routed_scaling_factor=1.5, attention_bias=True, mlp_bias=True,
                  norm_topk_prob=False)
    else:
        yarn = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                    original_max_position_embeddings=32, beta_fast=32.0, beta_slow=1.0,
                    mscale=1.0, mscale_all_dim=0.8)
        kw = dict(common, q_lora_rank=24, n_shared_experts=1, routed_scaling_factor=2.5,
                  norm_topk_prob=True, rope_parameters=yarn, rope_interleave=True)
    name = f"DeepseekV{version}"
    hf = _build(f"{name}ForCausalLM", f"{name}Config", seed=version, **kw)
    with torch.no_grad():  # expert choices far from ties, V3's score bias non-zero
        g = torch.Generator().manual_seed(version + 1)
        for pname, t in list(hf.named_parameters()) + list(hf.named_buffers()):
            if pname.endswith("mlp.gate.weight"):
                t.mul_(20.0)
            elif pname.endswith("e_score_correction_bias"):
                t.copy_(torch.randn(t.shape, generator=g) * 0.2)
    return hf


def _qwen3_next(kind: str) -> torch.nn.Module:
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    import transformers

    common = dict(TINY, num_hidden_layers=4, head_dim=16, linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                  linear_conv_kernel_dim=4)
    common.pop("intermediate_size")
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
               shared_expert_intermediate_size=48)
    torch.manual_seed(0)
    if kind == "next":
        hf = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
            **common, **moe, intermediate_size=96, mlp_only_layers=[1], norm_topk_prob=False,
            attention_bias=True))
    elif kind == "3.5":
        hf = transformers.Qwen3_5ForCausalLM(Qwen3_5TextConfig(
            **common, intermediate_size=96,
            layer_types=["linear_attention", "full_attention"] * 2))
    else:
        hf = transformers.Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**common, **moe))
    _randomize(hf, 0)
    return hf


def _gemma(version: int, conditional: bool = False) -> torch.nn.Module:
    import transformers

    tiny = dict(TINY, num_hidden_layers=4, head_dim=32,
                query_pre_attn_scalar=24, sliding_window=6)
    if version == 2:
        return _build("Gemma2ForCausalLM", "Gemma2Config", attn_logit_softcapping=4.0,
                      final_logit_softcapping=3.0, **tiny)
    s, f = "sliding_attention", "full_attention"
    text = dict(tiny, layer_types=[s, s, f, s], rope_parameters={
        f: {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0},
        s: {"rope_type": "default", "rope_theta": 50.0}})
    if not conditional:
        return _build("Gemma3ForCausalLM", "Gemma3TextConfig", **text)
    torch.manual_seed(2)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=32, patch_size=8)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                    boi_token_index=253, eoi_token_index=254,
                                    image_token_index=255, tie_word_embeddings=False,
                                    initializer_range=0.2)
    hf = transformers.Gemma3ForConditionalGeneration(cfg)
    _randomize(hf, 2)
    return hf


def _phi3() -> torch.nn.Module:
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0 + 0.05 * i for i in range(6)],
            "long_factor": [1.5 + 0.7 * i for i in range(6)]}
    return _build("Phi3ForCausalLM", "Phi3Config", **TINY, original_max_position_embeddings=6,
                  rope_parameters=rope, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  sliding_window=9)


def _stablelm(parallel: bool) -> torch.nn.Module:
    return _build("StableLmForCausalLM", "StableLmConfig", **TINY, partial_rotary_factor=0.25,
                  layer_norm_eps=1e-5, use_qkv_bias=True, qk_layernorm=True,
                  use_parallel_residual=parallel, bos_token_id=1, eos_token_id=2)


def _moe(name: str, **kw) -> torch.nn.Module:
    base = dict(TINY, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1], norm_topk_prob=True)
    return _build(f"{name}ForCausalLM", f"{name}Config", **base, **kw)


# family -> (HF model builder, extra LLM options)
FAMILIES: Dict[str, Tuple[Callable[[], torch.nn.Module], dict]] = {
    "llama": (lambda: _build("LlamaForCausalLM", "LlamaConfig", **TINY, head_dim=16), {}),
    "llama_tied_bias_yarn": (lambda: _build(
        "LlamaForCausalLM", "LlamaConfig", **dict(TINY, tie_word_embeddings=True), attention_bias=True,
        mlp_bias=True, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                        "original_max_position_embeddings": 32}), {}),
    "llama_isq_q4_0": (lambda: _build("LlamaForCausalLM", "LlamaConfig", **TINY), {"isq": "q4_0"}),
    "mistral": (lambda: _build("MistralForCausalLM", "MistralConfig", **TINY, head_dim=16,
                               sliding_window=5), {}),
    "qwen2": (lambda: _build("Qwen2ForCausalLM", "Qwen2Config", **dict(TINY, num_hidden_layers=3),
                             use_sliding_window=True, sliding_window=5, max_window_layers=1), {}),
    "qwen3": (lambda: _build("Qwen3ForCausalLM", "Qwen3Config", **TINY, head_dim=32,
                             attention_bias=True, use_sliding_window=True, sliding_window=6,
                             max_window_layers=1), {}),
    "qwen3_isq_q4_0": (lambda: _build("Qwen3ForCausalLM", "Qwen3Config", **TINY, head_dim=32),
                       {"isq": "q4_0"}),
    "qwen2_moe": (lambda: _moe("Qwen2Moe", shared_expert_intermediate_size=48), {}),
    "qwen3_moe": (lambda: _moe("Qwen3Moe", head_dim=24), {}),
    "qwen3_next": (lambda: _qwen3_next("next"), {}),
    "qwen3_5": (lambda: _qwen3_next("3.5"), {}),
    "qwen3_5_moe": (lambda: _qwen3_next("3.5-moe"), {}),
    "gemma2": (lambda: _gemma(2), {}),
    "gemma3": (lambda: _gemma(3), {}),
    "gemma3_conditional": (lambda: _gemma(3, conditional=True), {}),
    "phi": (lambda: _build("PhiForCausalLM", "PhiConfig", **dict(TINY, intermediate_size=256),
                           partial_rotary_factor=0.5, hidden_act="gelu_new", qk_layernorm=True),
            {}),
    "phi3": (_phi3, {}),
    "stablelm_parallel": (lambda: _stablelm(True), {}),
    "stablelm_sequential": (lambda: _stablelm(False), {}),
    "glm4": (lambda: _build("Glm4ForCausalLM", "Glm4Config", **TINY, head_dim=32,
                            attention_bias=True, pad_token_id=None, eos_token_id=2), {}),
    "deepseek_v2": (lambda: _deepseek(2), {}),
    "deepseek_v3": (lambda: _deepseek(3), {}),
}
GGUF_FAMILY = "smollm2_gguf_q4_1"


def _word_tokenizer(folder: Path) -> None:
    """A word-level tokenizer over the tiny vocabulary, written beside the weights (the
    prompts are token ids; the engine only needs one to detokenize)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t1", eos_token="t2",
                            unk_token="t0").save_pretrained(folder)


def save_family(name: str, folder: Path) -> dict:
    """Write family ``name``'s tiny HF model and a tokenizer into ``folder``; the
    ``LLM`` options to serve it with (``weight_path`` and the family's own)."""
    build, options = FAMILIES[name]
    build().save_pretrained(folder, safe_serialization=True)
    _word_tokenizer(folder)
    return {"weight_path": str(folder), **options}


def _generate(options: dict, tokens: int) -> dict:
    from cvllm.engine.llm import LLM
    from cvllm.sampling_params import SamplingParams

    out = {}
    for mode, extra in MODES.items():
        llm = LLM(cpu=True, dtype="f32", max_model_len=128, kvcache_mem_mb=16, block_size=8,
                  **options, **extra)
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        batch = llm.generate([list(p) for p in PROMPTS],
                             SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True,
                                            logprobs=0))
        single = llm.generate([list(PROMPTS[0])], params)[0].token_ids
        out[mode] = {"batch": [r.token_ids for r in batch], "single": single,
                     "logprobs": [[lp.logprob for lp in r.logprobs] for r in batch],
                     "flat_decode": llm.engine.runner.flat is not None}
    return out


def run(families: List[str], tokens: int, log=print) -> dict:
    record: dict = {}
    with tempfile.TemporaryDirectory(prefix="greedy-tokens-") as tmp:
        for name in families:
            t0 = time.perf_counter()
            if name == GGUF_FAMILY:
                record[name] = _generate({"weight_file": str(DEFAULT_GGUF)}, tokens)
            else:
                record[name] = _generate(save_family(name, Path(tmp) / name), tokens)
            log(f"{name}: {time.perf_counter() - t0:.1f} s")
    return record


def compare(before: dict, after: dict) -> List[str]:
    """Each difference between two records, as a line (none: equal)."""
    diffs = [f"{name}: only in the first" for name in before if name not in after]
    diffs += [f"{name}: only in the second" for name in after if name not in before]
    for name in before:
        if name not in after:
            continue
        for mode in sorted(set(before[name]) | set(after[name])):
            a, b = before[name].get(mode), after[name].get(mode)
            if a != b:
                keys = sorted(k for k in set(a or {}) | set(b or {})
                              if (a or {}).get(k) != (b or {}).get(k))
                diffs.append(f"{name} [{mode}]: {', '.join(keys) or 'missing'} differ")
    return diffs


def _all_families() -> List[str]:
    return list(FAMILIES) + ([GGUF_FAMILY] if DEFAULT_GGUF.is_file() else [])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the record here (JSON)")
    ap.add_argument("--compare", metavar="JSON", help="compare the new record with this one")
    ap.add_argument("--compare-only", nargs=2, metavar=("A", "B"),
                    help="compare two records, run nothing")
    ap.add_argument("--families", help="comma-separated subset (default: all)")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (tiny matmuls)")
    ap.add_argument("--list", action="store_true", help="print the family names")
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join(_all_families()))
        return 0
    if args.compare_only:
        a, b = (json.loads(Path(p).read_text()) for p in args.compare_only)
        return _report(compare(a, b))
    torch.set_num_threads(args.threads)
    names = args.families.split(",") if args.families else _all_families()
    unknown = [n for n in names if n not in FAMILIES and n != GGUF_FAMILY]
    if unknown:
        ap.error(f"unknown families {unknown}; --list names them")
    import cvllm

    print(f"cvllm from {Path(cvllm.__file__).parent}", file=sys.stderr)
    record = run(names, args.tokens, log=lambda m: print(m, file=sys.stderr))
    text = _dumps(record)
    if args.out:
        Path(args.out).write_text(text + "\n")
    else:
        print(text)
    if args.compare:
        return _report(compare(json.loads(Path(args.compare).read_text()), record))
    return 0


def _dumps(record: dict) -> str:
    """JSON with one line per family and mode (diffs stay readable)."""
    rows = []
    for name in sorted(record):
        modes = ",\n".join(f'  "{mode}": {json.dumps(record[name][mode], sort_keys=True)}'
                            for mode in sorted(record[name]))
        rows.append(f' "{name}": {{\n{modes}\n }}')
    return "{\n" + ",\n".join(rows) + "\n}"


def _report(diffs: List[str]) -> int:
    for line in diffs:
        print(line)
    print("equal" if not diffs else f"{len(diffs)} difference(s)")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
