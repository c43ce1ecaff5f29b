"""Shared harness for the per-family parity tests: a tiny random Hugging Face model, saved
with ``save_pretrained``, served by cvllm's real engine (loader -> ModelRunner ->
scheduler), compared with transformers.

Tolerances: float32 on both sides; last-token prefill logits within ``atol=1e-4``; greedy
tokens equal token for token, also as one batch with chunked prefill smaller than the
prompts. Prefix caching (``check_prefix_cache``): greedy tokens with the cache on equal
those with it off, for prompts that share prefixes, under a KV cache about 4x
oversubscribed (preemptions happen).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import List, Optional, Sequence

import torch

from cvllm.engine.llm import LLM
from cvllm.engine.llm_engine import LLMEngine
from cvllm.sampling_params import SamplingParams

# Three prompts of different lengths; ids below 256 so any tiny vocabulary takes them.
PROMPTS: List[List[int]] = [
    [3, 17, 99, 4, 250, 31, 8],
    [7, 7, 1, 200, 45, 13, 8, 91, 120, 64, 5, 19, 23, 150, 77, 60, 2, 11, 34],
    [100, 2, 33, 44, 55, 66, 77, 88, 99, 110, 121, 132, 143],
]
LOGITS_ATOL = 1e-4
NEW_TOKENS = 16


@functools.lru_cache(maxsize=1)
def _tokenizer():
    """The default model's tokenizer, written into every tiny folder (ids < 256 decode)."""
    from cvllm import loader

    return loader.load_tokenizer(loader.resolve_model_source())


