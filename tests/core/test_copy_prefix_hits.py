"""A lone sequence's prefix hit taken as copies (``SchedulerConfig.copy_prefix_hits``, on
the CPU): fresh consecutive blocks and (src, dst) pairs from the KV cache manager, the
scheduler asking for them only while nothing else runs, and the pairs on the wire."""

import numpy as np
import pytest

from cvllm.config import SchedulerConfig
from cvllm.core.kv_cache_manager import KVCacheGroupConfig, KVCacheLayout, KVCacheManager
from cvllm.core.prefix_cache import PrefixHit
from cvllm.core.scheduler import Scheduler
from cvllm.core.sequence import Sequence
from cvllm.core.step_builder import build_step_input
from cvllm.core.step_input import StepInput
from cvllm.core.wire_format import StepInputError
from cvllm.sampling_params import SamplingParams

BS = 4
PROMPT = [7 + i for i in range(13)]  # 3 full blocks and one token


def _seq(seq_id, tokens=PROMPT):
    return Sequence(seq_id, f"r{seq_id}", list(tokens),
                    SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))


def _kv(num_blocks=32, groups=None, slots=0):
    layout = KVCacheLayout(BS, groups or (KVCacheGroupConfig(None, num_blocks),), slots)
    return KVCacheManager.from_layout(layout, enable_caching=True)


def _scheduler(kv, copy=True, max_num_seqs=4):
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=64, prefill_chunk_size=64,
                          copy_prefix_hits=copy)
    return Scheduler(cfg, kv)


def _finish(sched):
    """Run the scheduler to the end with a fake sampler; the outputs."""
    outs = []
    while sched.has_unfinished():
        out = sched.schedule()
        outs.append(out)
        sched.update(out, {e.seq.seq_id: 3 for e in out.scheduled if e.samples})
    return outs


def _cached_first(kv):
    """A first sequence computed and finished: its full blocks stay cached."""
    first = _seq(0)
    kv.allocate(first, first.num_tokens)
    first.num_computed_tokens = first.num_tokens
    kv.cache_blocks(first)
    blocks = list(first.group_block_ids(0))
    kv.free(first)
    return blocks


def test_the_manager_gives_fresh_consecutive_blocks_and_the_pairs():
    kv = _kv()
    cached = _cached_first(kv)  # [0, 1, 2, 3]: 0-2 full and cached, 3 free again
    g = kv.groups[0]
    seq = _seq(1)
    hit = kv.find_cached_prefix(seq)
    assert hit.num_tokens == 12 and hit.blocks[0] == cached[:3]
    seq.num_computed_tokens = hit.num_tokens
    pairs = kv.allocate_copying_hit(seq, 1, hit)
    ids = seq.group_block_ids(0)
    assert [s for s, _ in pairs] == cached[:3]
    assert [d for _, d in pairs] == ids[:3] and not set(ids) & set(cached[:3])
    assert ids == list(range(ids[0], ids[0] + 4))  # consecutive: read in place
    # the cached blocks are untouched: nobody holds them, they still serve hits
    assert all(g.ref_count(b) == 0 and g.is_cached(b) for b in cached[:3])
    assert kv.find_cached_prefix(_seq(2)).blocks[0] == cached[:3]


def test_the_manager_declines_without_plainly_free_blocks_or_with_groups_or_state():
    kv = _kv(num_blocks=5)
    _cached_first(kv)  # 3 cached, 2 plainly free: a copy needs 4
    seq = _seq(1)
    hit = kv.find_cached_prefix(seq)
    seq.num_computed_tokens = hit.num_tokens
    free_before = kv.groups[0].num_free_blocks
    assert kv.allocate_copying_hit(seq, 1, hit) is None
    assert seq.group_block_ids(0) == [] and kv.groups[0].num_free_blocks == free_before
    kv.allocate(seq, 1, hit)  # sharing still works
    assert seq.group_block_ids(0)[:3] == hit.blocks[0]

    two = _kv(groups=(KVCacheGroupConfig(None, 32), KVCacheGroupConfig(8, 32)))
    s2 = _seq(3)
    s2.num_computed_tokens = 4
    assert two.allocate_copying_hit(s2, 1, PrefixHit(4, [[0], [0]])) is None
    state = _kv(slots=2)
    assert state.allocate_copying_hit(s2, 1, PrefixHit(4, [[0]])) is None
    sliding = _kv(groups=(KVCacheGroupConfig(8, 32),))  # Mistral-style: one sliding group
    assert sliding.allocate_copying_hit(s2, 1, PrefixHit(4, [[0]])) is None
    assert s2.group_block_ids(0) == []


