import pytest

from cvllm.config import SchedulerConfig
from cvllm.core.block_manager import BlockManager
from cvllm.core.scheduler import Scheduler
from cvllm.core.sequence import Sequence, SequenceStatus
from cvllm.sampling_params import SamplingParams

EOS = 2


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_model_len=128,
                   chunk=16, budget=0):
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                          prefill_chunk_size=chunk, max_num_batched_tokens=budget)
    return Scheduler(cfg, BlockManager(num_blocks, block_size))


def make_seq(seq_id, prompt_len, **params):
    params.setdefault("temperature", 0.0)
    prompt = [100 + (seq_id * 7 + i) % 50 for i in range(prompt_len)]
    return Sequence(seq_id, f"req-{seq_id}", prompt, SamplingParams(**params), eos_token_ids=[EOS])


def default_token(seq):
    # Depends only on the sequence and how far it got, so preemption cannot change it.
    return 1000 + seq.seq_id * 100 + seq.num_confirmed_output_tokens


def check_invariants(sched, out):
    cfg, bm = sched.config, sched.block_manager
    # decodes are never held back: only they may take a step past the budget
    num_decodes = sum(1 for e in out.scheduled if e.samples and e.num_new_tokens == 1
                      and e.start == e.seq.num_tokens - 2)
    assert out.num_batched_tokens <= max(cfg.max_num_batched_tokens, num_decodes)
    assert out.num_seqs <= cfg.max_num_seqs
    assert sched.num_running <= cfg.max_num_seqs
    owned = [b for s in sched.running + list(sched.waiting) for b in s.block_ids]
    assert len(owned) == len(set(owned))
    assert len(owned) + bm.num_free_blocks == bm.num_total_blocks
    for e in out.scheduled:
        s = e.seq
        # schedule() counts the step's tokens as computed at once; a sampled row gets a
        # placeholder right after them
        assert 1 <= e.num_new_tokens and s.num_computed_tokens == e.start + e.num_new_tokens
        assert len(s.block_ids) * bm.block_size >= e.start + e.num_new_tokens
        if e.samples:
            assert e.sample_index == e.start + e.num_new_tokens == s.num_tokens - 1
            assert s.token_ids[e.sample_index] == -1 and s.num_pending_tokens == 1
        else:
            assert e.start + e.num_new_tokens < s.num_tokens and s.num_pending_tokens == 0


def step(sched, token_fn=default_token):
    out = sched.schedule()
    check_invariants(sched, out)
    sampled = {e.seq.seq_id: token_fn(e.seq) for e in out.scheduled if e.samples}
    return out, sched.update(out, sampled)


def run_all(sched, token_fn=default_token, max_steps=2000):
    outs, finished = [], []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return outs, finished
        out, fin = step(sched, token_fn)
        outs.append(out)
        finished.extend(fin)
    raise AssertionError("scheduler did not drain")


def test_chunked_prefill_splits_long_prompt():
    sched = make_scheduler(chunk=16)
    s = make_seq(0, 40, max_tokens=2)
    sched.add(s)
    chunks = []
    for _ in range(3):
        out, _ = step(sched)
        (e,) = out.scheduled
        chunks.append((e.num_new_tokens, e.samples))
    assert chunks == [(16, False), (16, False), (8, True)]
    assert s.num_computed_tokens == 40 and s.num_output_tokens == 1
    out, fin = step(sched)
    assert out.scheduled[0].num_new_tokens == 1 and fin == [s]
    assert s.finish_reason == "length"


def test_token_budget_respected_and_filled():
    sched = make_scheduler(chunk=16, budget=24, max_num_seqs=8)
    for i in range(5):
        sched.add(make_seq(i, 30, max_tokens=3))
    outs, finished = run_all(sched)
    assert all(o.num_batched_tokens <= 24 for o in outs)
    assert max(o.num_batched_tokens for o in outs) == 24
    assert len(finished) == 5 and all(s.num_output_tokens == 3 for s in finished)


def test_decodes_are_scheduled_first_and_get_budget_priority():
    sched = make_scheduler(chunk=8, budget=8)
    a = make_seq(0, 4, max_tokens=10)
    sched.add(a)
    step(sched)  # a's prefill
    b = make_seq(1, 30, max_tokens=2)
    sched.add(b)
    out, _ = step(sched)
    assert [(e.seq.seq_id, e.num_new_tokens) for e in out.scheduled] == [(0, 1), (1, 7)]
    out, _ = step(sched)
    assert [(e.seq.seq_id, e.num_new_tokens) for e in out.scheduled] == [(0, 1), (1, 7)]


