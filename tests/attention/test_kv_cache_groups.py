"""Per-layer caches on the device side: grouping layers by kind, splitting the byte budget
between groups, the tensors each spec gets, ``AttentionMetadata.view`` per group, and the
reference backend ignoring the blocks a sliding group freed."""

import math

import numpy as np
import pytest
import torch

from cvllm.attention.backends import torch_ref
from cvllm.attention.interface import AttentionParams
from cvllm.attention.kv_cache import (
    CacheSizing,
    KVCache,
    allocate_kv_caches,
    group_bytes_per_block,
    group_layers,
    kv_caches_nbytes,
    plan_kv_cache,
    state_bytes,
)
from cvllm.attention.metadata import AttentionMetadata
from cvllm.attention.specs import FullAttentionSpec, MLASpec, SlidingWindowSpec, StateSpec
from cvllm.config import ConfigError

F32 = torch.float32
FULL = FullAttentionSpec(2, 8, F32)  # K + V: 128 bytes per token
SLIDE = SlidingWindowSpec(2, 8, F32, 16)
MLA = MLASpec(12, 4, torch.bfloat16)  # 32 bytes per token
STATE = StateSpec(((3, 5), (2, 4, 4)), (F32, torch.bfloat16))  # 60 + 64 bytes per slot


def _sizing(**kw):
    base = dict(block_size=8, max_num_seqs=4, max_model_len=256, max_num_batched_tokens=64,
                max_chunk=64)
    base.update(kw)
    return CacheSizing(**base)


def test_group_layers_by_kind():
    specs = [SLIDE, FULL, STATE, SlidingWindowSpec(2, 8, F32, 4), MLA, SLIDE]
    assert group_layers(specs) == [(None, [1, 4]), (4, [3]), (16, [0, 5])]
    assert group_layers([SLIDE, SLIDE]) == [(16, [0, 1])]
    with pytest.raises(ValueError, match="no attention layer"):
        group_layers([STATE])


def test_bytes_count_every_layer():
    assert FULL.bytes_per_token() == 128 and MLA.bytes_per_token() == 32
    assert STATE.bytes_per_slot() == 3 * 5 * 4 + 2 * 4 * 4 * 2
    specs = [FULL, MLA, STATE, SLIDE]
    assert group_bytes_per_block(specs, [0, 1], 8) == 8 * (128 + 32)
    assert state_bytes(specs, 4) == 4 * STATE.bytes_per_slot()


def test_single_group_uses_the_whole_budget():
    layout = plan_kv_cache([FULL] * 3, _sizing(), budget_bytes=100_000)
    (g,) = layout.groups
    assert g.sliding_window is None and g.layer_ids == (0, 1, 2)
    assert g.num_blocks == 100_000 // (3 * 8 * 128) and layout.num_state_slots == 0


def test_sliding_group_is_capped_and_the_rest_goes_to_full():
    s = _sizing()
    specs = [FULL, SLIDE, SLIDE, FULL]
    per_block = 2 * 8 * 128
    cap = s.max_num_seqs * (math.ceil(15 / 8) + 2) + math.ceil(64 / 8)  # 24
    budget = 1000 * per_block
    full, sliding = plan_kv_cache(specs, s, budget_bytes=budget).groups
    assert sliding.sliding_window == 16 and sliding.num_blocks == cap
    assert full.num_blocks == (budget - cap * per_block) // per_block
    # A small budget: equal counts, nothing capped.
    small = plan_kv_cache(specs, _sizing(max_model_len=128), budget_bytes=2 * 20 * per_block).groups
    assert [g.num_blocks for g in small] == [20, 20]


def test_state_bytes_come_out_of_the_budget():
    specs = [STATE, FULL, STATE]
    layout = plan_kv_cache(specs, _sizing(), budget_bytes=50_000)
    assert layout.num_state_slots == 4
    used = layout.groups[0].num_blocks * 8 * 128 + 2 * state_bytes([STATE], 4)
    assert 50_000 - 8 * 128 < used <= 50_000
    with pytest.raises(ConfigError, match="state"):
        plan_kv_cache(specs, _sizing(), budget_bytes=100)


def test_too_small_caches_name_the_group():
    with pytest.raises(ConfigError, match="cannot hold one sequence of --max-model-len 256"):
        plan_kv_cache([FULL], _sizing(), num_blocks=31)
    plan_kv_cache([FULL], _sizing(), num_blocks=32)
    # A window-16 group needs only ceil((15 + 64) / 8) + 1 = 11 blocks for the same length.
    layout = plan_kv_cache([SLIDE], _sizing(), num_blocks=11)
    assert layout.groups[0].num_blocks == 11
    with pytest.raises(ConfigError, match="window-16"):
        plan_kv_cache([SLIDE], _sizing(), num_blocks=10)


