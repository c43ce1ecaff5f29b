"""Every GGUF architecture cvllm reads, kept quantized, agrees with the same file
dequantized to float at load (``dequantize=True``): a tiny random model of each, written
by ``tools/gguf_export`` at Q4_0, Q4_K, Q5_K, Q6_K and Q8_0, MoE experts included.

Models. The families' own tiny configs (``tests/models/test_family_*.py``), widened so
that the K-quants really apply: hidden 256, MLP 512, MoE experts 256, 4 heads of 64, 2
layers, vocabulary 256; every matrix row is whole 256-blocks, except DeepSeek's per-head
``attn_k_b`` / ``attn_v_b`` (32 / 128 per row), which cvllm reads back to float anyway.
``_check_file`` reads each written file back with ``gguf.GGUFReader``: every matrix whose
rows are whole 256-blocks has the intended type (none fell back), the embedding, the
output head and the expert stacks among them. MoE models route every token to every
expert (top-k = number of experts): the routing weights stay continuous, so a bf16-sized
change in the router's input cannot flip an expert choice, and each expert's quantized
weights count in every token.

Coverage: every architecture at every one of the five types (65 files, about 50 s on
one core); DeepSeek twice, as V2-Lite without q LoRA and as V3 with q LoRA, YaRN and
sigmoid routing.

Decisive models. Both runs use the same blocks; they differ only by the CPU kernel's bf16
activations and bf16 block scales and zeros (``kernels/quant/ggml_cpu.py``): 1-4% of the
logits' spread after two layers. A random model's top two logits are that close at a few
percent of its steps, so its greedy tokens would split on a near-tie, not on a bug.
Scaling the random weights up does not help: every difference scales with them, and
larger weights sharpen attention, which amplifies them (measured). So the models are made
decisive by construction (``_make_decisive``): the token embeddings are scaled to the size
of the layers' contribution to the residual stream (so about half of the final hidden
state comes from the layers), the output head's random rows are scaled to norm 0.3 and
each gains the unit embedding of a fixed permutation of the vocabulary. Each greedy step
then picks the current token's successor in that permutation by 4.5 or more logit
standard deviations, while every other logit stays a random projection of the final
hidden state, so an error anywhere in the layers still shows in them. ``_assert_decisive``
checks that margin (more than twice the logit bound at every step of the float run, so a
kept-quantized run within the bound picks the same tokens). The greedy check therefore
shows that the kept path's decoding (KV cache, batched decode steps) follows the same
sequence; the sensitivity lives in the logit bounds: an expert swapped in the quantized
MoE path moves the logits by 2-17 times the bound, Q4_K's zeros off by 2% by 2-4 times.

Tolerances, per row of logits (a prompt's last prefill position, or one decode step),
relative to that row's standard deviation over the vocabulary in the float run:
``max |kept - float| <= LOGIT_TOL[type] * std``, at the prefill and at each of the 15
decode steps that pick the 16 new tokens (compared once the tokens are known equal).
Largest values measured over the 13 models (AVX-512 CPU): Q4_0 0.021, Q4_K 0.030, Q5_K
0.038 (Gemma's; the others <= 0.030), Q8_0 0.019 (Gemma's the largest of each); the
bounds are 1.9-2.3 times those. Q6_K is kept as a dense copy in the activation dtype and
MoE experts are dequantized per call in it (no bf16 step), so Q6_K files must agree to
float32 rounding (measured: exactly). Greedy tokens: equal, 16 new tokens for each of
the 3 prompts, prompted together.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import gguf
import pytest
import torch

from cvllm.engine.llm import LLM
from cvllm.quantization.gguf_methods import GGUFMoEMethod
from cvllm.quantization.summary import weight_summary
from cvllm.sampling_params import SamplingParams
from tests.models import deepseek_tiny
from tests.models.family_harness import NEW_TOKENS, PROMPTS, _tokenizer, randomize_
from tools.gguf_export import exporter_for
from tools.gguf_export.common import QuantPlan

pytestmark = pytest.mark.slow

LOGIT_TOL: Dict[str, float] = {"Q4_0": 0.04, "Q4_K": 0.07, "Q5_K": 0.08, "Q6_K": 1e-5, "Q8_0": 0.04}
"""max |kept - float| logit difference per row, in units of the row's std (docstring)."""