def test_running_prefill_is_scheduled_before_new_admissions():
    sched = make_scheduler(chunk=8, budget=12)
    a, b = make_seq(0, 20, max_tokens=1), make_seq(1, 20, max_tokens=1)
    sched.add(a)
    sched.add(b)
    out, _ = step(sched)
    assert [(e.seq.seq_id, e.num_new_tokens) for e in out.scheduled] == [(0, 8), (1, 4)]
    out, _ = step(sched)
    assert [(e.seq.seq_id, e.num_new_tokens) for e in out.scheduled] == [(0, 8), (1, 4)]


def test_no_chunking_needs_whole_prompt_in_one_step():
    sched = make_scheduler(chunk=0, budget=32, max_model_len=64)
    a, b = make_seq(0, 20, max_tokens=1), make_seq(1, 20, max_tokens=1)
    sched.add(a)
    sched.add(b)
    out, _ = step(sched)
    assert [(e.seq.seq_id, e.num_new_tokens) for e in out.scheduled] == [(0, 20)]
    out, _ = step(sched)
    assert [(e.seq.seq_id, e.num_new_tokens) for e in out.scheduled] == [(1, 20)]


def test_no_chunking_prompt_over_budget_finishes_length_instead_of_waiting_forever():
    sched = make_scheduler(chunk=0, budget=16, max_model_len=64)
    s = make_seq(0, 20)
    sched.add(s)
    out = sched.schedule()
    assert out.is_empty and out.finished == [0]
    assert s.finish_reason == "length" and not sched.has_unfinished()


def test_max_num_seqs_caps_running():
    sched = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(i, 5, max_tokens=4) for i in range(5)]
    for s in seqs:
        sched.add(s)
    out, _ = step(sched)
    assert out.num_seqs == 2 and sched.num_running == 2 and sched.num_waiting == 3
    outs, finished = run_all(sched)
    assert all(o.num_seqs <= 2 for o in outs)
    assert sorted(s.seq_id for s in finished) == [0, 1, 2, 3, 4]


def _outputs_with_cache(num_blocks):
    sched = make_scheduler(num_blocks=num_blocks, block_size=4, chunk=8, budget=16)
    seqs = [make_seq(i, 8, max_tokens=10) for i in range(3)]
    for s in seqs:
        sched.add(s)
    outs, finished = run_all(sched)
    assert sched.block_manager.num_free_blocks == num_blocks
    return sched, seqs, outs


def test_preemption_by_recompute_gives_the_same_tokens():
    _, ref_seqs, _ = _outputs_with_cache(num_blocks=64)
    sched, seqs, outs = _outputs_with_cache(num_blocks=8)
    assert sched.num_preemptions_total >= 1
    preempted = [sid for o in outs for sid in o.preempted]
    # The most recently admitted sequence goes first, never the oldest.
    assert preempted and 0 not in preempted
    for s, ref in zip(seqs, ref_seqs):
        assert s.num_output_tokens == 10 and s.finish_reason == "length"
        assert s.output_token_ids == ref.output_token_ids
    assert sum(s.num_preemptions for s in seqs) == sched.num_preemptions_total


def test_preempted_sequence_recomputes_prompt_and_outputs():
    sched = make_scheduler(num_blocks=5, block_size=4, chunk=32, budget=64)
    a, b = make_seq(0, 8, max_tokens=20), make_seq(1, 8, max_tokens=20)
    sched.add(a)
    sched.add(b)
    while not b.num_preemptions:
        out, _ = step(sched)
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert b.block_ids == [] and sched.waiting[0] is b
    kept = b.num_output_tokens
    assert kept > 0
    while b.status is SequenceStatus.WAITING:
        out, _ = step(sched)
    (entry,) = [e for e in out.scheduled if e.seq is b]
    assert entry.num_new_tokens == 8 + kept and entry.samples


def test_preemption_skips_admission_in_the_same_step():
    # Small chunks: the preempted sequence's first chunk would fit in the blocks it freed.
    sched = make_scheduler(num_blocks=5, block_size=4, chunk=4, budget=64)
    a, b = make_seq(0, 8, max_tokens=20), make_seq(1, 8, max_tokens=20)
    sched.add(a)
    sched.add(b)
    for _ in range(20):
        running_before = {s.seq_id for s in sched.running}
        out, _ = step(sched)
        if out.preempted:
            assert out.preempted == [1]
            assert {e.seq.seq_id for e in out.scheduled} <= running_before - {1}
            assert sched.block_manager.num_free_blocks > 0  # room was there, yet nobody got in
            return
    raise AssertionError("expected a preemption")


