"""Offline ``LLM.generate`` refuses a prompt that fills the context, clearly and before
anything runs: the engine's admission (``LLMEngine.add_request`` through
``check_prompt_length``, the one place a prompt's length is checked) raises
``PromptTooLongError`` naming both numbers (a tiny random Llama on the CPU)."""

from __future__ import annotations

import pytest

from cvllm.engine.llm import LLM
from cvllm.core.prompt_limits import PromptTooLongError
from cvllm.sampling_params import SamplingParams
from tests.worker.tiny_llama import write_tiny_llama


def test_offline_generate_refuses_a_prompt_that_fills_the_context(tmp_path):
    llm = LLM(weight_path=str(write_tiny_llama(tmp_path)), cpu=True, max_num_seqs=2,
              kvcache_mem_mb=8, max_model_len=32)
    for n in (32, 40):
        with pytest.raises(PromptTooLongError, match=f"maximum context length is 32 tokens; "
                                                     f"your prompt has {n} tokens"):
            llm.generate([[5] * n])
    with pytest.raises(ValueError, match="The prompt is empty"):
        llm.generate([[]])
    assert not llm.engine.has_unfinished()
    # one token less fits, and leaves room for one generated token
    (out,) = llm.generate([[5] * 31], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
