"""Lazy checkpoint tensors: narrowing before reading gives exactly the slice of the whole
tensor, and reads only that slice (counted by ``materialized_bytes``) -- safetensors
through ``get_slice``, GGUF by dequantizing only whole quantization blocks (Q/K rows
un-permuted per slice of heads), and falling back to the whole tensor otherwise."""

import pytest
import torch
from safetensors.torch import save_file

from cvllm.loader import ModelSource, iter_weights
from cvllm.loader.gguf_loader import iter_gguf_weights
from cvllm.loader.lazy import LazyTensor, materialize, materialized_bytes, reset_materialized_bytes


@pytest.fixture(scope="module")
def smollm2_lazy(smollm2_gguf):
    """Every SmolLM2 tensor, lazy (one parse of the file for the module)."""
    return dict(iter_gguf_weights(smollm2_gguf))


def _whole_and_lazy(weights, name):
    lazy = weights[name]
    return lazy, lazy.materialize()


def test_lazy_tensor_api_and_bounds():
    full = torch.arange(24.0).reshape(4, 6)

    def read(ranges):
        out = full
        for dim, (s, n) in enumerate(ranges):
            out = out.narrow(dim, s, n)
        return out.clone()

    t = LazyTensor("w", full.shape, torch.float32, read)
    assert t.shape == (4, 6) and t.dim() == 2 and t.size(1) == 6 and t.is_whole
    part = t.narrow(1, 2, 3).narrow(0, 1, 2).narrow(-1, 1, 2)  # composes, negative dims
    assert part.shape == (2, 2) and not part.is_whole
    assert torch.equal(part.materialize(), full[1:3, 3:5])
    assert torch.equal(materialize(part), full[1:3, 3:5]) and materialize(full) is full
    with pytest.raises(ValueError, match="outside"):
        t.narrow(0, 3, 2)
    with pytest.raises(IndexError):
        t.narrow(2, 0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_safetensors_reads_only_the_narrowed_part(tmp_path, dtype):
    w = torch.randn(64, 48).to(dtype)
    save_file({"w": w, "b": torch.randn(64)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    weights = dict(iter_weights(ModelSource("hf", tmp_path)))
    lazy = weights["w"]
    assert isinstance(lazy, LazyTensor) and lazy.dtype == dtype and lazy.shape == (64, 48)
    reset_materialized_bytes()
    part = lazy.narrow(0, 32, 32).narrow(1, 16, 16).materialize()
    assert torch.equal(part, w[32:64, 16:32])
    assert materialized_bytes() == 32 * 16 * w.element_size()  # the part, not the tensor
    assert torch.equal(lazy.materialize(), w)


def test_gguf_quantized_rows_and_block_columns_are_read_alone(smollm2_lazy):
    """SmolLM2's Q4_1 down_proj [576, 1536] (blocks of 32 columns) and permuted q_proj."""
    weights = smollm2_lazy
    down, down_full = _whole_and_lazy(weights, "model.layers.0.mlp.down_proj.weight")
    reset_materialized_bytes()
    part = down.narrow(1, 512, 512).materialize()  # a row-parallel rank of 3: 16 blocks
    assert torch.equal(part, down_full[:, 512:1024])
    assert materialized_bytes() == part.numel() * 4
    reset_materialized_bytes()
    odd = down.narrow(1, 5, 40).materialize()  # cuts blocks: whole tensor, then sliced
    assert torch.equal(odd, down_full[:, 5:45])
    assert materialized_bytes() == down_full.numel() * 4
    # llama.cpp permutes rows within each head (64 rows): a slice of whole heads is
    # un-permuted on its own, a slice cutting a head from the whole tensor.
    q, q_full = _whole_and_lazy(weights, "model.layers.0.self_attn.q_proj.weight")
    reset_materialized_bytes()
    assert torch.equal(q.narrow(0, 192, 192).materialize(), q_full[192:384])
    assert materialized_bytes() == 192 * 576 * 4
    assert torch.equal(q.narrow(0, 10, 100).narrow(1, 64, 64).materialize(), q_full[10:110, 64:128])
    k, k_full = _whole_and_lazy(weights, "model.layers.0.self_attn.k_proj.weight")
    assert torch.equal(k.narrow(0, 64, 64).materialize(), k_full[64:128])


def test_gguf_embedding_rows_dequantize_alone(smollm2_lazy):
    emb = smollm2_lazy["model.embed_tokens.weight"]  # Q8_0
    reset_materialized_bytes()
    rows = emb.narrow(0, 16384, 100).materialize()
    assert rows.shape == (100, 576) and materialized_bytes() == 100 * 576 * 4
    torch.testing.assert_close(rows, emb.materialize()[16384:16484], rtol=0, atol=0)


def test_gguf_unreadable_slice_names_the_tensor(make_tiny_gguf):
    _, path = make_tiny_gguf("llama")
    lazy = dict(iter_gguf_weights(path))["model.layers.0.self_attn.q_proj.weight"]
    assert "q_proj" in repr(lazy)
    with pytest.raises(ValueError, match="q_proj"):
        lazy.narrow(0, 0, lazy.shape[0] + 1)
