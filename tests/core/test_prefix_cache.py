"""Prefix caching on the scheduler's side: content keys, the three block states (free,
cached, used), LRU eviction only when the free blocks run out, hits across full and
sliding-window groups, the last token always computed, chunked prefill after a hit,
same-step sharing between choices of one prompt, re-admission after preemption, and
placeholders (tokens a step in flight samples) never hashed."""

import pytest

from cvllm.config import SchedulerConfig
from cvllm.core.block_manager import PLACEHOLDER_BLOCK, BlockManager
from cvllm.core.kv_cache_manager import KVCacheGroupConfig, KVCacheLayout, KVCacheManager
from cvllm.core.prefix_cache import hash_block_tokens
from cvllm.core.scheduler import Scheduler
from cvllm.core.sequence import Sequence
from cvllm.core.step_builder import build_step_input
from cvllm.sampling_params import SamplingParams

BS = 4


def _seq(seq_id, tokens, max_tokens=4):
    return Sequence(seq_id, f"r{seq_id}", tokens,
                    SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens))


def _kv(num_blocks=16, windows=(None,), cap=None):
    layout = KVCacheLayout(BS, tuple(KVCacheGroupConfig(w, num_blocks) for w in windows))
    return KVCacheManager.from_layout(layout, enable_caching=True,
                                      max_cached_tokens=None if cap is None else cap * BS)


def _scheduler(kv, chunk=64, max_num_seqs=4, budget=0):
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=128,
                          prefill_chunk_size=chunk, max_num_batched_tokens=budget)
    return Scheduler(cfg, kv)


def _drain(sched):
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update(out, {e.seq.seq_id: 7 for e in out.scheduled if e.samples})


def _admit(kv, seq):
    """What the scheduler does for a waiting sequence, without a scheduler."""
    hit = kv.find_cached_prefix(seq)
    seq.num_computed_tokens = hit.num_tokens
    kv.allocate(seq, seq.num_tokens - hit.num_tokens, hit)
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_blocks(seq)
    return hit


def _evict(bm, block_hash):
    """Evict one cached, unused block as an allocation would."""
    b = bm._block_of[block_hash]
    del bm._evictable[b]
    bm._uncache(b)
    bm._free.append(b)


def test_keys_chain_over_the_prefix_and_extra_keys():
    a = _seq(0, list(range(12)))
    b = _seq(1, list(range(8)) + [99, 9, 10, 11])
    ha, hb = a.update_block_hashes(BS), b.update_block_hashes(BS)
    assert len(ha) == 3 and ha[:2] == hb[:2] and ha[2] != hb[2]
    c = _seq(2, [5] + list(range(1, 12)))  # block 0 differs: so does every later key
    assert all(x != y for x, y in zip(ha, c.update_block_hashes(BS)))
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [1, 2], ("adapter-a",))
    d = _seq(3, list(range(12)))
    d.extra_hash_keys = ("adapter-a",)
    assert d.update_block_hashes(BS)[0] != ha[0]
    # Placeholders are never hashed: only confirmed tokens count.
    e = _seq(4, list(range(7)))
    e.append_placeholder(0)
    assert len(e.update_block_hashes(BS)) == 1
    e.resolve_placeholder(7, 7)
    assert e.update_block_hashes(BS) == ha[:2]


def test_hit_shares_blocks_and_recomputes_the_last_token():
    kv = _kv()
    bm = kv.groups[0]
    a = _seq(0, list(range(8)))  # exactly two full blocks
    assert _admit(kv, a).num_tokens == 0
    same = _seq(1, list(range(8)))
    hit = _admit(kv, same)
    # The whole prompt is cached, but its last token must run for the logits: the last
    # block is recomputed in a block of its own.
    assert hit.num_tokens == 4 and same.block_ids[0] == a.block_ids[0]
    assert same.block_ids[1] != a.block_ids[1] and bm.ref_count(a.block_ids[0]) == 2
    longer = _seq(2, list(range(8)) + [50, 51])
    assert _admit(kv, longer).num_tokens == 8 and longer.block_ids[:2] == a.block_ids
    kv.free(a)
    kv.free(same)
    kv.free(longer)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 16
    assert bm.num_cached_free_blocks == 2  # one copy of each distinct full block


def test_cached_blocks_are_evicted_lru_and_only_when_free_ones_run_out():
    kv = _kv(num_blocks=6)
    bm = kv.groups[0]
    old, new = _seq(0, list(range(9))), _seq(1, list(range(100, 109)))
    _admit(kv, old)
    _admit(kv, new)
    kv.free(old)
    kv.free(new)  # old's blocks were released first: they are the least recent
    assert bm.num_cached_free_blocks == 4 and bm.num_free_blocks == 6
    big = _seq(2, list(range(200, 211)))  # 3 blocks: 2 free ones, then 1 eviction
    _admit(kv, big)
    # The tail block of `old` went first (a sequence's blocks are released tail first).
    assert kv.find_cached_prefix(_seq(3, list(range(9)))).num_tokens == 4
    assert kv.find_cached_prefix(_seq(4, list(range(100, 109)))).num_tokens == 8
    assert bm.num_cached_free_blocks == 3 and bm.num_used_blocks == 3


