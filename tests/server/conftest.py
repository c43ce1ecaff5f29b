"""Fixtures for the server tests: a character-level FakeEngine and an async test runner.

The FakeEngine follows the AsyncEngine contract (engine/async_engine.py) without torch: one
token per character (token id = code point), and "generation" echoes the prompt text
back one character per step, then stops (like an EOS) unless ``ignore_eos`` is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from typing import Dict, List, Optional

import pytest
from aiohttp.test_utils import TestClient, TestServer

from cvllm.outputs import EngineMetrics, RequestOutput, TokenLogprob
from cvllm.sampling_params import SamplingParams
from cvllm.server import ServerSettings, build_app


class FakeEngine:
    model_name = "fake-model"

    def __init__(self, max_model_len: int = 64, token_delay: float = 0.0):
        self.max_model_len = max_model_len
        self.token_delay = token_delay
        self.ready = True
        self.healthy = True
        self.defaults: Dict[str, object] = {"max_gen_tokens": 1000}
        self.started: Dict[str, SamplingParams] = {}
        self.prompts: Dict[str, List[int]] = {}
        self.aborted: List[str] = []
        self.finished: List[str] = []
        self.template_kwargs: List[dict] = []
        self.checked: list = []
        self.fail_generate: Optional[Exception] = None
        self.fail_after: Optional[int] = None
        """Raise RuntimeError mid-generation after this many outputs."""
        self.cached_tokens = lambda request_id: 0
        """The prefix-cache hit each engine request reports (``num_cached_tokens``)."""

    # --- tokenizer side
    def encode(self, text: str) -> List[int]:
        return [ord(c) for c in text]

    def render_chat(self, messages, **kwargs) -> List[int]:
        self.template_kwargs.append(kwargs)
        if any(m["role"] == "assistant" for m in messages[:1]):
            raise ValueError("conversation must not start with an assistant turn")
        return self.encode("".join(m["content"] for m in messages))

    def render_chat_prompt(self, messages, **kwargs):
        ids = self.render_chat(messages, **kwargs)
        return "".join(chr(t) for t in ids), ids

    async def check_structured(self, spec) -> None:
        """Any constraint compiles but the regex ``(?=a)`` (llguidance has no lookahead)."""
        self.checked.append(spec)
        if spec.kind == "regex" and spec.value == "(?=a)":
            from cvllm.chat.structured import StructuredOutputError
            raise StructuredOutputError("invalid regex constraint", "structured_outputs")

    # --- engine side
    def is_ready(self) -> bool:
        return self.ready

    def is_healthy(self) -> bool:
        return self.healthy

    def default_params(self) -> dict:
        return dict(self.defaults)

    async def current_metrics(self) -> EngineMetrics:
        return self.metrics()

    def metrics(self) -> EngineMetrics:
        return EngineMetrics(num_running=2, num_waiting=1, kv_blocks_total=100,
                             kv_blocks_free=40, prompt_tokens_total=123,
                             generation_tokens_total=456, num_preemptions_total=3,
                             kv_blocks_cached=7, prefix_cache_queries_total=900,
                             prefix_cache_hits_total=640,
                             requests_finished={"stop": 5, "length": 1})

    def abort(self, request_id: str) -> None:
        if request_id not in self.finished and request_id not in self.aborted:
            self.aborted.append(request_id)

    async def generate(self, request_id: str, prompt_token_ids: List[int],
                       params: SamplingParams):
        if self.fail_generate is not None:
            raise self.fail_generate
        self.started[request_id] = params
        self.prompts[request_id] = list(prompt_token_ids)
        finished = False
        try:
            for i, out in enumerate(self._script(request_id, prompt_token_ids, params)):
                if i == self.fail_after:
                    raise RuntimeError("engine failed mid-generation")
                if self.token_delay:
                    await asyncio.sleep(self.token_delay)
                finished = out.finished
                out.num_cached_tokens = self.cached_tokens(request_id)
                yield out
        finally:
            if finished:
                self.finished.append(request_id)
            else:
                self.abort(request_id)

    def _script(self, request_id, prompt, params: SamplingParams):
        """The echo 'model': outputs the prompt's characters, honouring the params."""
        source = "".join(chr(t) for t in prompt)
        text = ""
        n = 0
        while True:
            if n >= len(source) and not params.ignore_eos:
                yield self._out(request_id, prompt, "", [], n, "stop")
                return
            ch = source[n % len(source)]
            n += 1
            text += ch
            hit = next((s for s in params.stop if text.endswith(s)), None)
            if hit is not None:
                # Tests use one-character stop strings, so nothing emitted must be undone.
                yield self._out(request_id, prompt, "", [ord(ch)], n, "stop", params)
                return
            reason = "length" if n >= params.max_tokens else None
            yield self._out(request_id, prompt, ch, [ord(ch)], n, reason, params)
            if reason:
                return

    @staticmethod
    def _out(request_id, prompt, delta, ids, n, reason, params=None) -> RequestOutput:
        lps = []
        if params is not None and params.logprobs is not None and ids:
            top = {delta or "?": -0.25, "z": -2.0}
            lps = [TokenLogprob(ids[0], delta, -0.25, dict(list(top.items())[:params.logprobs]))]
        return RequestOutput(request_id, delta, ids, len(prompt), n, reason is not None,
                             reason, None, lps)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Run ``async def`` tests in a fresh event loop (no pytest-asyncio needed)."""
    if inspect.iscoroutinefunction(pyfuncitem.obj):
        kwargs = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
        asyncio.run(asyncio.wait_for(pyfuncitem.obj(**kwargs), timeout=10))
        return True
    return None


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture(scope="session")
def fake_engine_cls():
    return FakeEngine


@contextlib.asynccontextmanager
async def _client(engine, settings: Optional[ServerSettings] = None):
    app = build_app(engine, settings or ServerSettings(served_model_name="served"))
    async with TestClient(TestServer(app)) as client:
        yield client


@pytest.fixture
def make_client():
    """``async with make_client(engine, settings) as client`` -> aiohttp TestClient."""
    return _client