def test_the_scheduler_copies_only_for_a_lone_admission():
    kv = _kv()
    sched = _scheduler(kv)
    sched.add(_seq(0))
    outs = _finish(sched)
    assert all(not o.block_copies for o in outs)  # nothing cached yet
    cached = [b for b in range(kv.groups[0].num_total_blocks) if kv.groups[0].is_cached(b)]

    lone = _seq(1)
    sched.add(lone)
    out = sched.schedule()
    assert len(out.block_copies) == 3 and [s for s, _ in out.block_copies] == cached[:3]
    assert out.scheduled[0].start == 12 and out.scheduled[0].num_new_tokens == 1
    ids = lone.group_block_ids(0)
    assert [d for _, d in out.block_copies] == ids[:3]
    step = build_step_input(out, BS)
    assert step.block_copies.tolist() == [list(p) for p in out.block_copies]
    step.validate(BS, kv.groups[0].num_total_blocks)
    sched.update(out, {1: 3})

    # beside a running sequence, a hit is shared as before
    beside = _seq(2)
    sched.add(beside)
    out = sched.schedule()
    assert not out.block_copies and beside.group_block_ids(0)[:3] == cached[:3]
    sched.update(out, {e.seq.seq_id: 3 for e in out.scheduled if e.samples})
    _finish(sched)
    g = kv.groups[0]
    assert g.num_free_blocks == g.num_total_blocks  # every copy and share came back


def test_off_by_default_and_when_switched_off():
    assert not SchedulerConfig().copy_prefix_hits
    kv = _kv()
    sched = _scheduler(kv, copy=False)
    sched.add(_seq(0))
    _finish(sched)
    sched.add(_seq(1))
    assert not sched.schedule().block_copies


def _step_with(copies):
    step = StepInput.empty(5)
    step.block_copies = np.asarray(copies, np.int32).reshape(-1, 2)
    return step


def test_block_copies_travel_and_bad_ones_are_refused():
    step = _step_with([[0, 7], [1, 8]])
    back = StepInput.unpack(step.pack())
    assert back == step and back.block_copies.tolist() == [[0, 7], [1, 8]]
    assert StepInput.unpack(StepInput.empty(6).pack()).block_copies.shape == (0, 2)
    for bad, what in (([[-1, 3]], "non-negative"), ([[0, 3], [1, 3]], "distinct"),
                      ([[0, 3], [3, 4]], "distinct")):
        with pytest.raises(StepInputError, match=what):
            _step_with(bad).validate()
    with pytest.raises(StepInputError, match="num_blocks=8"):
        _step_with([[0, 9]]).validate(BS, 8)


def test_a_sliding_window_hit_is_shared_not_copied():
    """A hit of a sliding group starts with placeholders (blocks no query sees): nothing
    to copy from, so such a model shares its hits whatever the flag says."""
    kv = _kv(groups=(KVCacheGroupConfig(8, 64),))
    sched = _scheduler(kv)
    long_prompt = [7 + i for i in range(21)]  # 5 full blocks
    sched.add(_seq(0, long_prompt))
    _finish(sched)
    again = _seq(1, long_prompt)
    sched.add(again)
    out = sched.schedule()
    assert not out.block_copies and again.num_computed_tokens > 0
    assert -1 in again.group_block_ids(0)  # placeholders before the window: shared hit
    build_step_input(out, BS, (8,)).validate(BS, 64)
    sched.update(out, {1: 3})
    _finish(sched)
