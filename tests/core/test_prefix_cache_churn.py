"""A randomized drive of the scheduler with prefix caching on, the way the overlapped engine
loop drives it (up to two steps in flight), with prompts that share prefixes, choices of
one prompt admitted together, aborts (also of sequences a step in flight uses: a client
that disconnects), preemptions (small pools) and one or two sliding-window groups next to
the full one. After every operation each group's blocks are exactly free + cached + used,
every reference count equals the references live sequences hold, and the key maps agree;
at the end no block is used. A fake K/V cache checks what the hits are worth: each step
"writes" every token's key (its whole prefix) at its slot before any sequence "reads"
its context, and every position a query can see must hold that sequence's own key."""

import random
from collections import Counter

import pytest

from cvllm.config import SchedulerConfig
from cvllm.core.block_manager import PLACEHOLDER_BLOCK
from cvllm.core.kv_cache_manager import KVCacheGroupConfig, KVCacheLayout, KVCacheManager
from cvllm.core.scheduler import Scheduler
from cvllm.core.sequence import PLACEHOLDER_TOKEN, Sequence
from cvllm.sampling_params import SamplingParams

BS, WINDOW, VOCAB = 4, 6, 11
PREFIXES = [[(7 * p + i) % VOCAB for i in range(24)] for p in range(3)]


def _next_token(tokens):
    """The 'model': depends on the content alone, as greedy decoding does."""
    return hash(tuple(tokens)) % VOCAB


def _resolved(seq):
    """seq's tokens with placeholders replaced by what the steps in flight will sample."""
    toks = list(seq.token_ids)
    for i, t in enumerate(toks):
        if t == PLACEHOLDER_TOKEN:
            toks[i] = _next_token(toks[:i])
    return toks


def check_accounting(sched):
    kv = sched.kv_cache_manager
    holders = list(sched._seqs.values()) + [s for _, s in sched._deferred_free]
    for g in kv.groups:
        refs = Counter(b for s in holders for b in s.group_block_ids(g.group)
                       if b != PLACEHOLDER_BLOCK)
        assert all(g._ref_counts[b] == refs.get(b, 0) for b in range(g.num_total_blocks))
        used = {b for b in range(g.num_total_blocks) if g._ref_counts[b]}
        free, cached = set(g._free), set(g._evictable)
        assert len(free) == len(g._free) and not (free & cached) and not (used & (free | cached))
        assert len(free) + len(cached) + len(used) == g.num_total_blocks
        assert g.num_used_blocks == len(used) and g.num_cached_free_blocks == len(cached)
        assert all(g._hash_of[b] is None for b in free)
        assert all(g._hash_of[b] is not None for b in cached)
        assert {h: b for b, h in enumerate(g._hash_of) if h is not None} == g._block_of


class FakeKV:
    """Per group, the key written at each slot."""

    def __init__(self, kv):
        self.slots = [dict() for _ in kv.groups]
        self.windows = kv.windows

    def run(self, out):
        entries = [(e.seq, e.start, e.num_new_tokens, _resolved(e.seq)) for e in out.scheduled]
        for g, slots in enumerate(self.slots):
            for seq, start, n, toks in entries:  # every write of the step first
                ids = seq.group_block_ids(g)
                for p in range(start, start + n):
                    slots[ids[p // BS] * BS + p % BS] = tuple(toks[:p + 1])
            for seq, start, n, toks in entries:  # then every read
                ids, window = seq.group_block_ids(g), self.windows[g]
                lowest = 0 if window is None else max(0, start - window + 1)
                for p in range(lowest, start + n):
                    assert ids[p // BS] != PLACEHOLDER_BLOCK, (seq, p)
                    assert slots.get(ids[p // BS] * BS + p % BS) == tuple(toks[:p + 1]), (seq, p)


def _new_seqs(rng, seq_id, n):
    prefix = rng.choice(PREFIXES)[:rng.randint(0, 24)]
    prompt = prefix + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 10))]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=rng.randint(1, 14))
    return [Sequence(seq_id + i, f"req-{seq_id}", prompt, params) for i in range(n)]


@pytest.mark.parametrize("windows,blocks", [((None, WINDOW), (16, 14)),
                                            ((None, WINDOW, 9), (16, 14, 15))])
def test_random_churn_keeps_block_accounting_exact(windows, blocks):
    rng = random.Random(1)
    layout = KVCacheLayout(BS, tuple(KVCacheGroupConfig(w, n) for w, n in zip(windows, blocks)))
    kv = KVCacheManager.from_layout(layout, enable_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=5, max_model_len=48, prefill_chunk_size=8), kv)
    fake = FakeKV(kv)
    in_flight, next_id, starved = [], 0, False
    for op in range(3000):
        r = rng.random()
        if r < 0.12 and next_id < 400:
            for seq in _new_seqs(rng, next_id, rng.choice([1, 1, 1, 2, 3])):
                sched.add(seq)
            next_id += 3
        elif r < 0.17 and sched._seqs:
            sched.abort(rng.choice(list(sched._seqs.values())).request_id)
        elif r < 0.6 and len(in_flight) < 2 and not starved:
            out = sched.schedule()
            if out.scheduled:
                fake.run(out)
                in_flight.append(out)
                starved = out.starved
        elif in_flight:
            out = in_flight.pop(0)
            sched.update(out, {e.seq.seq_id: _next_token(e.seq.token_ids[:e.sample_index])
                               for e in out.scheduled if e.samples})
            starved = False
        check_accounting(sched)
    while in_flight or sched.has_unfinished():
        if in_flight:
            out = in_flight.pop(0)
            sched.update(out, {e.seq.seq_id: _next_token(e.seq.token_ids[:e.sample_index])
                               for e in out.scheduled if e.samples})
        else:
            out = sched.schedule()
            fake.run(out)
            in_flight.append(out)
        check_accounting(sched)
    assert all(g.num_used_blocks == 0 for g in kv.groups)
    stats = kv.prefix_cache_stats
    assert sched.num_preemptions_total > 10 and stats.hits > stats.queries // 10
