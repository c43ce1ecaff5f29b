"""KV cache groups and state slots on the scheduler's side: sliding-window groups free the
blocks no future query can see (HF's window: query p sees keys p-W < j <= p), the
scheduler admits and preempts across every group, and linear-attention state slots are
assigned on admission and come back on finish, abort and preemption."""

import math
import random

import pytest

from cvllm.config import SchedulerConfig
from cvllm.core.block_manager import (
    PLACEHOLDER_BLOCK,
    BlockManager,
    NoFreeBlocksError,
    max_live_blocks,
)
from cvllm.core.kv_cache_manager import KVCacheGroupConfig, KVCacheLayout, KVCacheManager
from cvllm.core.scheduler import Scheduler
from cvllm.core.sequence import Sequence, SequenceStatus
from cvllm.sampling_params import SamplingParams


def _seq(seq_id=0, n=4, **params):
    params.setdefault("temperature", 0.0)
    params.setdefault("ignore_eos", True)
    return Sequence(seq_id, f"r{seq_id}", [5 + i % 50 for i in range(n)], SamplingParams(**params))


def _scheduler(layout, max_num_seqs=4, max_model_len=256, chunk=8, budget=0):
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                          prefill_chunk_size=chunk, max_num_batched_tokens=budget)
    return Scheduler(cfg, KVCacheManager.from_layout(layout))


def _run(sched, on_step=None, max_steps=10_000):
    """Drive schedule/update with a fake sampler until every sequence finished."""
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return
        out = sched.schedule()
        if on_step:
            on_step(sched, out, "scheduled")
        sched.update(out, {e.seq.seq_id: 7 for e in out.scheduled if e.samples})
        if on_step:
            on_step(sched, out, "updated")
    raise AssertionError("did not finish")


@pytest.mark.parametrize("window,bs", [(1, 4), (3, 4), (4, 4), (5, 4), (8, 8), (13, 8)])
def test_freed_blocks_are_exactly_those_no_future_query_sees(window, bs):
    bm = BlockManager(64, bs, sliding_window=window)
    s = _seq(n=200)
    for c in range(1, 150):
        bm.allocate(s, 1)
        s.num_computed_tokens = c
        bm.remove_out_of_window_blocks(s)
        ids = s.block_ids
        for i, b in enumerate(ids):
            # Block i is needed iff some key in it is visible to a query at position >= c.
            needed = (i + 1) * bs - 1 > c - window
            assert (b != PLACEHOLDER_BLOCK) == needed, (c, i, ids)
        assert bm.num_live_blocks(s) + bm.num_free_blocks == 64
        assert bm.num_live_blocks(s) <= math.ceil(window / bs) + 1
    bm.free(s)
    assert bm.num_free_blocks == 64 and s.block_ids == []


def test_full_group_never_frees():
    bm = BlockManager(16, 4)
    s = _seq(n=40)
    bm.allocate(s, 40)
    s.num_computed_tokens = 40
    assert bm.remove_out_of_window_blocks(s) == [] and len(s.block_ids) == 10


def test_max_live_blocks_bound():
    for W in (1, 2, 7, 8, 9, 33):
        for bs in (4, 8):
            for n in (1, 3, 8, 17):
                worst = 0
                for c in range(0, 120):
                    first = max(0, c - W + 1) // bs
                    last = (c + n - 1) // bs
                    worst = max(worst, last - first + 1)
                assert worst <= max_live_blocks(10_000, n, bs, W) == math.ceil((W - 1 + n) / bs) + 1


def _mistral_layout(num_blocks, window=8, bs=4):
    return KVCacheLayout(bs, (KVCacheGroupConfig(window, num_blocks, (0, 1)),))


