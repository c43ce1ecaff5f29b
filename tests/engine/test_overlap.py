"""The overlapped engine loop: step N+1 launched before step N's ids are on the host.

Its outputs must be exactly those of the one-step-at-a-time loop (same model, same
requests), whatever ends the sequences (EOS off / max_tokens / stop ids / stop strings),
with seeded sampling, penalties (which fall back to one step at a time), chunked prefill
and a cache small enough to force preemptions; and every KV block must be free at the
end. A real tiny Llama on the CPU through the real runner (placeholders are patched by
``patch_placeholders``, the same code as on the GPU).
"""

from __future__ import annotations

import pytest

from cvllm.engine.llm import LLM
from cvllm.sampling_params import SamplingParams
from tests.worker.tiny_llama import write_tiny_llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("overlap"))


def _llm(model_dir, **kw):
    opts = dict(weight_path=str(model_dir), cpu=True, max_num_seqs=8, kvcache_mem_mb=8,
                prefill_chunk_size=8, max_model_len=128)
    opts.update(kw)
    return LLM(**opts)


PROMPTS = [list(range(3, 15)), [9, 10, 11], list(range(40, 60)), [7] * 5, [100, 200, 300, 5]]


def _params():
    return [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[0, 1, 2, 3, 4, 5, 6, 7],
                       ignore_eos=True),
        # a negative frequency penalty rewards repeating: the last token -- in the
        # overlapped loop a placeholder, counted on the device -- decides the next one
        SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=1.3,
                       frequency_penalty=-2.0, presence_penalty=-2.0, ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=20, seed=3, max_tokens=15, ignore_eos=True,
                       logprobs=2),
    ]


def _run(llm, overlap: bool, track: list):
    engine = llm.engine
    engine.overlap = overlap
    launch = engine.runner.launch

    def counting_launch(step, seqs=None):
        track.append(engine.scheduler.num_in_flight)
        return launch(step, seqs)

    engine.runner.launch = counting_launch
    try:
        res = llm.generate(PROMPTS, _params())
    finally:
        engine.runner.launch = launch
    return [(r.token_ids, r.finish_reason) for r in res]


@pytest.mark.parametrize("num_blocks", [None, 4])
def test_overlapped_loop_equals_the_synchronous_one(model_dir, num_blocks):
    # 4 blocks of 16 tokens hold less than the 9 the requests need at once: preemptions
    llm = _llm(model_dir, num_blocks=num_blocks, max_model_len=64 if num_blocks else 128)
    sync_track, overlap_track = [], []
    want = _run(llm, False, sync_track)
    got = _run(llm, True, overlap_track)
    assert got == want
    assert max(sync_track) == 1  # one step in flight: the one being launched
    assert max(overlap_track) == 2  # N+1 launched while N was still in flight
    engine = llm.engine
    assert not engine.has_unfinished() and engine.scheduler.num_in_flight == 0
    assert all(g.num_free_blocks == g.num_total_blocks for g in engine.kv_cache_manager.groups)
    if num_blocks:
        assert engine.scheduler.num_preemptions_total > 0
    else:  # the penalties matter here, so the row above checks their counts overlapped
        plain = llm.generate([PROMPTS[3]], SamplingParams(temperature=0.0, max_tokens=10,
                                                          ignore_eos=True))[0].token_ids
        assert plain != got[3][0]


def test_stop_strings_and_aborts_in_flight(model_dir):
    llm = _llm(model_dir)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    text = llm.generate([PROMPTS[0]], params)[0].text
    stop = text.split()[3]  # a word the greedy run produces: it must stop there
    for overlap in (False, True):
        engine.overlap = overlap
        res = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=30,
                                                        ignore_eos=True, stop=[stop]))[0]
        assert res.finish_reason == "stop" and stop not in res.text
        assert text.startswith(res.text)
    # abort a request while two steps are in flight: its blocks come back afterwards
    engine.overlap = True
    engine.add_request("a", PROMPTS[2], params)
    engine.add_request("b", PROMPTS[1], params)
    for _ in range(4):
        engine.step()
    assert engine.scheduler.num_in_flight == 1  # the launched step N+1
    engine.abort_request("a")
    while engine.has_unfinished():
        engine.step()
    assert all(g.num_free_blocks == g.num_total_blocks for g in engine.kv_cache_manager.groups)