def test_a_hit_on_cached_blocks_counts_them_against_the_free_pool():
    kv = _kv(num_blocks=4)
    a = _seq(0, list(range(12)))
    _admit(kv, a)
    kv.free(a)  # 3 cached blocks, 1 free
    b = _seq(1, list(range(12)) + [1, 2, 3, 4, 5])  # hits 3 blocks, needs 2 more
    hit = kv.find_cached_prefix(b)
    assert hit.num_tokens == 12
    b.num_computed_tokens = 12
    # 4 free blocks on paper, but the 3 hit blocks stop being free: only 1 is left.
    assert kv.groups[0].num_free_blocks == 4 and not kv.can_allocate(b, 5, hit)
    assert kv.can_allocate(b, 4, hit)


def test_max_cached_blocks_caps_the_cached_state():
    kv = _kv(cap=1)
    bm = kv.groups[0]
    a = _seq(0, list(range(13)))
    _admit(kv, a)
    kv.free(a)
    assert bm.num_cached_free_blocks == 1 and bm.num_free_blocks == 16
    assert _admit(kv, _seq(1, list(range(13)))).num_tokens == 4  # the head block stayed


def test_sliding_group_needs_only_the_window_and_the_groups_agree():
    # Full group + window-5 group: a query at position 12 sees 8..12, i.e. blocks 2..
    kv = _kv(num_blocks=16, windows=(None, 5))
    full, sliding = kv.groups
    a = _seq(0, list(range(14)))
    _admit(kv, a)
    kv.free(a)
    b = _seq(1, list(range(14)))
    hit = kv.find_cached_prefix(b)
    assert hit.num_tokens == 12
    assert hit.blocks[1][:2] == [PLACEHOLDER_BLOCK, PLACEHOLDER_BLOCK]
    assert hit.blocks[1][2] != PLACEHOLDER_BLOCK and PLACEHOLDER_BLOCK not in hit.blocks[0]
    # Evict block 2 of the sliding group only: no end at 12 works there; at 8 the
    # query sees 4..8, block 1 alone; at 4, block 0.
    _evict(sliding, b.block_hashes[2])
    hit = kv.find_cached_prefix(b)
    assert hit.num_tokens == 8
    assert hit.blocks[1] == [PLACEHOLDER_BLOCK, sliding._block_of[b.block_hashes[1]]]
    assert len(hit.blocks[0]) == 2
    _evict(sliding, b.block_hashes[1])
    assert kv.find_cached_prefix(b).num_tokens == 4
    # Now the full group lacks block 0: nothing is cached for anyone.
    _evict(full, b.block_hashes[0])
    assert kv.find_cached_prefix(b).num_tokens == 0


def test_chunked_prefill_resumes_after_the_hit_and_the_step_starts_there():
    kv = _kv(num_blocks=32)
    sched = _scheduler(kv, chunk=8)
    prefix = list(range(20))
    sched.add(_seq(0, prefix + [90, 91], max_tokens=1))
    _drain(sched)
    b = _seq(1, prefix + [70, 71, 72, 73, 74, 75, 76, 77, 78], max_tokens=2)
    sched.add(b)
    out = sched.schedule()
    (e,) = out.scheduled
    assert (e.start, e.num_new_tokens, e.samples) == (20, 8, False)
    step = build_step_input(out, BS)
    assert step.positions[0] == 20 and step.seq_lens[0] == 28
    assert b.num_cached_tokens == 20
    assert kv.prefix_cache_stats.queries == 22 + 29 and kv.prefix_cache_stats.hits == 20
    sched.update(out, {})
    out = sched.schedule()
    assert [(x.start, x.num_new_tokens, x.samples) for x in out.scheduled] == [(28, 1, True)]