def test_mistral_style_long_generation_keeps_a_window_of_blocks():
    window, bs = 8, 4
    # Full attention would need 200/4 = 50 blocks per sequence; the pool has 20 for three.
    sched = _scheduler(_mistral_layout(20, window, bs), max_num_seqs=3, chunk=6)
    bm = sched.block_manager
    seqs = [_seq(i, n=10 + 3 * i, max_tokens=180) for i in range(3)]
    for s in seqs:
        sched.add(s)

    def check(sched, out, phase):
        for s in sched.running:
            live = bm.num_live_blocks(s)
            if phase == "updated":
                assert live <= math.ceil(window / bs) + 1
            else:
                n = next((e.num_new_tokens for e in out.scheduled if e.seq is s), 0)
                assert live <= math.ceil((window - 1 + n) / bs) + 1
        owned = [b for s in sched.running for b in s.block_ids if b != PLACEHOLDER_BLOCK]
        assert len(owned) == len(set(owned))
        assert len(owned) + bm.num_free_blocks == bm.num_total_blocks

    _run(sched, check)
    assert all(s.num_output_tokens == 180 for s in seqs)
    assert sched.num_preemptions_total == 0 and bm.num_free_blocks == 20


def test_mixed_groups_account_for_both_pools():
    bs = 4
    layout = KVCacheLayout(bs, (KVCacheGroupConfig(None, 40, (1,)),
                                KVCacheGroupConfig(6, 12, (0, 2))))
    sched = _scheduler(layout, max_num_seqs=3, chunk=5)
    full, sliding = sched.kv_cache_manager.groups
    seqs = [_seq(i, n=9 + 5 * i, max_tokens=30) for i in range(3)]
    for s in seqs:
        sched.add(s)
    seen_preempt = []

    def check(sched, out, phase):
        seen_preempt.extend(out.preempted if phase == "scheduled" else [])
        for s in sched.running:
            assert len(s.group_block_ids(0)) * bs >= s.num_computed_tokens
            assert all(b != PLACEHOLDER_BLOCK for b in s.group_block_ids(0))
            if phase == "updated":
                assert sliding.num_live_blocks(s) <= math.ceil(6 / bs) + 1
        for g in (full, sliding):
            owned = [b for s in sched.running for b in s.group_block_ids(g.group) if b >= 0]
            assert len(owned) == len(set(owned))
            assert len(owned) + g.num_free_blocks == g.num_total_blocks

    _run(sched, check)
    assert all(s.num_output_tokens == 30 for s in seqs)
    assert full.num_free_blocks == 40 and sliding.num_free_blocks == 12


def test_sliding_group_shortage_preempts_and_recovers():
    # The full group is roomy; the sliding group holds only two sequences' windows.
    bs, window = 4, 8
    per_seq = max_live_blocks(10_000, 4, bs, window)
    layout = KVCacheLayout(bs, (KVCacheGroupConfig(None, 200, (0,)),
                                KVCacheGroupConfig(window, 2 * per_seq, (1,))))
    sched = _scheduler(layout, max_num_seqs=4, chunk=4, budget=16)
    seqs = [_seq(i, n=12, max_tokens=20) for i in range(4)]
    for s in seqs:
        sched.add(s)
    _run(sched)
    assert all(s.num_output_tokens == 20 for s in seqs)
    groups = sched.kv_cache_manager.groups
    assert [g.num_free_blocks for g in groups] == [200, 2 * per_seq]


def test_can_ever_fit_uses_the_window_not_the_length():
    # 9 blocks of 4 tokens: a 100-token sequence fits a window of 8 but not full attention.
    sched = _scheduler(_mistral_layout(9, window=8, bs=4), max_num_seqs=1, chunk=8)
    s = _seq(0, n=60, max_tokens=40)
    sched.add(s)
    _run(sched)
    assert s.num_output_tokens == 40 and s.finish_reason == "length"
    full = Scheduler(SchedulerConfig(max_num_seqs=1, max_model_len=256, prefill_chunk_size=8),
                     BlockManager(9, 4))
    t = _seq(1, n=60, max_tokens=40)
    full.add(t)
    out = full.schedule()
    assert out.is_empty and t.is_finished() and 1 in out.finished


def test_kv_manager_allocate_is_all_or_nothing():
    layout = KVCacheLayout(4, (KVCacheGroupConfig(None, 8), KVCacheGroupConfig(4, 1)))
    kv = KVCacheManager.from_layout(layout)
    s = _seq(n=20)
    with pytest.raises(NoFreeBlocksError, match="group"):
        kv.allocate(s, 8)  # 2 blocks: group 0 could, group 1 cannot
    assert s.block_ids_by_group in ([[]], [[], []]) and kv.groups[0].num_free_blocks == 8


