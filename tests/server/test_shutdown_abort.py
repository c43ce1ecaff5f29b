"""Shutdown aborts (issue 14, item 6) without a model: ``AsyncEngine.abort_all`` ends every
request in flight with a last 'abort' output, and a non-streamed choice ended that way
answers 503. The real servers are driven in tests/e2e/test_shutdown.py."""

import asyncio
import time
from types import SimpleNamespace

import pytest

from cvllm.engine.async_engine import _WARMUP_ID, AsyncEngine
from cvllm.outputs import RequestOutput
from cvllm.sampling_params import SamplingParams
from cvllm.server.generation import ChoiceState
from cvllm.server.errors import ApiError


class _StubEngine:
    """Requests that never finish by themselves (the warm-up finishes at once)."""

    def __init__(self):
        self.config = SimpleNamespace(model=SimpleNamespace(max_model_len=64, bos_token_id=1))
        self.requests = {}

    def metrics(self):
        return None

    def add_request(self, request_id, prompt, params):
        self.requests[request_id] = prompt

    def abort_request(self, request_id):
        return self.requests.pop(request_id, None) is not None

    def has_unfinished(self):
        return bool(self.requests)

    def step(self):
        time.sleep(0.005)
        out = [RequestOutput(rid, "x", [5], 1, 1) for rid in self.requests if rid != _WARMUP_ID]
        if self.requests.pop(_WARMUP_ID, None) is not None:
            out.append(RequestOutput(_WARMUP_ID, "", [], 1, 1, finished=True,
                                     finish_reason="length"))
        return out


def test_abort_all_gives_every_request_a_last_abort_output():
    stub = _StubEngine()
    engine = AsyncEngine(stub, "m", {})
    engine.start()

    async def one(rid):
        outs = [out async for out in engine.generate(rid, [1, 2], SamplingParams(max_tokens=9))]
        return outs[-1]

    async def main():
        tasks = [asyncio.create_task(one(f"r{i}")) for i in range(3)]
        while engine.num_in_flight() < 3 or len(stub.requests) < 3:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # some tokens first
        engine.abort_all()
        return await asyncio.wait_for(asyncio.gather(*tasks), 5)

    try:
        lasts = asyncio.run(main())
    finally:
        engine.shutdown(timeout=2)
    assert [(o.finished, o.finish_reason) for o in lasts] == [(True, "abort")] * 3
    assert not stub.requests and engine.num_in_flight() == 0
    assert not engine.is_healthy()  # draining: new requests get 503


def test_a_non_streamed_choice_aborted_by_the_shutdown_answers_503():
    state = ChoiceState(0)
    state.add(RequestOutput("r", "partial", [5], 3, 1))
    state.add(RequestOutput("r", "", [], 0, 0, finished=True, finish_reason="abort"))
    with pytest.raises(ApiError) as err:
        state.result()
    assert err.value.status == 503 and err.value.code == "shutting_down"
    done = ChoiceState(0)
    done.add(RequestOutput("r", "all", [5], 3, 1, finished=True, finish_reason="length"))
    assert done.result().finish_reason == "length"
