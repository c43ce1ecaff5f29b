"""AsyncEngine around an LLMEngine whose runner is a stand-in (no model): readiness after
the warm-up step, per-request streams, abort freeing KV blocks, and a dying engine loop
turning unhealthy and failing its requests instead of hanging them."""

import asyncio
import time

import numpy as np
import pytest

from cvllm.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from cvllm.engine.async_engine import AsyncEngine, EngineDeadError
from cvllm.core.prompt_limits import PromptTooLongError
from cvllm.engine.llm_engine import LLMEngine
from cvllm.engine.tokenizer import Tokenizer
from cvllm.sampling_params import SamplingParams
from cvllm.worker.model_runner import StepResult


class CountingRunner:
    """Samples last-token + 1 for every row; can be told to fail at a given step."""

    num_blocks = 64

    def __init__(self, fail_at_step=None, delay_s=0.0):
        self.steps = 0
        self.fail_at_step = fail_at_step
        self.delay_s = delay_s  # a step's time, so a request is still running when looked at

    def execute(self, step, sampling):
        self.steps += 1
        if self.fail_at_step is not None and self.steps >= self.fail_at_step:
            raise RuntimeError("simulated device failure")
        time.sleep(self.delay_s)
        if sampling is None or not sampling.num_rows:
            return None
        # the last input token of each sampling row, plus one
        return StepResult(token_ids=step.input_ids[step.logits_indices].astype(np.int64) + 1)


@pytest.fixture(scope="module")
def tokenizer(default_gguf):
    from cvllm import loader

    return Tokenizer(loader.load_tokenizer(loader.resolve_model_source(None, str(default_gguf))))


def _engine(tokenizer, runner) -> AsyncEngine:
    hf = dict(hidden_size=8, num_hidden_layers=1, num_attention_heads=1, vocab_size=49152,
              max_position_embeddings=256)
    config = EngineConfig(model=ModelConfig("LlamaForCausalLM", hf, eos_token_ids=[2], bos_token_id=1),
                          cache=CacheConfig(block_size=16), scheduler=SchedulerConfig(max_model_len=256),
                          device=DeviceConfig())
    return AsyncEngine(LLMEngine(config, tokenizer, runner), "m", {})


async def _collect(engine, rid, prompt, params):
    outs = []
    async for out in engine.generate(rid, prompt, params):
        outs.append(out)
    return outs


async def _wait(pred, timeout=5.0):
    for _ in range(int(timeout / 0.02)):
        if pred():
            return True
        await asyncio.sleep(0.02)
    return pred()


def test_ready_then_streams_and_aborts(tokenizer):
    async def main():
        # 5 ms a step: request b's 200 steps outlast the checks below (no race with the
        # engine thread finishing it first)
        engine = _engine(tokenizer, CountingRunner(delay_s=0.005))
        assert not engine.is_ready()
        engine.start()
        assert await _wait(engine.is_ready)
        outs = await _collect(engine, "a", [100, 101, 102], SamplingParams(temperature=0, max_tokens=5))
        assert [t for o in outs for t in o.delta_token_ids] == [103, 104, 105, 106, 107]
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        # Leave a long request early: its blocks must come back.
        gen = engine.generate("b", [100] * 40, SamplingParams(max_tokens=200, ignore_eos=True))
        await gen.__anext__()
        assert engine.engine.block_manager.num_free_blocks < 64
        await gen.aclose()
        assert await _wait(lambda: engine.engine.block_manager.num_free_blocks == 64)
        assert engine.engine.finished_by_reason["abort"] == 1
        with pytest.raises(PromptTooLongError, match="256"):
            await _collect(engine, "c", [5] * 300, SamplingParams())
        engine.shutdown()

    asyncio.run(main())


def test_the_engine_admission_refuses_what_fills_the_context(tokenizer):
    """``LLMEngine.add_request`` checks a prompt's length (the one place: the scheduler
    trusts it, the server asks the same rule): a prompt of ``max_model_len`` tokens or
    more, or none, is refused and leaves nothing behind; one token less is admitted."""
    engine = _engine(tokenizer, CountingRunner()).engine
    for n in (256, 300):
        with pytest.raises(PromptTooLongError, match="maximum context length is 256") as e:
            engine.add_request("x", [5] * n, SamplingParams())
        assert e.value.code == "context_length_exceeded" and e.value.num_prompt_tokens == n
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("x", [], SamplingParams())
    assert not engine.requests and not engine.scheduler.has_unfinished()
    engine.add_request("x", [5] * 255, SamplingParams(max_tokens=1))
    assert "x" in engine.requests and engine.scheduler.has_unfinished()


def test_dead_engine_loop_fails_requests_and_health(tokenizer):
    async def main():
        engine = _engine(tokenizer, CountingRunner(fail_at_step=3))
        engine.start()
        assert await _wait(engine.is_ready)
        with pytest.raises(EngineDeadError, match="simulated device failure"):
            await asyncio.wait_for(_collect(engine, "x", [100, 101], SamplingParams(max_tokens=50)), 5)
        assert not engine.is_healthy()
        with pytest.raises(EngineDeadError):
            await _collect(engine, "y", [100], SamplingParams())
        engine.shutdown()

    asyncio.run(main())
