"""The default model (a Q4_1 GGUF with a Q8_0 tied embedding) kept quantized against the
same file dequantized to float at load (``--dequantize``), 8 chat prompts x 32 greedy
tokens.

Tolerance: the token lists are equal, or at the first divergence each side's token is in
the other side's top 5. Why a divergence can happen at all: the CPU kernels multiply
with bf16 activations and bf16 block scales (``kernels/quant/ggml_cpu.py``), the float
path in float32, so near-tied logits can swap; where the kept path dequantizes exactly,
the lists are equal.
"""

import pytest

from cvllm.engine.llm import LLM
from cvllm.sampling_params import SamplingParams
from tests.conftest import CHAT_PROMPTS

pytestmark = pytest.mark.slow
PROMPTS = CHAT_PROMPTS + [
    "What is the capital of France?",
    "Give me three rhymes for 'cat'.",
    "Translate 'good morning' into Spanish and German.",
]


def _run(path, dequantize):
    llm = LLM(weight_file=str(path), cpu=True, max_model_len=1024, kvcache_mem_mb=128,
              dequantize=dequantize)
    convs = [[{"role": "user", "content": p}] for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=32, logprobs=5, ignore_eos=True)
    return llm, llm.chat(convs, params)


def agree_or_top5(a, b):
    """None when the greedy lists agree (or diverge between top-5 tokens), else a message."""
    ids_a, ids_b = list(a.token_ids), list(b.token_ids)
    for i, (x, y) in enumerate(zip(ids_a, ids_b)):
        if x != y:
            if y in a.logprobs[i].top_ids and x in b.logprobs[i].top_ids:
                return None
            return f"token {i}: {x} vs {y}, not in each other's top 5"
    return None if len(ids_a) == len(ids_b) else "lengths differ"


def test_kept_quantized_matches_dequantized(default_gguf):
    llm_q, kept = _run(default_gguf, dequantize=False)
    _, floats = _run(default_gguf, dequantize=True)
    assert len(PROMPTS) == 8
    problems = [agree_or_top5(k, f) for k, f in zip(kept, floats)]
    assert not any(problems), problems
    # The weights really stayed quantized: no float copy of a Q4_1 matrix.
    from cvllm.quantization.summary import weight_summary

    per_type, total = weight_summary(llm_q.engine.runner.model)
    assert "Q4_1" in per_type and per_type["Q4_1"][0] == 210, per_type
