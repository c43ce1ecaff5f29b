import pytest
import torch

from cvllm.attention.kv_cache import KVCacheSpec, allocate_kv_cache


def test_spec_sizes_and_allocation():
    spec = KVCacheSpec(
        num_layers=3, num_kv_heads=2, head_dim=8, block_size=16, dtype=torch.bfloat16
    )
    assert spec.bytes_per_block == 2 * 3 * 16 * 2 * 8 * 2
    assert spec.num_blocks_for_bytes(spec.bytes_per_block * 5 + 7) == 5
    assert spec.num_blocks_for_bytes(0) == 0
    caches = allocate_kv_cache(spec, 5, "cpu")
    assert len(caches) == 3
    for k, v in caches:
        assert k.shape == v.shape == (5, 16, 2, 8)
        assert k.dtype == torch.bfloat16 and torch.all(k == 0)
        assert k.data_ptr() != v.data_ptr()


def test_spec_rejects_bad_values():
    with pytest.raises(ValueError):
        KVCacheSpec(num_layers=0, num_kv_heads=2, head_dim=8, block_size=16, dtype=torch.float32)
    with pytest.raises(ValueError):
        allocate_kv_cache(KVCacheSpec(1, 1, 8, 16, torch.float32), 0, "cpu")
