import random

import pytest

from cvllm.core.block_manager import BlockManager, BlockManagerError, NoFreeBlocksError
from cvllm.core.sequence import Sequence
from cvllm.sampling_params import SamplingParams


def _seq(seq_id=0, n=4):
    return Sequence(seq_id, f"r{seq_id}", list(range(n)), SamplingParams())


def test_allocate_covers_computed_plus_new_tokens():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = _seq(n=20)
    assert bm.blocks_needed(s, 5) == 2
    assert bm.allocate(s, 5) == [0, 1]
    s.num_computed_tokens = 5
    assert bm.blocks_needed(s, 3) == 0  # 8 tokens still fit in 2 blocks
    assert bm.allocate(s, 3) == []
    assert bm.blocks_needed(s, 4) == 1
    bm.allocate(s, 4)
    assert s.block_ids == [0, 1, 2]
    assert bm.num_free_blocks == 5 and bm.num_total_blocks == 8
    assert all(bm.ref_count(b) == 1 for b in s.block_ids)
    assert bm.ref_count(3) == 0


def test_allocate_without_room_raises_and_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    s = _seq()
    assert not bm.can_allocate(s, 9)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(s, 9)
    assert s.block_ids == [] and bm.num_free_blocks == 2
    assert bm.can_allocate(s, 8)


def test_free_returns_blocks_and_clears_seq():
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = _seq(0), _seq(1)
    bm.allocate(a, 3)
    bm.allocate(b, 4)
    assert bm.num_free_blocks == 0
    bm.free(a)
    assert a.block_ids == [] and bm.num_free_blocks == 2
    c = _seq(2)
    bm.allocate(c, 4)
    assert sorted(c.block_ids) == [0, 1]  # a's blocks are reused


def test_shared_blocks_are_freed_only_by_the_last_owner():
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = _seq(0), _seq(1)
    bm.allocate(a, 8)
    bm.share(b, a.block_ids[:1])
    assert bm.ref_count(a.block_ids[0]) == 2
    shared = a.block_ids[0]
    bm.free(a)
    assert bm.ref_count(shared) == 1
    assert bm.num_free_blocks == 3  # only a's private block came back
    bm.free(b)
    assert bm.ref_count(shared) == 0 and bm.num_free_blocks == 4


def test_double_free_raises_without_corrupting_the_free_list():
    bm = BlockManager(num_blocks=4, block_size=4)
    s = _seq()
    bm.allocate(s, 8)
    blocks = list(s.block_ids)
    bm.free(s)
    with pytest.raises(AssertionError):  # BlockManagerError is AssertionError-style
        bm.free_blocks(blocks)
    assert bm.num_free_blocks == 4
    s2 = _seq(1)
    bm.allocate(s2, 16)
    assert sorted(s2.block_ids) == [0, 1, 2, 3]


def test_duplicate_in_one_free_is_rejected_before_any_change():
    bm = BlockManager(num_blocks=4, block_size=4)
    s = _seq()
    bm.allocate(s, 8)
    s.block_ids = [s.block_ids[0], s.block_ids[1], s.block_ids[0]]
    with pytest.raises(BlockManagerError, match="double free"):
        bm.free(s)
    assert bm.num_free_blocks == 2 and bm.ref_count(0) == 1 and bm.ref_count(1) == 1


@pytest.mark.parametrize("bad", [-1, 4, 100, "0"])
def test_unknown_block_ids_raise(bad):
    bm = BlockManager(num_blocks=4, block_size=4)
    with pytest.raises(BlockManagerError, match="unknown block"):
        bm.free_blocks([bad])
    with pytest.raises(BlockManagerError):
        bm.ref_count(bad)
    assert bm.num_free_blocks == 4


def test_sharing_a_free_block_raises():
    bm = BlockManager(num_blocks=4, block_size=4)
    with pytest.raises(BlockManagerError):
        bm.share(_seq(), [2])


def test_random_churn_keeps_accounting_exact():
    rng = random.Random(0)
    bm = BlockManager(num_blocks=32, block_size=4)
    live = []
    for i in range(500):
        if live and rng.random() < 0.4:
            bm.free(live.pop(rng.randrange(len(live))))
        else:
            s = _seq(i)
            n = rng.randint(1, 30)
            if bm.can_allocate(s, n):
                bm.allocate(s, n)
                live.append(s)
        owned = [b for s in live for b in s.block_ids]
        assert len(owned) == len(set(owned))
        assert len(owned) + bm.num_free_blocks == 32
        assert all(bm.ref_count(b) == 1 for b in owned)


def test_constructor_rejects_bad_sizes():
    with pytest.raises(ValueError):
        BlockManager(0, 16)
    with pytest.raises(ValueError):
        BlockManager(4, 0)
