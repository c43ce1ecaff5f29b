"""The default real model through the whole engine, against Hugging Face transformers.

Tolerance: greedy decoding must agree token for token (both sides float32, both
dequantizing the same Q4_1 GGUF: ``dequantize=True``, the exact float path). Batching,
chunked prefill and preemption must not change a single greedy token either. The default
path keeps the weights quantized (bf16 kernels on the CPU); it is held against this float
path in tests/quantization/test_default_model_quantized.py.
"""

import pytest
import torch

from cvllm.engine.llm import LLM
from cvllm.sampling_params import SamplingParams
from tests.conftest import CHAT_PROMPTS

NEW_TOKENS = 32
pytestmark = pytest.mark.slow


def _greedy():
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)


@pytest.fixture(scope="module")
def llm(default_gguf):
    return LLM(weight_file=str(default_gguf), cpu=True, max_model_len=1024, kvcache_mem_mb=128,
               dequantize=True)


@pytest.fixture(scope="module")
def conversations():
    return [[{"role": "user", "content": p}] for p in CHAT_PROMPTS]


@pytest.fixture(scope="module")
def one_at_a_time(llm, conversations):
    return [llm.chat([c], _greedy())[0].token_ids for c in conversations]


def test_chat_template_matches_transformers(llm, hf_smollm, conversations):
    hf_tok, _ = hf_smollm
    for conv in conversations:
        ours = llm.tokenizer.render_chat(conv)
        theirs = hf_tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
        if isinstance(theirs, dict) or hasattr(theirs, "input_ids"):
            theirs = theirs["input_ids"]
        assert ours == list(theirs)


def test_greedy_matches_transformers(llm, hf_smollm, conversations, one_at_a_time):
    hf_tok, hf_model = hf_smollm
    compared = 0
    for conv, ours in zip(conversations, one_at_a_time):
        ids = torch.tensor([llm.tokenizer.render_chat(conv)])
        with torch.no_grad():
            out = hf_model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                                    attention_mask=torch.ones_like(ids))
        theirs = out[0, ids.shape[1]:].tolist()
        assert ours == theirs, (conv, hf_tok.decode(ours), hf_tok.decode(theirs))
        compared += len(ours)
    # The prompts were picked to answer at length: the comparison covers 5 x 32 tokens.
    assert compared == len(conversations) * NEW_TOKENS


def test_sixteen_concurrent_equal_one_at_a_time(llm, conversations, one_at_a_time):
    convs = [conversations[i % len(conversations)] for i in range(16)]
    results = llm.chat(convs, _greedy())
    for i, res in enumerate(results):
        assert res.token_ids == one_at_a_time[i % len(conversations)]


def test_chunked_prefill_gives_same_tokens(default_gguf, conversations, one_at_a_time):
    llm = LLM(weight_file=str(default_gguf), cpu=True, max_model_len=1024, kvcache_mem_mb=128, prefill_chunk_size=16,
              dequantize=True)
    prompt_lens = [len(llm.tokenizer.render_chat(c)) for c in conversations]
    assert min(prompt_lens) > 16  # every prompt really is split into chunks
    convs = [conversations[i % len(conversations)] for i in range(16)]
    results = llm.chat(convs, _greedy())
    for i, res in enumerate(results):
        assert res.token_ids == one_at_a_time[i % len(conversations)]


def test_preemption_gives_same_tokens(default_gguf, conversations, one_at_a_time):
    # 24 blocks of 16 tokens hold about 4 of these sequences; 16 at once must preempt.
    llm = LLM(weight_file=str(default_gguf), cpu=True, max_model_len=384, num_blocks=24, dequantize=True)
    convs = [conversations[i % len(conversations)] for i in range(16)]
    results = llm.chat(convs, _greedy())
    assert llm.engine.scheduler.num_preemptions_total > 0
    for i, res in enumerate(results):
        assert res.token_ids == one_at_a_time[i % len(conversations)]
    assert llm.engine.block_manager.num_free_blocks == 24
