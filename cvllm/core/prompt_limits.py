"""The one rule for a prompt's length: what room it leaves to generate in the model's
context, or why it is refused.

Called by ``engine/llm_engine.LLMEngine.add_request`` for every request and by the server
(``server/params.prompt_room``) before it answers; it lives in ``core/`` (pure Python, no
torch) so that the API process reaches it without loading the engine.
"""

from __future__ import annotations


class PromptTooLongError(ValueError):
    """The prompt leaves no room to generate within the model's context."""

    code = "context_length_exceeded"
    """OpenAI's error code for it (the server answers it as a 400 with this code)."""

    def __init__(self, num_prompt_tokens: int, max_model_len: int):
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens; your prompt has "
            f"{num_prompt_tokens} tokens, which leaves no room to generate. Please shorten "
            f"the prompt.")
        self.num_prompt_tokens = num_prompt_tokens
        self.max_model_len = max_model_len


def check_prompt_length(num_prompt_tokens: int, max_model_len: int) -> int:
    """The room a prompt leaves for generation: the engine's admission rule for a prompt's
    length, written here only. An empty prompt, or one of ``max_model_len`` tokens or
    more, is refused (``ValueError``, ``PromptTooLongError``).

    Applied by ``LLMEngine.add_request`` to every request (offline ``LLM.generate``, the
    in-process server, the API process's); the server asks it too (``server/params.py``),
    with the limit the engine published (``max_model_len``), before it answers: a streamed
    response's status line goes out before the engine thread sees the request, and the
    room caps ``max_tokens``. Pure and torch-free, so any thread or process may call it.
    """
    if num_prompt_tokens == 0:
        raise ValueError("The prompt is empty.")
    if num_prompt_tokens >= max_model_len:
        raise PromptTooLongError(num_prompt_tokens, max_model_len)
    return max_model_len - num_prompt_tokens
