"""Offline generation: ``LLM(...).generate(prompts, params)`` for scripts and tests.

Runs the same ``LLMEngine`` the server uses, driven synchronously in the caller's thread,
so batching, chunked prefill and preemption behave exactly as when serving.
"""

from __future__ import annotations

import itertools
from typing import Any, Dict, List, Optional, Sequence, Union

from cvllm.engine.llm_engine import LLMEngine
from cvllm.outputs import CompletionResult
from cvllm.sampling_params import SamplingParams

Prompt = Union[str, List[int]]


class LLM:
    """``LLM(weight_file=..., cpu=True, ...)`` takes the same options as
    ``engine.builder.build_llm_engine`` (the CLI's flags, by their long names), e.g.
    ``disable_cuda_graph=True`` or ``attention_backend="torch_ref"``."""

    def __init__(self, **options: Any):
        from cvllm.engine.builder import build_llm_engine

        engine, defaults = build_llm_engine(**options)
        self._init(engine, defaults)

    @classmethod
    def from_engine(cls, engine: LLMEngine, defaults: Optional[Dict[str, Any]] = None) -> "LLM":
        obj = cls.__new__(cls)
        obj._init(engine, defaults or {})
        return obj

    def _init(self, engine: LLMEngine, defaults: Dict[str, Any]) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.defaults = defaults
        self._ids = itertools.count()

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None) -> List[CompletionResult]:
        """Run every prompt to completion, batched together; results in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        token_lists = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        return self._run(token_lists, params)

    def chat(self, conversations: Sequence[List[Dict[str, Any]]],
             params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None) -> List[CompletionResult]:
        """Each conversation is a list of {role, content} messages, rendered with the
        model's chat template."""
        token_lists = [self.tokenizer.render_chat(list(msgs)) for msgs in conversations]
        return self._run(token_lists, params)

    def _run(self, token_lists: List[List[int]], params) -> List[CompletionResult]:
        if params is None:
            params = SamplingParams(max_tokens=self.engine.config.max_gen_tokens)
        per_prompt = list(params) if isinstance(params, (list, tuple)) else [params] * len(token_lists)
        if len(per_prompt) != len(token_lists):
            raise ValueError("give one SamplingParams, or one per prompt")
        ids = [f"offline-{next(self._ids)}" for _ in token_lists]
        results = {rid: CompletionResult(rid, toks, "", [], None) for rid, toks in zip(ids, token_lists)}
        for rid, toks, p in zip(ids, token_lists, per_prompt):
            self.engine.add_request(rid, toks, p)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                res = results.get(out.request_id)
                if res is None:
                    continue
                res.text += out.delta_text
                res.token_ids.extend(out.delta_token_ids)
                res.logprobs.extend(out.logprobs or [])
                if out.finished:
                    res.finish_reason = out.finish_reason
        return [results[rid] for rid in ids]