def test_layout_validation():
    with pytest.raises(ValueError):
        KVCacheLayout(4, ())
    with pytest.raises(ValueError, match="share a window"):
        KVCacheLayout(4, (KVCacheGroupConfig(8, 4), KVCacheGroupConfig(8, 4)))
    assert KVCacheLayout.single(10, 16).windows == [None]


# ----- state slots ------------------------------------------------------------------------


def _state_layout(num_blocks=64, slots=3):
    return KVCacheLayout(4, (KVCacheGroupConfig(None, num_blocks, (1,)),), num_state_slots=slots)


def test_state_slots_assigned_on_admission_and_freed_on_finish_and_abort():
    sched = _scheduler(_state_layout(slots=3), max_num_seqs=3, budget=64)
    kv = sched.kv_cache_manager
    a, b, c, d = (_seq(i, n=5, max_tokens=3) for i in range(4))
    for s in (a, b, c, d):
        sched.add(s)
        assert s.state_slot == -1
    out = sched.schedule()
    assert [e.seq for e in out.scheduled] == [a, b, c]
    assert sorted(s.state_slot for s in (a, b, c)) == [0, 1, 2] and d.state_slot == -1
    assert kv.num_free_state_slots == 0
    sched.abort("r1")  # in flight: its slot comes back only after update
    assert b.state_slot >= 0
    sched.update(out, {a.seq_id: 7, c.seq_id: 7})
    assert b.state_slot == -1 and kv.num_free_state_slots == 1
    out = sched.schedule()
    assert d in [e.seq for e in out.scheduled] and d.state_slot >= 0
    sched.update(out, {e.seq.seq_id: 7 for e in out.scheduled if e.samples})
    _run(sched)
    assert all(s.state_slot == -1 for s in (a, b, c, d))
    assert kv.num_free_state_slots == 3


def test_preemption_releases_the_state_slot_and_readmission_gets_one():
    # 6 blocks of 4: two 12-token prompts growing to 20+ tokens cannot both stay.
    sched = _scheduler(_state_layout(num_blocks=6, slots=2), max_num_seqs=2, chunk=16)
    kv = sched.kv_cache_manager
    a, b = _seq(0, n=12, max_tokens=10), _seq(1, n=8, max_tokens=10)
    sched.add(a)
    sched.add(b)
    preempted = []

    def check(sched, out, phase):
        if phase == "scheduled":
            preempted.extend(out.preempted)
            slots = [s.state_slot for s in sched.running]
            assert all(x >= 0 for x in slots) and len(set(slots)) == len(slots)
            for s in sched.waiting:
                assert s.state_slot == -1 and s.num_computed_tokens == 0
            for e in out.scheduled:  # a fresh start is exactly "no computed tokens"
                assert e.seq.state_slot >= 0
        assert kv.num_free_state_slots == 2 - len(sched.running)

    _run(sched, check)
    assert preempted, "the test must exercise preemption"
    assert a.num_output_tokens == b.num_output_tokens == 10
    assert kv.num_free_state_slots == 2


def test_random_workload_keeps_every_pool_consistent():
    rng = random.Random(0)
    layout = KVCacheLayout(4, (KVCacheGroupConfig(None, 30, (0,)), KVCacheGroupConfig(5, 14, (1,)),
                               KVCacheGroupConfig(9, 16, (2,))), num_state_slots=4)
    sched = _scheduler(layout, max_num_seqs=4, chunk=6, budget=12)
    seqs = [_seq(i, n=rng.randint(3, 30), max_tokens=rng.randint(1, 25)) for i in range(12)]
    for s in seqs:
        sched.add(s)
    kv = sched.kv_cache_manager

    def check(sched, out, phase):
        if phase == "scheduled" and rng.random() < 0.05 and sched.running:
            sched.abort(rng.choice(sched.running).request_id)
        for g in kv.groups:
            owned = [b for s in sched.running for b in s.group_block_ids(g.group) if b >= 0]
            assert len(owned) == len(set(owned))
        slots = [s.state_slot for s in sched.running]
        assert len(set(slots)) == len(slots) and all(x >= 0 for x in slots)

    _run(sched, check)
    assert [g.num_free_blocks for g in kv.groups] == [30, 14, 16]
    assert kv.num_free_state_slots == 4
    assert all(s.is_finished() for s in seqs)
    assert all(s.status is not SequenceStatus.RUNNING for s in seqs)
