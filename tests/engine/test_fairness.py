"""The step token budget through the real engine (issue 14 item 4), with a tiny Llama on
the CPU: while a long prompt is prefilled, a decoding stream gets a token every step, a
short request sent meanwhile gets its first token long before the long one, every step
stays within the budget, and each request's greedy tokens equal those it gets alone. Also
the budget's defaults and how --prefill-chunk-size relates to it."""

from __future__ import annotations

import pytest

from cvllm.engine.builder import build_engine_config
from cvllm.engine.llm import LLM
from cvllm.sampling_params import SamplingParams
from tests.worker.tiny_llama import write_tiny_llama

BUDGET = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("fairness"))


def _llm(model_dir, **kw):
    return LLM(weight_path=str(model_dir), cpu=True, max_num_seqs=8, kvcache_mem_mb=16,
               max_model_len=256, **kw)


STREAM, LONG, SHORT = [5, 6, 7, 8], [(i * 37) % 400 + 10 for i in range(150)], [11, 12, 13, 14, 15]


def _greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _alone(model_dir, prompt, n):
    return _llm(model_dir, max_num_batched_tokens=BUDGET).generate([prompt], _greedy(n))[0].token_ids


def test_long_prompt_leaves_room_for_decodes_and_new_requests(model_dir):
    llm = _llm(model_dir, max_num_batched_tokens=BUDGET)
    engine = llm.engine
    assert engine.config.scheduler.max_num_batched_tokens == BUDGET
    sizes = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        sizes.append(out.num_batched_tokens)
        return out

    engine.scheduler.schedule = recording_schedule
    tokens = {"stream": [], "long": [], "short": []}
    first_at = {}

    def step():
        for out in engine.step():
            tokens[out.request_id].extend(out.delta_token_ids)
            if out.delta_token_ids:
                first_at.setdefault(out.request_id, n_steps)

    engine.add_request("stream", STREAM, _greedy(40))
    n_steps = 0
    while not tokens["stream"]:
        step()
    engine.add_request("long", LONG, _greedy(3))
    stream_before = len(tokens["stream"])
    start = n_steps = 1
    step()
    engine.add_request("short", SHORT, _greedy(4))
    while not tokens["long"]:
        n_steps += 1
        step()
    # a stream token from every step while the long prompt was prefilled
    assert len(tokens["stream"]) - stream_before == n_steps - start + 1
    # the short one was admitted at the next step, beside the long one, and answered
    # right away; the long one needed all of its ~10 steps
    assert first_at["short"] == start + 1 < first_at["long"] == n_steps
    assert n_steps >= len(LONG) // BUDGET
    while engine.has_unfinished():
        step()
    assert max(sizes) == BUDGET and all(s <= BUDGET for s in sizes)
    # chunking and the budget's sharing change no token
    assert tokens["short"] == _alone(model_dir, SHORT, 4)
    assert tokens["long"] == _alone(model_dir, LONG, 3)
    assert tokens["stream"] == _alone(model_dir, STREAM, 40)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


@pytest.mark.parametrize("kw,budget,chunk_limit", [
    ({}, 128, 256),  # the CPU default; no cap per sequence but the budget
    ({"max_num_batched_tokens": 64}, 64, 256),
    ({"prefill_chunk_size": 32}, 32, 32),  # the chunk size alone also sets the budget
    ({"prefill_chunk_size": 32, "max_num_batched_tokens": 96}, 96, 32),
    ({"prefill_chunk_size": 0}, 256, 256),  # no chunking: a whole prompt fits a step
])
def test_budget_defaults_on_the_cpu(model_dir, kw, budget, chunk_limit):
    setup = build_engine_config(weight_path=str(model_dir), cpu=True, max_num_seqs=8,
                                max_model_len=256, **kw)
    sched = setup.config.scheduler
    assert (sched.max_num_batched_tokens, sched.chunk_limit) == (budget, chunk_limit)


def test_cpu_engine_runs_one_step_at_a_time(model_dir):
    # launch() on the CPU computes the whole step: overlapping would only delay outputs
    assert _llm(model_dir).engine.overlap is False
