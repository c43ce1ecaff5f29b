"""From a parsed OpenAI request to the ``SamplingParams`` of each engine request.

Called by the handlers (rank 0, event-loop thread) once per HTTP request, after the prompt
was tokenized. Precedence: value in the request > server-wide default from
``engine.default_params()`` (the CLI flags) > ``SamplingParams`` default.

Context length, like candle-vllm: a prompt of ``max_model_len`` tokens or more is a 400;
otherwise ``max_tokens`` (requested or defaulted to ``max_gen_tokens``) is silently capped
to the room left in the context, ``max_model_len - prompt_len``, instead of failing. The
rule is the engine's admission rule (``core/prompt_limits.check_prompt_length``, with the
limit the engine published): it is asked here, before anything is answered, because a
streamed answer's status goes out before the engine sees the request.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Mapping, Optional

from cvllm.core.prompt_limits import check_prompt_length
from cvllm.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputs
from cvllm.server.errors import ApiError

_PARAM_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
# Decided per request by the server, never taken from the server-wide defaults.
_PER_REQUEST = {"max_tokens", "n", "logprobs", "structured_outputs"}


def prompt_room(prompt_len: int, max_model_len: int, param: str) -> int:
    """The room the prompt leaves for generation, by the engine's rule; its refusal (an
    empty prompt, one that fills the context) is a 400 naming ``param``."""
    try:
        return check_prompt_length(prompt_len, max_model_len)
    except ValueError as exc:
        raise ApiError(400, str(exc), param=param, code=getattr(exc, "code", None)) from None


def resolve_sampling_params(request: Any, defaults: Mapping[str, Any], prompt_len: int,
                            max_model_len: int, param: str,
                            structured_outputs: Optional[StructuredOutputs] = None,
                            skip_special_tokens: bool = True) -> SamplingParams:
    """Build validated params for ``request`` (a Chat/CompletionRequest); 400 on bad values.

    ``param`` names the prompt field ('messages' or 'prompt') in a context-length error.
    ``structured_outputs`` is the constraint the handler settled on (the request's own, or
    the one a forced ``tool_choice`` builds); ``skip_special_tokens=False`` when the tool
    parser reads markers that are special tokens.
    """
    room = prompt_room(prompt_len, max_model_len, param)
    kwargs: Dict[str, Any] = {k: v for k, v in defaults.items()
                              if k in _PARAM_FIELDS and k not in _PER_REQUEST and v is not None}
    kwargs.update(request.sampling.overrides())
    wanted = request.max_tokens
    if wanted is None:
        wanted = defaults.get("max_gen_tokens") or defaults.get("max_tokens") or room
    kwargs["max_tokens"] = min(int(wanted), room)
    kwargs["n"] = request.n
    kwargs["logprobs"] = request.num_logprobs
    kwargs["structured_outputs"] = structured_outputs
    if not skip_special_tokens:  # the tool parser needs them; else the client's choice stands
        kwargs["skip_special_tokens"] = False
    try:
        return SamplingParams(**kwargs)
    except SamplingParamsError as exc:
        raise ApiError(400, str(exc), param=exc.param) from None


def fan_out(params: SamplingParams, n: int) -> List[SamplingParams]:
    """Params of the n engine requests behind one HTTP request.

    Each engine request generates one sequence (n=1). A seeded request gets seed+i for
    choice i, so choices differ yet the whole response stays reproducible.
    """
    out = []
    for i in range(n):
        seed: Optional[int] = None if params.seed is None else params.seed + i
        try:
            out.append(dataclasses.replace(params, n=1, seed=seed))
        except SamplingParamsError as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
    return out
