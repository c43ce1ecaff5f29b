"""CPU batch copies (``--cpu-dense-gb``): bf16 copies beside two-plane GGML weights for
decode batches, granted by a byte budget in loading order.

- The budget grants copies until it runs out, counts what it refused, and says so.
- ``--cpu-dense-gb``: a number >= 0 (bytes = GiB * 2^30); auto gives none where the CPU
  has no AMX.
- The default model (Q4_1 layers, a tied Q8_0 embedding): with a budget, only the tied LM
  head keeps a copy (Q4_1 is a one-plane type), exactly ``V * hidden * 2`` bytes more than
  with ``--cpu-dense-gb 0``, and 4 prompts decoded together (4 rows: the copy multiplies)
  give the same greedy tokens as without (the head's top 16 logits per row are recomputed
  from the exact blocks either way).
"""

from __future__ import annotations

import pytest

from cvllm.config import ConfigError, check_cpu_dense_gib
from cvllm.kernels.quant import ggml_cpu
from cvllm.quantization.batch_copies import BatchCopyBudget, batch_copy_budget


def test_budget_grants_in_order_until_it_runs_out():
    b = BatchCopyBudget(100)
    assert not b.take(0) and b.note() == ""  # a weight without a copy asks for nothing
    assert b.take(60) and b.take(40)
    assert not b.take(1) and not b.take(50)
    assert b.left == 0 and b.granted == [2, 100] and b.refused == [2, 51]
    assert "2 weights kept" in b.note() and "2 did not fit" in b.note()


def test_budget_setting():
    assert batch_copy_budget(0) == 0
    assert batch_copy_budget(1.5) == int(1.5 * 2**30)
    auto = batch_copy_budget(None)
    assert (auto > 0) == ggml_cpu.batch_copy_pays()
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="--cpu-dense-gb"):
            check_cpu_dense_gib(bad)


@pytest.mark.slow
def test_default_model_head_copy(default_gguf):
    from cvllm.engine.llm import LLM
    from cvllm.quantization.summary import weight_summary
    from cvllm.sampling_params import SamplingParams

    prompts = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time",
               "def fibonacci(n):"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    runs = {}
    for gb in (0.0, 1.0):
        llm = LLM(weight_file=str(default_gguf), cpu=True, max_model_len=256,
                  kvcache_mem_mb=32, cpu_dense_gb=gb)
        model = llm.engine.runner.model
        _, total = weight_summary(model)
        tokens = [list(r.token_ids) for r in llm.generate(prompts, params)]
        runs[gb] = (total, tokens)
    vocab, hidden = 49152, 576
    assert runs[1.0][0] - runs[0.0][0] == vocab * hidden * 2
    assert runs[1.0][1] == runs[0.0][1]
