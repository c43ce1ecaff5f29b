"""What chat and completions responses share: choices, usage, logprob values, envelopes.

``ResponseShapes`` builds one request's response body and stream chunks; ``ChatShapes``
(``chat.py``) and ``CompletionShapes`` (``completions.py``) fix the OpenAI flavour.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

from cvllm.outputs import TokenLogprob

# OpenAI clients cannot parse -Infinity; a very negative finite number reads the same.
_MIN_LOGPROB = -9999.0


@dataclass
class ChoiceResult:
    """One finished choice, as the handlers accumulated it from ``RequestOutput``s."""

    index: int
    text: str
    finish_reason: Optional[str]
    num_output_tokens: int
    logprobs: List[TokenLogprob] = field(default_factory=list)
    num_cached_tokens: int = 0
    """Prompt tokens this choice's engine request took from the prefix cache."""


def cached_prompt_tokens(per_choice: Sequence[int]) -> int:
    """A request's ``cached_tokens`` when its n choices ran as n engine requests: the
    prompt tokens none of them computed (the first choice usually computes the prompt
    and the others reuse its blocks, which saves compute but is not a cache hit for the
    request)."""
    return min(per_choice, default=0)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def clamp_logprob(value: float) -> float:
    return max(float(value), _MIN_LOGPROB)


class ResponseShapes:
    """Builds the bodies of one request's response; subclasses fix the OpenAI flavour."""

    object_name = ""
    chunk_object = ""

    def __init__(self, request_id: str, model: str, include_usage: bool = False,
                 num_logprobs: Optional[int] = None):
        self.request_id = request_id
        self.model = model
        self.include_usage = include_usage
        self.want_logprobs = num_logprobs is not None
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.request_id, "object": obj, "created": self.created,
                "model": self.model, "choices": choices}

    def _chunk(self, choice: dict) -> dict:
        chunk = self._envelope(self.chunk_object, [choice])
        if self.include_usage:  # OpenAI sends usage: null on every chunk but the last
            chunk["usage"] = None
        return chunk

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int,
                    cached_tokens: int = 0) -> dict:
        chunk = self._envelope(self.chunk_object, [])
        chunk["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
        return chunk

    def response(self, choices: Sequence[ChoiceResult], prompt_tokens: int) -> dict:
        body = self._envelope(self.object_name, [self._choice(c) for c in choices])
        body["usage"] = usage(prompt_tokens, sum(c.num_output_tokens for c in choices),
                              cached_prompt_tokens([c.num_cached_tokens for c in choices]))
        return body

    def _choice(self, c: ChoiceResult) -> dict:  # pragma: no cover - abstract
        raise NotImplementedError
