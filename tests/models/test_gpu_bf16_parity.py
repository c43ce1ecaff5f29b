"""bf16 greedy parity with transformers on a CUDA GPU, per model family (skipped without one).

Each family's tiny random model is the one its CPU parity test builds (the config builders
are imported from those modules), plus a larger random Llama-shaped model. The f32 weights
are saved with ``save_pretrained`` and a word-level tokenizer (no download), then read by
both sides in bf16: transformers (eager attention, greedy ``generate``) and cvllm's real
engine (``LLM(weight_path=..., dtype="bf16")``, default attention backend, CUDA graphs on
where the model allows them -- not for MLA or linear-attention layers -- the three
prompts as one batch). 32 new tokens, EOS ignored.

Acceptance (issue 4): per prompt, the tokens agree up to the first position ``k`` where
they differ; at ``k`` the context (prompt + the common prefix) is the same on both sides,
so each side's top 5 there is read from its own generation -- HF's raw logits of step
``k``, cvllm's ``logprobs=5`` -- and each side's token must be in the other's top 5. As a
guard against a broken model that still passes a top-5 test, the two sides'
log-probabilities of cvllm's top tokens must stay within ``LOGPROB_ATOL`` at every
compared position.
"""

from __future__ import annotations

import gc
from typing import Callable, Dict, List, Tuple

import pytest
import torch

from cvllm.sampling_params import SamplingParams
from tests.models import deepseek_tiny
from tests.models.family_harness import PROMPTS, randomize_
from tests.worker.tiny_llama import word_tokenizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

NEW_TOKENS = 32
TOP = 5
LOGPROB_ATOL = 1.0  # loose: only a broken model drifts a whole nat in bf16


def _seeded(cls, cfg, seed: int = 0, perturb: bool = True):
    torch.manual_seed(seed)
    hf = cls(cfg)
    if perturb:
        randomize_(hf, seed)
    return hf.eval()


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    from tests.models.test_family_llama import TINY, VARIANTS

    return _seeded(LlamaForCausalLM, LlamaConfig(**TINY, **VARIANTS["llama3"]))


def _llama_large():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                      num_attention_heads=16, num_key_value_heads=4, head_dim=64, vocab_size=1024,
                      max_position_embeddings=128, tie_word_embeddings=False)
    return _seeded(LlamaForCausalLM, cfg, perturb=False)


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM
    from tests.models.test_family_mistral import WINDOW

    cfg = MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        max_position_embeddings=128, sliding_window=WINDOW, rms_norm_eps=1e-5,
                        tie_word_embeddings=False)
    return _seeded(MistralForCausalLM, cfg)


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from tests.models.test_family_qwen2 import TINY

    return _seeded(Qwen2ForCausalLM, Qwen2Config(**TINY, use_sliding_window=True, sliding_window=5,
                                                 max_window_layers=1, tie_word_embeddings=True))


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from tests.models.test_family_qwen3 import TINY

    return _seeded(Qwen3ForCausalLM, Qwen3Config(**TINY, head_dim=32, attention_bias=True,
                                                 tie_word_embeddings=True, use_sliding_window=True,
                                                 sliding_window=6, max_window_layers=1))


def _qwen2_moe():
    from tests.models.test_family_qwen2_moe import _tiny

    return _tiny(0, num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True).eval()


def _qwen3_moe():
    from tests.models.test_family_qwen3_moe import _tiny

    return _tiny(0, num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True).eval()


def _qwen3_next_like(which: str, seed: int):
    import transformers
    from tests.models import test_family_qwen3_next as q

    cls, cfg = {"next": ("Qwen3NextForCausalLM", q.qwen3_next_config),
                "3_5": ("Qwen3_5ForCausalLM", q.qwen3_5_config),
                "3_5_moe": ("Qwen3_5MoeForCausalLM", q.qwen3_5_moe_config)}[which]
    return _seeded(getattr(transformers, cls), cfg(), seed)


def _phi():
    from tests.models.test_family_phi import _tiny

    return _tiny(0)


def _phi3():
    from tests.models.test_family_phi3 import _config, _tiny

    return _tiny(_config(original=128, max_pos=512), 1)  # longrope, short factors


def _stablelm():
    from tests.models.test_family_stablelm import _tiny

    return _tiny(0)


def _gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM
    from tests.models.test_family_gemma2 import TINY

    return _seeded(Gemma2ForCausalLM, Gemma2Config(**TINY, head_dim=32, query_pre_attn_scalar=24,
                                                   sliding_window=6, attn_logit_softcapping=4.0,
                                                   final_logit_softcapping=3.0))


def _gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    from tests.models.test_family_gemma3 import tiny_text_config

    return _seeded(Gemma3ForCausalLM, Gemma3TextConfig(**tiny_text_config()))


def _glm4():
    from transformers import Glm4Config, Glm4ForCausalLM
    from tests.models.test_family_glm4 import TINY

    return _seeded(Glm4ForCausalLM, Glm4Config(**TINY, tie_word_embeddings=False))


FAMILIES: Dict[str, Callable[[], torch.nn.Module]] = {
    "llama": _llama, "llama_1024x8": _llama_large, "mistral": _mistral, "qwen2": _qwen2,
    "qwen3": _qwen3, "qwen2_moe": _qwen2_moe, "qwen3_moe": _qwen3_moe,
    "qwen3_next": lambda: _qwen3_next_like("next", 0), "qwen3_5": lambda: _qwen3_next_like("3_5", 1),
    "qwen3_5_moe": lambda: _qwen3_next_like("3_5_moe", 2), "phi": _phi, "phi3": _phi3,
    "stablelm": _stablelm, "gemma2": _gemma2, "gemma3": _gemma3, "glm4": _glm4,
    "deepseek_v2": lambda: deepseek_tiny.build(deepseek_tiny.v2_config(), seed=0),
    "deepseek_v3": lambda: deepseek_tiny.build(deepseek_tiny.v3_config(), seed=1),
}