def test_preempted_sequence_goes_to_the_front_of_the_queue():
    sched = make_scheduler(num_blocks=8, block_size=4, chunk=32, budget=64, max_num_seqs=2)
    a, b, c = (make_seq(i, 8, max_tokens=20) for i in range(3))
    for s in (a, b, c):
        sched.add(s)
    while not b.num_preemptions:
        step(sched)
    assert list(sched.waiting) == [b, c]
    outs, finished = run_all(sched)
    assert {s.seq_id for s in finished} == {0, 1, 2}
    assert all(s.num_output_tokens == 20 for s in (a, b, c))


def test_lone_sequence_larger_than_cache_finishes_length():
    sched = make_scheduler(num_blocks=2, block_size=4, max_model_len=64)
    s = make_seq(0, 6, max_tokens=None)
    sched.add(s)
    outs, finished = run_all(sched, max_steps=50)
    assert s.finish_reason == "length"
    assert s.num_tokens == 9  # 8 tokens fit in the cache; the 9th can never be computed
    assert sched.block_manager.num_free_blocks == 2
    # Finished inside schedule(): the engine learns it from SchedulerOutput.finished.
    assert finished == [] and outs[-1].is_empty and outs[-1].finished == [0]


def _scripted(tokens):
    return lambda seq: tokens[seq.num_confirmed_output_tokens]


def test_finish_on_eos():
    sched = make_scheduler()
    s = make_seq(0, 4, max_tokens=10)
    sched.add(s)
    _, finished = run_all(sched, _scripted([5, 6, EOS, 7]))
    assert finished == [s] and s.output_token_ids == [5, 6, EOS]
    assert s.status is SequenceStatus.FINISHED_STOPPED and s.finish_reason == "stop"
    assert s.stop_reason is None


def test_ignore_eos_keeps_going():
    sched = make_scheduler()
    s = make_seq(0, 4, max_tokens=4, ignore_eos=True)
    sched.add(s)
    run_all(sched, _scripted([EOS, EOS, EOS, EOS, EOS]))
    assert s.num_output_tokens == 4 and s.finish_reason == "length"


def test_stop_token_ids_set_stop_reason():
    sched = make_scheduler()
    s = make_seq(0, 4, max_tokens=10, stop_token_ids=[42], ignore_eos=True)
    sched.add(s)
    run_all(sched, _scripted([EOS, 42, 7]))
    assert s.output_token_ids == [EOS, 42]
    assert s.finish_reason == "stop" and s.stop_reason == 42


def test_min_tokens_delays_eos_and_stop_tokens():
    sched = make_scheduler()
    s = make_seq(0, 4, max_tokens=10, min_tokens=2, stop_token_ids=[42])
    sched.add(s)
    run_all(sched, _scripted([EOS, 42, EOS, 9]))
    # Two tokens generated before the EOS that may end it.
    assert s.output_token_ids == [EOS, 42, EOS] and s.finish_reason == "stop"


def test_max_tokens_uses_seq_cap():
    sched = make_scheduler()
    s = make_seq(0, 4, max_tokens=10)
    s.max_tokens = 3  # the engine may lower the cap
    sched.add(s)
    run_all(sched)
    assert s.num_output_tokens == 3 and s.finish_reason == "length"


def test_max_model_len_finishes_length():
    sched = make_scheduler(max_model_len=12)
    s = make_seq(0, 10, max_tokens=None)
    sched.add(s)
    run_all(sched)
    assert s.num_tokens == 12 and s.finish_reason == "length"


def test_add_rejects_duplicates():
    # A prompt over max_model_len is refused by the engine's admission, the one place a
    # prompt's length is checked (tests/engine/test_async_engine.py), not by add().
    sched = make_scheduler(max_model_len=12)
    sched.add(make_seq(1, 4))
    with pytest.raises(ValueError, match="already"):
        sched.add(make_seq(1, 4))


def test_abort_between_steps_frees_immediately():
    sched = make_scheduler()
    s = make_seq(0, 10, max_tokens=10)
    sched.add(s)
    step(sched)
    assert s.block_ids
    assert sched.abort("req-0") == [s]
    assert s.status is SequenceStatus.FINISHED_ABORTED and s.finish_reason == "abort"
    assert s.block_ids == [] and sched.block_manager.num_free_blocks == 64
    assert not sched.has_unfinished()
    assert sched.schedule().finished == [0]
    assert sched.abort("req-0") == [] and sched.abort("nope") == []


def test_abort_while_in_flight_defers_free_to_update():
    sched = make_scheduler()
    s = make_seq(0, 10, max_tokens=10)
    sched.add(s)
    out = sched.schedule()
    assert sched.abort("req-0") == [s]
    assert s.block_ids and sched.block_manager.num_free_blocks < 64  # ranks may still write
    assert sched.update(out, {0: 5}) == []
    assert s.output_token_ids == [] and s.block_ids == []
    assert sched.block_manager.num_free_blocks == 64


