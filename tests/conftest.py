"""Fixtures shared by the whole suite: the default real model (SmolLM2-135M-Instruct,
Q4_1 GGUF) fetched once into the user cache, and Hugging Face's reference copy of it."""

import os

import pytest

os.environ.setdefault("CVLLM_NO_PROGRESS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Chat prompts whose answers run past 32 tokens, used by the parity and batching tests.
CHAT_PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how photosynthesis works in simple terms.",
    "List five tips for learning a new language and explain each one.",
    "What are the main differences between Python and C++?",
    "Describe the water cycle step by step.",
]


@pytest.fixture(scope="session")
def default_gguf():
    from cvllm.loader.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def hf_smollm(default_gguf):
    """transformers' own float32 load of the same GGUF (its dequantizer, its tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(default_gguf.parent), default_gguf.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return tok, model.eval()


@pytest.fixture(autouse=True)
def _reset_cvllm_logger():
    """``cli`` calls ``init_logging``, which detaches the ``cvllm`` logger from the root;
    put it back after each test so ``caplog`` sees later tests' records."""
    import logging

    yield
    logger = logging.getLogger("cvllm")
    for h in list(logger.handlers):
        logger.removeHandler(h)
    logger.propagate = True
    logger.setLevel(logging.NOTSET)