def randomize_(hf_model: torch.nn.Module, seed: int = 0, std: float = 0.1) -> None:
    """HF initialises norms to 1 and biases to 0; perturb them so that they count."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if name.endswith("bias") or "norm" in name or p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=g) * std)


def save_tiny(hf_model: torch.nn.Module, folder: Path, gguf_tokenizer: bool = True) -> Path:
    folder = Path(folder)
    hf_model.save_pretrained(folder, safe_serialization=True)
    if gguf_tokenizer:
        _tokenizer().save_pretrained(folder)
    return folder


def hf_last_logits(hf_model, prompts: Sequence[List[int]] = PROMPTS) -> List[torch.Tensor]:
    out = []
    with torch.no_grad():
        for p in prompts:
            out.append(hf_model(torch.tensor([p])).logits[0, -1].float())
    return out


def hf_greedy(hf_model, prompts: Sequence[List[int]] = PROMPTS, n: int = NEW_TOKENS) -> List[List[int]]:
    res = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                    min_new_tokens=n, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)
            res.append(gen[0, len(p):].tolist())
    return res


def cvllm_llm(folder: Path, prefill_chunk_size: int = 8192, **kw) -> LLM:
    kw.setdefault("kvcache_mem_mb", 32)  # tiny models: a small cache is quick to allocate
    return LLM(weight_path=str(folder), cpu=True, dtype="f32", max_model_len=128,
               prefill_chunk_size=prefill_chunk_size, **kw)


def cvllm_last_logits(llm: LLM, prompts: Sequence[List[int]] = PROMPTS) -> List[torch.Tensor]:
    """One batched prefill of every prompt through the engine; the logits the sampler saw."""
    model = llm.engine.runner.model
    seen: List[torch.Tensor] = []
    original = model.compute_logits

    def spy(hidden):
        logits = original(hidden)
        seen.append(logits.detach().clone())
        return logits

    model.compute_logits = spy
    try:
        llm.generate([list(p) for p in prompts], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    finally:
        model.compute_logits = original
    assert len(seen) == 1 and seen[0].shape[0] == len(prompts), "expected one batched prefill step"
    return list(seen[0])


def cvllm_greedy(llm: LLM, prompts: Sequence[List[int]] = PROMPTS, n: int = NEW_TOKENS) -> List[List[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [r.token_ids for r in llm.generate([list(p) for p in prompts], params)]


def _shared_prefix_batches() -> List[List[List[int]]]:
    """Two batches (the second runs once the first finished) of prompts that share
    prefixes: two copies of one prompt (choices of one request), a prompt that is a
    prefix of another, one that is wholly cached by then (its last block recomputed)."""
    base = PROMPTS[1] + PROMPTS[2]  # 32 tokens: 4 blocks of 8
    first = [base, base, base[:20] + PROMPTS[0], PROMPTS[1], base[:12] + PROMPTS[2], base[:24]]
    second = [base + [5, 6, 7], base, base[:16], PROMPTS[2] + PROMPTS[0], base[:24] + [9],
              PROMPTS[1][:8] + PROMPTS[0]]
    return [first, second]


def check_prefix_cache(folder: Path, n: int = NEW_TOKENS, **kw) -> None:
    """Greedy tokens with the prefix cache on equal those with it off (the same runner,
    so the same weights and cache tensors: the cache-off engine runs only once the
    other is done with them), for ``_shared_prefix_batches`` under a KV
    cache of 9 blocks of 8 tokens (max_model_len 64) while six sequences of up to 6-7
    blocks run: about 4x oversubscribed. The cache must be hit and preemptions happen,
    except for models with state layers, where caching is off."""
    options = dict(weight_path=str(folder), cpu=True, dtype="f32", max_model_len=64,
                   block_size=8, prefill_chunk_size=8, num_blocks=9, max_num_seqs=6)
    on = LLM(**{**options, **kw})
    engine = on.engine
    config = dataclasses.replace(engine.config, cache=dataclasses.replace(
        engine.config.cache, enable_prefix_caching=False))
    off = LLM.from_engine(LLMEngine(config, engine.tokenizer, engine.runner))
    batches = _shared_prefix_batches()
    with_cache = [cvllm_greedy(on, batch, n) for batch in batches]
    assert with_cache == [cvllm_greedy(off, batch, n) for batch in batches]
    stats = engine.kv_cache_manager.prefix_cache_stats
    if engine.kv_layout.num_state_slots:
        assert not engine.kv_cache_manager.enable_caching and stats.queries == 0
    else:
        assert stats.hits >= 64, stats
    assert engine.scheduler.num_preemptions_total > 0
    assert all(g.num_used_blocks == 0 for g in engine.kv_cache_manager.groups)


def check_against_hf(hf_model, folder: Path, prompts: Sequence[List[int]] = PROMPTS,
                     atol: float = LOGITS_ATOL, chunk: int = 4, llm: Optional[LLM] = None,
                     prefix_cache: bool = True) -> None:
    """Every acceptance check of a family: batched prefill logits, greedy tokens,
    greedy tokens as one batch with a prefill chunk smaller than every prompt, and (with
    ``prefix_cache``) the prefix cache on and off under KV pressure."""
    hf_model.eval()
    llm = llm or cvllm_llm(folder)
    for i, (ours, theirs) in enumerate(zip(cvllm_last_logits(llm, prompts), hf_last_logits(hf_model, prompts))):
        err = (ours - theirs).abs().max().item()
        assert err <= atol, f"prompt {i}: max |logit diff| {err:.2e} > {atol:.0e}"
    expected = hf_greedy(hf_model, prompts)
    assert cvllm_greedy(llm, prompts) == expected
    assert min(len(p) for p in prompts) > chunk
    chunked = cvllm_llm(folder, prefill_chunk_size=chunk)
    assert cvllm_greedy(chunked, prompts) == expected
    if prefix_cache:
        check_prefix_cache(folder)


def hf_config_of(folder: Path) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())


def cvllm_gguf_llm(folder: Path, gguf_name: str) -> LLM:
    """cvllm loading ``folder/gguf_name`` (weights, config) with the folder's tokenizer."""
    return LLM(weight_path=str(folder), weight_file=gguf_name, cpu=True, dtype="f32", max_model_len=128,
               kvcache_mem_mb=32)


def check_gguf_against_hf(hf_model, folder: Path, gguf_name: str, prompts: Sequence[List[int]] = PROMPTS,
                          atol: float = LOGITS_ATOL, transformers_loads: bool = True) -> None:
    """The GGUF copy of a tiny model gives HF's logits and greedy tokens through cvllm; when
    transformers' GGUF loader knows the architecture, it reads the same file to the same
    logits (so the file follows llama.cpp's conventions, not only cvllm's)."""
    hf_model.eval()
    llm = cvllm_gguf_llm(folder, gguf_name)
    reference = hf_last_logits(hf_model, prompts)
    for i, (ours, theirs) in enumerate(zip(cvllm_last_logits(llm, prompts), reference)):
        err = (ours - theirs).abs().max().item()
        assert err <= atol, f"GGUF prompt {i}: max |logit diff| {err:.2e} > {atol:.0e}"
    assert cvllm_greedy(llm, prompts) == hf_greedy(hf_model, prompts)
    if transformers_loads:
        from transformers import AutoModelForCausalLM

        theirs_model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=gguf_name,
                                                            dtype=torch.float32).eval()
        for i, (a, b) in enumerate(zip(hf_last_logits(theirs_model, prompts), reference)):
            err = (a - b).abs().max().item()
            assert err <= atol, f"transformers reading the GGUF, prompt {i}: {err:.2e} > {atol:.0e}"