def test_abort_waiting_sequence():
    sched = make_scheduler(max_num_seqs=1)
    a, b = make_seq(0, 4), make_seq(1, 4)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert sched.abort("req-1") == [b] and sched.num_waiting == 0
    sched.update(out, {0: 5})
    assert sched.num_running == 1


def test_finish_for_stop_strings_by_request_or_seq_id():
    sched = make_scheduler()
    a, b = make_seq(0, 4), make_seq(1, 4)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert sched.finish("req-0", "stop", "\n\n") == [a]
    assert a.finish_reason == "stop" and a.stop_reason == "\n\n" and a.block_ids == []
    assert sched.finish(1, "stop") == [b]
    assert sched.finish(1, "stop") == []
    assert sched.block_manager.num_free_blocks == 64 and not sched.has_unfinished()
    with pytest.raises(ValueError):
        sched.finish(7, "done")


def test_step_protocol_errors():
    sched = make_scheduler()
    sched.add(make_seq(0, 4))
    out = sched.schedule()
    nxt = sched.schedule()  # one more may be scheduled while a step is in flight (overlap)
    assert nxt.scheduled[0].prev_row == 0
    with pytest.raises(RuntimeError, match="in flight"):
        sched.schedule()
    with pytest.raises(RuntimeError, match="oldest step in flight"):
        sched.update(nxt, {0: 6})
    with pytest.raises(ValueError, match="no sampled token"):
        sched.update(out, {})
    bad = type(out)(out.step_id + 1, out.scheduled)
    with pytest.raises(RuntimeError):
        sched.update(bad, {0: 5})
    sched.update(out, {0: 5})


def test_step_id_increments_only_with_work():
    sched = make_scheduler()
    empty = sched.schedule()
    assert empty.is_empty and empty.step_id == 0
    sched.add(make_seq(0, 4, max_tokens=2))
    ids = [o.step_id for o in run_all(sched)[0]]
    assert ids == [1, 2]
    assert sched.schedule().step_id == 2


def test_overlapped_schedule_placeholders_deferred_free_and_starvation():
    # Two sequences decode; step N+1 is scheduled before N's tokens are known.
    sched = make_scheduler(num_blocks=4, block_size=4, chunk=16)
    a, b = make_seq(0, 3, max_tokens=8), make_seq(1, 3, max_tokens=2)
    sched.add(a)
    sched.add(b)
    n1 = sched.schedule()
    n2 = sched.schedule()  # overlapped: both decode their placeholder
    assert [e.prev_row for e in n2.scheduled] == [0, 1]
    assert a.token_ids[-2:] == [-1, -1] and a.num_pending_tokens == 2
    # b's max_tokens=2: its step-N+1 token is its last, so N+2 must not schedule it
    sched.update(n1, {0: 50, 1: 60})
    assert a.token_ids[-2:] == [50, -1] and a.confirmed_output_token_ids == [50]
    assert a.confirmed_output_token_ids_from(0) == [50]  # the engine's per-step slice
    assert a.confirmed_output_token_ids_from(1) == [] == a.confirmed_output_token_ids_from(5)
    n3 = sched.schedule()
    assert [e.seq for e in n3.scheduled] == [a]
    # abort a while two steps use it: its blocks come back after the last of them
    sched.abort("req-0")
    assert a.num_pending_tokens == 0 and a.token_ids[-1] == 50
    sched.update(n2, {0: 51, 1: 61})
    assert b.is_finished() and b.output_token_ids == [60, 61] and b.finish_reason == "length"
    bm = sched.block_manager  # b is free now; aborted a waits for step N+2 (still in flight)
    assert len(a.block_ids) > 0 and bm.num_free_blocks == bm.num_total_blocks - len(a.block_ids)
    sched.update(n3, {0: 52})
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_total_blocks
    # a full cache with a step in flight: no preemption, the output says starved
    sched = make_scheduler(num_blocks=2, block_size=4, chunk=16)
    c, d = make_seq(2, 4, max_tokens=8), make_seq(3, 4, max_tokens=8)
    sched.add(c)
    sched.add(d)
    first = sched.schedule()
    nxt = sched.schedule()  # both need a second block; none is free
    assert nxt.starved and not nxt.scheduled and sched.num_preemptions_total == 0
    sched.update(first, {2: 7, 3: 8})
    again = sched.schedule()  # nothing in flight: now it preempts
    assert sched.num_preemptions_total == 1 and not again.starved