def test_choices_of_one_prompt_admitted_together_share_its_blocks():
    kv = _kv(num_blocks=32)
    sched = _scheduler(kv)
    prompt = list(range(30))
    seqs = [_seq(i, prompt) for i in range(3)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    starts = [e.start for e in out.scheduled]
    assert starts == [0, 28, 28]  # the later choices take the first one's 7 full blocks
    assert [s.num_cached_tokens for s in seqs] == [0, 28, 28]
    assert all(s.block_ids[:7] == seqs[0].block_ids[:7] for s in seqs)
    sched.update(out, {s.seq_id: 7 for s in seqs})
    _drain(sched)
    assert kv.groups[0].num_used_blocks == 0


def test_preempted_sequence_hits_its_own_blocks_on_readmission():
    kv = _kv(num_blocks=9)
    sched = _scheduler(kv, max_num_seqs=2)
    a, b = _seq(0, list(range(16)), max_tokens=12), _seq(1, list(range(50, 66)), max_tokens=12)
    sched.add(a)
    sched.add(b)
    while not b.num_preemptions:
        out = sched.schedule()
        sched.update(out, {e.seq.seq_id: 5 for e in out.scheduled if e.samples})
    out = sched.schedule()
    while b.status.name != "RUNNING":
        sched.update(out, {e.seq.seq_id: 5 for e in out.scheduled if e.samples})
        out = sched.schedule()
    (entry,) = [e for e in out.scheduled if e.seq is b]
    assert entry.start > 0 and entry.start % BS == 0  # recompute starts after its blocks
    assert b.num_cached_tokens == 0  # usage counts the first admission only
    sched.update(out, {e.seq.seq_id: 5 for e in out.scheduled if e.samples})
    _drain(sched)


def test_blocks_of_placeholders_are_cached_only_once_their_tokens_are_known():
    kv = _kv(num_blocks=16)
    bm = kv.groups[0]
    sched = _scheduler(kv)
    a = _seq(0, list(range(7)), max_tokens=6)
    sched.add(a)
    first = sched.schedule()  # prefill: samples token 7 (a placeholder)
    second = sched.schedule()  # decode of the placeholder, in flight too
    assert a.num_computed_tokens == 8 and a.num_pending_tokens == 2
    assert not bm.is_cached(a.block_ids[1])  # block 1 ends in a placeholder
    sched.update(first, {0: 42})
    assert bm.is_cached(a.block_ids[1])  # token 7 known, its K/V computed by `second`
    sched.update(second, {0: 43})
    b = _seq(1, list(range(7)) + [42, 43])
    assert kv.find_cached_prefix(b).num_tokens == 8
    _drain(sched)


def test_prefix_caching_off_finds_nothing():
    layout = KVCacheLayout.single(16, BS)
    kv = KVCacheManager.from_layout(layout)
    a = _seq(0, list(range(12)))
    _admit(kv, a)
    kv.free(a)
    assert kv.find_cached_prefix(_seq(1, list(range(12)))).num_tokens == 0
    assert kv.groups[0].num_cached_free_blocks == 0


def test_share_refuses_a_free_uncached_block():
    bm = BlockManager(4, BS, enable_caching=True)
    with pytest.raises(AssertionError):
        bm.share(_seq(0, [1]), [1])


def _computed_prompt_tokens(sched, seqs):
    """Drain; returns the prompt tokens the steps computed (cache hits excluded)."""
    total = 0
    while sched.has_unfinished():
        out = sched.schedule()
        total += sum(min(e.num_new_tokens, max(0, e.seq.num_prompt_tokens - e.start))
                     for e in out.scheduled)
        sched.update(out, {e.seq.seq_id: 7 for e in out.scheduled if e.samples})
    return total


def test_requests_arriving_together_compute_a_shared_prefix_once():
    """Three requests with one new 24-token prefix, a budget of 8 tokens a step: the
    first computes the prefix, the others wait for those blocks and take them as a hit
    (before, each computed the prefix beside the others, 3 x 24 tokens at a third of the
    budget each); a request with another prompt is not held back by them."""
    kv = _kv(num_blocks=64)
    sched = _scheduler(kv, chunk=8, budget=8)
    prefix = list(range(100, 124))  # 6 full blocks
    seqs = [_seq(i, prefix + [i, i + 1]) for i in range(3)]
    other = _seq(9, list(range(200, 206)))
    for s in seqs + [other]:
        sched.add(s)
    computed = _computed_prompt_tokens(sched, seqs + [other])
    assert computed == 24 + 3 * 2 + 6
    assert [s.num_cached_tokens for s in seqs] == [0, 24, 24]
    assert other.first_scheduled_time <= seqs[1].first_scheduled_time
    assert kv.groups[0].num_used_blocks == 0


def test_a_request_waiting_for_a_prefix_goes_on_when_its_computer_is_aborted():
    kv = _kv(num_blocks=64)
    sched = _scheduler(kv, chunk=4, budget=4)
    prefix = list(range(100, 116))
    a, b = _seq(0, prefix + [1]), _seq(1, prefix + [2])
    sched.add(a), sched.add(b)
    out = sched.schedule()
    assert [e.seq for e in out.scheduled] == [a]
    sched.update(out, {})
    sched.abort("r0")
    _drain(sched)
    assert b.is_finished() and b.num_cached_tokens == 4  # the one block a computed