def test_allocation_shapes_per_spec():
    specs = [FULL, SLIDE, MLA, STATE]
    layout = plan_kv_cache(specs, _sizing(), num_blocks=40)
    caches = allocate_kv_caches(specs, layout, "cpu")
    n_full, n_slide = (g.num_blocks for g in layout.groups)
    assert [g.layer_ids for g in layout.groups] == [(0, 2), (1,)]
    assert isinstance(caches[0], KVCache) and caches[0].k_scale is None
    k, v = caches[0].k, caches[0].v
    assert k.shape == v.shape == (n_full, 8, 2, 8) and k.data_ptr() != v.data_ptr()
    assert caches[1].k.shape == (n_slide, 8, 2, 8)
    kv, none = caches[2]
    assert none is None and kv.shape == (n_full, 8, 16) and kv.dtype == torch.bfloat16
    conv, rec = caches[3]
    assert conv.shape == (4, 3, 5) and rec.shape == (4, 2, 4, 4) and rec.dtype == torch.bfloat16
    assert all(torch.all(t == 0) for c in caches for t in c if t is not None)
    expect = n_full * 8 * (128 + 32) + n_slide * 8 * 128 + state_bytes(specs, 4)
    assert kv_caches_nbytes(caches) == expect


# ----- metadata views ---------------------------------------------------------------------


def _meta_two_groups():
    return AttentionMetadata.build(
        slot_mapping=np.array([9, 20, 21, 22]), query_start_loc=np.array([0, 1, 4]),
        seq_lens=np.array([10, 3]), block_tables=np.array([[0, 1, 2], [5, 0, 0]]),
        device="cpu", sliding_window=None,
        extra_groups=[(4, np.array([41, 12, 13, 14]), np.array([[-1, -1, 10], [3, 0, 0]]))],
        state_slots=np.array([2, 0]),
    )


def test_view_returns_each_groups_tables():
    meta = _meta_two_groups()
    assert meta.view(None) is meta and meta.sliding_window is None
    v = meta.view(4)
    assert v.sliding_window == 4 and v.slot_mapping.tolist() == [41, 12, 13, 14]
    assert v.block_tables.tolist() == [[0, 0, 10], [3, 0, 0]]  # placeholders clamped
    assert v.query_start_loc is meta.query_start_loc and v.state_slots is meta.state_slots
    assert v.view(None) is meta and v.view(4) is v
    with pytest.raises(KeyError, match="sliding_window=8"):
        meta.view(8)


def test_state_fields():
    meta = _meta_two_groups()
    assert meta.state_slots.dtype == torch.int64 and meta.state_slots.tolist() == [2, 0]
    assert meta.has_initial_state.dtype == torch.bool
    assert meta.has_initial_state.tolist() == [True, False]  # decode, fresh prefill


def test_one_group_serves_every_window():
    meta = AttentionMetadata.build(slot_mapping=np.array([0]), query_start_loc=np.array([0, 1]),
                                   seq_lens=np.array([1]), block_tables=np.array([[0]]),
                                   device="cpu")
    assert meta.view(7) is meta and meta.view(None) is meta
    assert meta.state_slots.tolist() == [-1]


# ----- the backend never uses freed blocks ------------------------------------------------


def test_attention_ignores_freed_out_of_window_blocks():
    """The same step with and without the out-of-window blocks: freed table entries read
    block 0 (full of garbage), which the window masks."""
    torch.manual_seed(0)
    bs, W, hkv, h, d = 4, 6, 2, 4, 8
    ctx, q_len = 21, 3  # the step computes positions 21..23; the first query sees 16..21
    n_blocks = math.ceil((ctx + q_len) / bs)
    k_cache = torch.randn(16, bs, hkv, d)
    v_cache = torch.randn(16, bs, hkv, d)
    table = list(range(1, n_blocks + 1))
    slots = [table[p // bs] * bs + p % bs for p in range(ctx, ctx + q_len)]
    q, k, v = torch.randn(q_len, h, d), torch.randn(q_len, hkv, d), torch.randn(q_len, hkv, d)

    def run(tab):
        kc, vc = k_cache.clone(), v_cache.clone()
        meta = AttentionMetadata.build(
            slot_mapping=np.array(slots), query_start_loc=np.array([0, q_len]),
            seq_lens=np.array([ctx + q_len]), block_tables=np.array([tab]), device="cpu",
            sliding_window=W)
        return torch_ref.forward(q, k, v, KVCache(kc, vc), meta, AttentionParams(0.3, W))

    dead = (ctx - W + 1) // bs  # blocks 0..3 hold positions < 16
    assert dead == 4
    freed = [-1] * dead + table[dead:]
    k_cache[0].fill_(1e4)  # what a freed entry reads after clamping
    v_cache[0].fill_(-1e4)
    torch.testing.assert_close(run(freed), run(table), rtol=0, atol=1e-5)