def hf_generate(hf, device: str) -> List[Tuple[List[int], torch.Tensor]]:
    """Per prompt: HF's greedy tokens and its raw log-probabilities at each step # [N, V]."""
    hf.generation_config.eos_token_id = None
    res = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([p], device=device)
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                              do_sample=False, eos_token_id=None, pad_token_id=0,
                              output_logits=True, return_dict_in_generate=True)
            logits = torch.stack(out.logits)[:, 0].float()  # [N, V]
            res.append((out.sequences[0, len(p):].tolist(), logits.log_softmax(-1).cpu()))
    return res


def cvllm_generate(llm) -> List[Tuple[List[int], List[Dict[int, float]]]]:
    """Per prompt, all three as one batch: cvllm's greedy tokens and its top 5 (id ->
    log-probability) at each step."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP)
    toks: Dict[str, List[int]] = {}
    tops: Dict[str, List[Dict[int, float]]] = {}
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"p{i}", list(p), params)
        toks[f"p{i}"], tops[f"p{i}"] = [], []
    while engine.has_unfinished():
        for out in engine.step():
            toks[out.request_id] += out.delta_token_ids
            # The word tokenizer decodes id i to "t{i}".
            tops[out.request_id] += [{int(t[1:]): lp for t, lp in e.top.items()} for e in out.logprobs]
    return [(toks[f"p{i}"], tops[f"p{i}"]) for i in range(len(PROMPTS))]


def compare(hf_tokens, hf_logprobs, cv_tokens, cv_top) -> str:
    """Assert the acceptance rule for one prompt; a one-line summary."""
    assert len(hf_tokens) == len(cv_tokens) == len(cv_top) == NEW_TOKENS
    k = next((j for j in range(NEW_TOKENS) if hf_tokens[j] != cv_tokens[j]), NEW_TOKENS)
    drift = 0.0
    for j in range(min(k + 1, NEW_TOKENS)):  # the same context on both sides up to k
        assert len(cv_top[j]) == TOP and cv_tokens[j] in cv_top[j]
        drift = max(drift, max(abs(lp - hf_logprobs[j, t].item()) for t, lp in cv_top[j].items()))
    assert drift <= LOGPROB_ATOL, f"log-probabilities differ by {drift:.3f} before position {k + 1}"
    if k == NEW_TOKENS:
        return f"equal (max logprob diff {drift:.3f})"
    hf_top = hf_logprobs[k].topk(TOP).indices.tolist()
    assert cv_tokens[k] in hf_top, (
        f"position {k}: cvllm's {cv_tokens[k]} not in HF's top {TOP} {hf_top}")
    assert hf_tokens[k] in cv_top[k], (
        f"position {k}: HF's {hf_tokens[k]} not in cvllm's top {TOP} {sorted(cv_top[k])}")
    return (f"diverge at {k} (HF {hf_tokens[k]} / cvllm {cv_tokens[k]}, each in the other's "
            f"top {TOP}; max logprob diff {drift:.3f})")


def _engine_path(llm) -> str:
    """Which attention backend and whether decode ran through captured CUDA graphs."""
    from cvllm.layers.attention import Attention

    runner = llm.engine.runner
    names = sorted({m.backend.name for m in runner.model.modules() if isinstance(m, Attention)})
    graphs = runner.graphs is not None and bool(runner.graphs.graphs)
    return f"attention {'/'.join(names) or 'none'}, CUDA graphs {'on' if graphs else 'off'}"


def run_family(name: str, folder, device: str = "cuda", **llm_kw) -> Tuple[List[str], bool]:
    from cvllm.engine.llm import LLM

    hf = FAMILIES[name]()
    hf.save_pretrained(folder, safe_serialization=True)
    word_tokenizer(hf.config.vocab_size).save_pretrained(folder)
    cls = type(hf)
    del hf
    hf = cls.from_pretrained(folder, dtype=torch.bfloat16, attn_implementation="eager").to(device).eval()
    expected = hf_generate(hf, device)
    del hf
    kw = dict(kvcache_mem_mb=64, max_num_seqs=8, max_model_len=128, dtype="bf16")
    kw.update(llm_kw)
    if device == "cuda":
        kw.setdefault("device_ids", [0])
    else:
        kw.setdefault("cpu", True)
    llm = LLM(weight_path=str(folder), **kw)
    got = cvllm_generate(llm)
    lines, failed = [f"{name}: {_engine_path(llm)}"], False
    del llm
    for i, ((h, hl), (c, ct)) in enumerate(zip(expected, got)):
        try:
            lines.append(f"{name} prompt {i}: " + compare(h, hl, c, ct))
        except AssertionError as e:  # report every prompt, then fail
            lines.append(f"{name} prompt {i}: FAIL {e}\n  HF    {h}\n  cvllm {c}")
            failed = True
    return lines, failed


@pytest.fixture(autouse=True)
def _release():
    yield
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_bf16_greedy_matches_transformers(tmp_path, name):
    lines, failed = run_family(name, tmp_path)
    print("\n".join(lines))
    assert not failed, "\n".join(lines)
