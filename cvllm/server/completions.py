"""``POST /v1/completions``: the request's parsing and the response's shapes.

Called per HTTP request by the handlers (rank 0, event-loop thread); knows nothing of
aiohttp or the engine, so it is tested with plain dicts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Union

from cvllm.outputs import TokenLogprob
from cvllm.sampling_params import StructuredOutputs
from cvllm.server.schemas.request_fields import SamplingFields
from cvllm.server.responses import ChoiceResult, ResponseShapes, clamp_logprob
from cvllm.server.schemas.completion_body import CompletionBody
from cvllm.server.schemas.validation import bad_param, validate_body


@dataclass
class CompletionRequest:
    """A validated ``POST /v1/completions`` body."""

    prompt: Union[str, List[int]]
    """Text to tokenize, or token ids used as they are."""
    model: Optional[str] = None
    stream: bool = False
    include_usage: bool = False
    max_tokens: Optional[int] = None
    n: int = 1
    logprobs: Optional[int] = None
    sampling: SamplingFields = field(default_factory=SamplingFields)
    structured_outputs: Optional[StructuredOutputs] = None
    """The output constraint from response_format / structured_outputs / guided_*."""
    response_format_name: Optional[str] = None

    @property
    def num_logprobs(self) -> Optional[int]:
        return self.logprobs


def parse_completion_request(body: dict) -> CompletionRequest:
    """Validate a completions body; any mistake is an ``ApiError`` (400) naming the field."""
    parsed = validate_body(CompletionBody, body, CompletionBody.WHOLE_FIELDS)
    if parsed.echo:
        raise bad_param("echo", "'echo' is not supported")
    constraint = parsed.resolve_constraint()
    return CompletionRequest(prompt=parsed.prompt, max_tokens=parsed.max_tokens,
                             logprobs=parsed.logprobs,
                             structured_outputs=constraint.structured_outputs,
                             response_format_name=constraint.response_format_name,
                             **parsed.common_values())


def completion_logprobs(entries: Sequence[TokenLogprob], text_offset: int) -> dict:
    offsets = []
    for e in entries:
        offsets.append(text_offset)
        text_offset += len(e.token)
    return {"tokens": [e.token for e in entries],
            "token_logprobs": [clamp_logprob(e.logprob) for e in entries],
            "top_logprobs": [{t: clamp_logprob(v) for t, v in e.top.items()} for e in entries],
            "text_offset": offsets}


class CompletionShapes(ResponseShapes):
    object_name = "text_completion"
    chunk_object = "text_completion"

    def stream_start(self, index: int) -> Optional[dict]:
        return None  # completions have no role chunk

    def stream_delta(self, index: int, text: str, logprobs: Sequence[TokenLogprob],
                     text_offset: int = 0) -> dict:
        lp = completion_logprobs(logprobs, text_offset) if self.want_logprobs else None
        return self._chunk({"index": index, "text": text, "logprobs": lp,
                            "finish_reason": None})

    def stream_finish(self, index: int, finish_reason: str) -> dict:
        return self._chunk({"index": index, "text": "", "logprobs": None,
                            "finish_reason": finish_reason})

    def _choice(self, c: ChoiceResult) -> dict:
        lp = completion_logprobs(c.logprobs, 0) if self.want_logprobs else None
        return {"index": c.index, "text": c.text, "logprobs": lp,
                "finish_reason": c.finish_reason}