WIDE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, vocab_size=256,
            tie_word_embeddings=False, initializer_range=0.02)
"""Overrides of the families' tiny configs: rows of whole 256-blocks, untied heads, and
transformers' default initializer_range (Gemma's family test uses 0.3 so that its softcaps
bite; weights that large sharpen attention until a bf16 rounding moves the logits by 10%
of their spread instead of 2%)."""
HEAD_DIM = 64  # 4 heads x 64 = 256 input features for every attention output projection
MOE = dict(moe_intermediate_size=256, num_experts=4, num_experts_per_tok=4)

SEED = 0
HEAD_RANDOM = 0.3
"""RMS norm of the output head's random rows, beside the unit successor row each gains."""


# ----------------------------------------------------------------------- model builders

def _seeded(make: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    torch.manual_seed(SEED)
    hf = make()
    randomize_(hf, SEED)
    return hf


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.models.test_family_llama import TINY

    return _seeded(lambda: LlamaForCausalLM(LlamaConfig(**{**TINY, **WIDE, "head_dim": HEAD_DIM})))


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.models.test_family_qwen2 import TINY

    return _seeded(lambda: Qwen2ForCausalLM(Qwen2Config(**{**TINY, **WIDE})))


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tests.models.test_family_qwen3 import TINY

    return _seeded(lambda: Qwen3ForCausalLM(Qwen3Config(**{**TINY, **WIDE, "head_dim": HEAD_DIM})))


def _qwen2moe():
    from tests.models.test_family_qwen2_moe import _tiny

    return _tiny(SEED, **WIDE, **MOE, shared_expert_intermediate_size=512)


def _qwen3moe():
    from tests.models.test_family_qwen3_moe import _tiny

    return _tiny(SEED, **WIDE, **MOE, head_dim=HEAD_DIM, norm_topk_prob=True)


def _phi2():
    from tests.models.test_family_phi import _tiny

    # llama.cpp's phi2: MHA, no q/k norm (as test_phi_gguf); fused attn_qkv.
    return _tiny(SEED, **WIDE, num_key_value_heads=4, qk_layernorm=False)


def _phi3():
    from tests.models.test_family_phi3 import _config, _tiny

    return _tiny(_config(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **WIDE),
                 SEED)


def _stablelm():
    from tests.models.test_family_stablelm import _tiny

    return _tiny(SEED, **WIDE)


def _gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from tests.models.test_family_gemma2 import TINY

    return _seeded(lambda: Gemma2ForCausalLM(Gemma2Config(
        **{**TINY, **WIDE}, head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM, sliding_window=6)))


def _gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from tests.models.test_family_gemma2 import TINY

    return _seeded(lambda: Gemma3ForCausalLM(Gemma3TextConfig(
        **{**TINY, **WIDE}, head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM, sliding_window=6)))


def _glm4():
    from transformers import Glm4Config, Glm4ForCausalLM

    from tests.models.test_family_glm4 import TINY

    return _seeded(lambda: Glm4ForCausalLM(Glm4Config(**{**TINY, **WIDE, "head_dim": HEAD_DIM})))


_DEEPSEEK = dict(WIDE, moe_intermediate_size=256, kv_lora_rank=128, qk_rope_head_dim=32,
                 qk_nope_head_dim=32, v_head_dim=HEAD_DIM, n_routed_experts=4,
                 num_experts_per_tok=4, n_group=1, topk_group=1)


def _deepseek_v2():
    cfg = deepseek_tiny.v2_config(**_DEEPSEEK, attention_bias=False, mlp_bias=False)
    return deepseek_tiny.build(cfg, seed=SEED)


def _deepseek_v3():
    yarn = dict(deepseek_tiny.V3_YARN, mscale=0.8)  # llama.cpp stores one mscale
    cfg = deepseek_tiny.v3_config(**_DEEPSEEK, q_lora_rank=256, rope_parameters=yarn)
    return deepseek_tiny.build(cfg, seed=SEED)


BUILDERS: Dict[str, Callable[[], torch.nn.Module]] = {
    "llama": _llama, "qwen2": _qwen2, "qwen3": _qwen3, "qwen2moe": _qwen2moe,
    "qwen3moe": _qwen3moe, "phi2": _phi2, "phi3": _phi3, "stablelm": _stablelm,
    "gemma2": _gemma2, "gemma3": _gemma3, "glm4": _glm4,
    "deepseek2-v2": _deepseek_v2, "deepseek2-v3": _deepseek_v3,
}
MOE_ARCHS = {"qwen2moe", "qwen3moe", "deepseek2-v2", "deepseek2-v3"}

TYPES = ("Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q8_0")
CASES: List[Tuple[str, str]] = [(arch, t) for arch in BUILDERS for t in TYPES]


# ------------------------------------------------------------------------ decisive models

def _residual_rms(hf) -> Tuple[float, float]:
    """RMS of the embedding as it enters the first layer (Gemma's sqrt(hidden) scaling
    included) and of what the layers add to it by the final norm, over PROMPTS[1]."""
    got: Dict[str, torch.Tensor] = {}

    def first(module, args, kwargs):
        got.setdefault("emb", (args[0] if args else kwargs["hidden_states"]).detach().clone())

    def last(module, args):
        got["out"] = args[0].detach().clone()

    inner = hf.model
    final_norm = getattr(inner, "norm", None) or inner.final_layernorm
    hooks = [inner.layers[0].register_forward_pre_hook(first, with_kwargs=True),
             final_norm.register_forward_pre_hook(last)]
    try:
        with torch.no_grad():
            hf(torch.tensor([PROMPTS[1]]))
    finally:
        for h in hooks:
            h.remove()
    emb, out = got["emb"], got["out"]  # [1, T, hidden] each
    return emb.pow(2).mean().sqrt().item(), (out - emb).pow(2).mean().sqrt().item()


def _make_decisive(hf, seed: int = SEED) -> None:
    """Embeddings as large as the layers' contribution; output-head row ``j`` gains the
    unit embedding of token ``perm[j]`` (see the module docstring)."""
    emb_rms, layers_rms = _residual_rms(hf)
    perm = torch.randperm(hf.config.vocab_size, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        emb = hf.get_input_embeddings().weight  # [V, hidden]
        emb.mul_(layers_rms / emb_rms)
        head = hf.get_output_embeddings().weight  # [V, hidden]
        head.mul_(HEAD_RANDOM / head.norm(dim=-1).pow(2).mean().sqrt())
        head.add_(torch.nn.functional.normalize(emb, dim=-1)[perm])


@functools.lru_cache(maxsize=2)
def _model(arch: str):
    hf = BUILDERS[arch]().eval()
    _make_decisive(hf)
    return hf


# ------------------------------------------------------------------------------- checks

@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matmuls gain nothing from threads; on a shared CPU the thread hand-offs cost
    milliseconds per op (measured: the file takes 10x longer with 2 threads while another
    process keeps a core busy)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory) -> Path:
    """One folder with the default model's tokenizer (ids < 256 decode) for every file."""
    folder = tmp_path_factory.mktemp("gguf_families")
    _tokenizer().save_pretrained(folder)
    return folder


def _check_file(path: Path, qtype: str, moe: bool) -> None:
    """Every matrix whose rows are whole 256-blocks has ``qtype`` (vectors, norms and
    routers stay F32 as llama.cpp keeps them); those include the embedding, the output
    head and (MoE) every expert stack, and hold at least 90% of the matrix elements."""
    typed, elements, total = set(), 0, 0
    for t in gguf.GGUFReader(str(path)).tensors:
        name, row = t.name, int(t.shape[0])  # GGUF lists dims fastest first: shape[0] = row
        if len(t.shape) < 2 or "norm" in name or "ffn_gate_inp" in name:
            continue
        total += int(t.n_elements)
        if t.tensor_type.name == qtype:
            typed.add(name)
            elements += int(t.n_elements)
        else:
            assert row % 256, f"{name}: rows of {row} stored as {t.tensor_type.name}, not {qtype}"
    assert {"token_embd.weight", "output.weight"} <= typed, sorted(typed)
    assert not moe or any("_exps." in n for n in typed), sorted(typed)
    assert elements >= 0.9 * total, f"only {elements / total:.0%} of the weights are {qtype}"


def _run(path: Path, dequantize: bool, qtype: str, moe: bool):
    """One batched greedy generation of PROMPTS: (tokens per prompt, logits of every step
    ``[3, V]`` (prefill first))."""
    llm = LLM(weight_path=str(path.parent), weight_file=path.name, cpu=True, max_model_len=64,
              kvcache_mem_mb=16, dequantize=dequantize)
    model = llm.engine.runner.model
    per_type, _ = weight_summary(model)
    if dequantize:
        assert set(per_type) == {"f32"}, per_type
    else:
        assert qtype in per_type, per_type
        if moe:
            methods = [m.quant_method for m in model.modules() if hasattr(m, "w13_weight")]
            assert methods and all(isinstance(m, GGUFMoEMethod) for m in methods), methods
    seen: List[torch.Tensor] = []
    original = model.compute_logits

    def spy(hidden):
        logits = original(hidden)
        seen.append(logits.detach().float().clone())
        return logits

    model.compute_logits = spy
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        tokens = [r.token_ids for r in llm.generate([list(p) for p in PROMPTS], params)]
    finally:
        model.compute_logits = original
    assert len(seen) == NEW_TOKENS and all(s.shape[0] == len(PROMPTS) for s in seen), \
        "expected one batched prefill, then one batched decode step per token"
    return tokens, seen


def _rel_errors(kept: List[torch.Tensor], floats: List[torch.Tensor]) -> torch.Tensor:
    """``[steps, prompts]`` max |kept - float| over the vocabulary / std of the float row."""
    return torch.stack([(k - f).abs().amax(-1) / f.std(-1) for k, f in zip(kept, floats)])


def _assert_decisive(floats: List[torch.Tensor], tol: float) -> None:
    """Top-1 minus top-2 logit of every float step exceeds 2 * tol stds: a run within the
    bound cannot pick another token."""
    for step, f in enumerate(floats):
        top = f.topk(2, dim=-1).values  # [3, 2]
        margin = ((top[:, 0] - top[:, 1]) / f.std(-1)).min().item()
        assert margin > 2 * tol, (f"test model not decisive: step {step} has a top-2 margin of "
                                  f"{margin:.3f} std <= 2 * {tol}")


@pytest.mark.parametrize("arch,qtype", CASES, ids=[f"{a}-{t}" for a, t in CASES])
def test_kept_quantized_matches_dequantized(arch, qtype, gguf_dir):
    hf = _model(arch)
    path = exporter_for(hf.config)(hf, gguf_dir / f"{arch}-{qtype}.gguf", plan=QuantPlan(qtype))
    moe = arch in MOE_ARCHS
    _check_file(path, qtype, moe)
    tol = LOGIT_TOL[qtype]
    kept_tokens, kept = _run(path, dequantize=False, qtype=qtype, moe=moe)
    float_tokens, floats = _run(path, dequantize=True, qtype=qtype, moe=moe)
    _assert_decisive(floats, tol)
    prefill = _rel_errors(kept[:1], floats[:1]).max().item()
    assert prefill <= tol, f"prefill logits differ by {prefill:.3g} std > {tol}"
    assert kept_tokens == float_tokens
    worst = _rel_errors(kept, floats).max().item()
    assert worst <= tol, f"decode logits differ by {worst:.3g} std > {tol}"
