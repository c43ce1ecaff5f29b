"""Broken GGUF files fail at load with a ModelLoadError naming the bad tensor (or key).

Each case writes a small valid GGUF with gguf-py's writer, then corrupts it byte-wise at
positions found by gguf-py's own reader of the valid file (so the test does not lean on
the parser it checks).
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Dict

import numpy as np
import pytest

from cvllm.loader.errors import ModelLoadError
from cvllm.loader.gguf_config import gguf_to_hf_config
from cvllm.loader.gguf_header import read_gguf_header
from cvllm.loader.gguf_loader import clear_gguf_cache, iter_gguf_weights, open_gguf

EMBD, ATTN_Q, ATTN_K, NORM = ("token_embd.weight", "blk.0.attn_q.weight",
                              "blk.0.attn_k.weight", "output_norm.weight")


@pytest.fixture(autouse=True)
def _fresh_cache():
    clear_gguf_cache()
    yield
    clear_gguf_cache()


@pytest.fixture
def good(tmp_path: Path) -> Path:
    """A valid GGUF: metadata with strings and a string array, an F32, a Q4_0, a Q8_0
    and (last) a 1-D F32 tensor."""
    import gguf

    rng = np.random.default_rng(0)
    path = tmp_path / "good.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("general.name", "tiny")
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(50)])
    w.add_array("tokenizer.ggml.scores", [float(i) for i in range(50)])
    w.add_tensor(EMBD, rng.standard_normal((8, 64), dtype=np.float32))
    for name, qtype in ((ATTN_Q, gguf.GGMLQuantizationType.Q4_0),
                        (ATTN_K, gguf.GGMLQuantizationType.Q8_0)):
        arr = rng.standard_normal((4, 64), dtype=np.float32)
        w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.add_tensor(NORM, rng.standard_normal(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _fields(path: Path, name: str) -> Dict[str, int]:
    """Byte positions of a tensor-info entry's fields, and where its data lies."""
    from gguf import GGUFReader

    t = next(t for t in GGUFReader(path).tensors if t.name == name)
    name_at = t.field.offset + 8
    dims_at = name_at + len(name.encode()) + 4
    type_at = dims_at + 8 * len(t.shape)
    return {"name": name_at, "dims": dims_at, "type": type_at, "offset": type_at + 4,
            "start": int(t.data_offset), "end": int(t.data_offset) + int(t.n_bytes)}


def _patch(src: Path, at: int, fmt: str, value, name: str = "bad.gguf") -> Path:
    data = bytearray(src.read_bytes())
    struct.pack_into(fmt, data, at, value)
    bad = src.with_name(name)
    bad.write_bytes(bytes(data))
    return bad


def _fails(path: Path, *needles: str) -> str:
    with pytest.raises(ModelLoadError) as e:
        open_gguf(path)
    msg = str(e.value)
    assert str(path) in msg
    for needle in needles:
        assert needle in msg, msg
    return msg


def test_good_file_opens_and_header_agrees_with_gguf_py(good):
    reader = open_gguf(good)
    header = read_gguf_header(good)
    assert header.data_offset == reader.data_offset
    assert [t.name for t in header.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(header.tensors, reader.tensors):
        assert ours.ggml_type == int(theirs.tensor_type)
        assert ours.dims == tuple(int(d) for d in theirs.shape)
        assert (ours.start, ours.end) == (theirs.data_offset, theirs.data_offset + theirs.n_bytes)


def test_unknown_type_id(good):
    bad = _patch(good, _fields(good, ATTN_Q)["type"], "<I", 99)
    _fails(bad, ATTN_Q, "unknown GGML type id 99")
    # Every entry point goes through the same check.
    for load in (lambda p: gguf_to_hf_config(open_gguf(p)), lambda p: list(iter_gguf_weights(p))):
        clear_gguf_cache()
        with pytest.raises(ModelLoadError, match=ATTN_Q):
            load(bad)


def test_columns_not_a_multiple_of_the_block(good):
    bad = _patch(good, _fields(good, ATTN_Q)["dims"], "<Q", 48)
    _fails(bad, ATTN_Q, "Q4_0", "48 columns are not a multiple of the Q4_0 block of 32")


def test_shape_larger_than_its_bytes_overlaps_the_next_tensor(good):
    # EMBD given a 9th row: its data now runs into ATTN_Q's.
    bad = _patch(good, _fields(good, EMBD)["dims"] + 8, "<Q", 9)
    _fails(bad, EMBD, "overlaps", ATTN_Q, "do not add up")


def test_huge_shape_runs_past_the_end(good):
    bad = _patch(good, _fields(good, ATTN_K)["dims"] + 8, "<Q", 1 << 40)
    _fails(bad, ATTN_K, "Q8_0", "past the file's end")


def test_truncated_inside_the_last_tensor(good):
    f = _fields(good, NORM)
    bad = good.with_name("cut.gguf")
    bad.write_bytes(good.read_bytes()[:(f["start"] + f["end"]) // 2])
    _fails(bad, NORM, "truncated", f"[{f['start']}, {f['end']})")


def test_offset_past_the_end(good):
    size = good.stat().st_size
    far = (size // 32 + 100) * 32 - read_gguf_header(good).data_offset
    _fails(_patch(good, _fields(good, ATTN_Q)["offset"], "<Q", far), ATTN_Q, "past the file's end")


def test_unaligned_offset(good):
    f = _fields(good, ATTN_K)
    at = f["offset"]
    offset = struct.unpack_from("<Q", good.read_bytes(), at)[0]
    _fails(_patch(good, at, "<Q", offset + 1), ATTN_K, "alignment 32")


def test_too_many_dims(good):
    _fails(_patch(good, _fields(good, ATTN_Q)["dims"] - 4, "<I", 7), ATTN_Q, "7 dimensions")


def test_duplicate_tensor_name(good):
    # attn_k -> attn_q: same length, so only the name changes.
    at = _fields(good, ATTN_K)["name"] + len("blk.0.attn_")
    _fails(_patch(good, at, "<c", b"q"), ATTN_Q, "listed twice")


@pytest.mark.parametrize("what", ["key", "string value", "array", "tensor name", "counts"])
def test_garbage_lengths_fail_cleanly(good, what):
    """A length of 2^60 anywhere is refused before it drives a loop or an allocation."""
    data = good.read_bytes()
    huge = 1 << 60
    if what == "key":
        at = 24  # the first key's length
    elif what == "string value":
        at = data.index(b"general.name") + len(b"general.name") + 4
    elif what == "array":
        at = data.index(b"tokenizer.ggml.tokens") + len(b"tokenizer.ggml.tokens") + 8
    elif what == "tensor name":
        at = _fields(good, ATTN_Q)["name"] - 8
    else:
        at = 8  # the tensor count
    msg = _fails(_patch(good, at, "<Q", huge))
    assert "corrupt" in msg or "truncated" in msg
    if what == "tensor name":
        assert "the name of tensor 1" in msg


def test_unknown_metadata_value_type(good):
    at = good.read_bytes().index(b"general.name") + len(b"general.name")
    _fails(_patch(good, at, "<I", 77), "'general.name'", "unknown value type 77")


def test_every_prefix_of_the_header_fails_cleanly(good):
    """Cut anywhere in the header, the file is refused with a ModelLoadError."""
    data = good.read_bytes()
    end = read_gguf_header(good).data_offset
    bad = good.with_name("prefix.gguf")
    for cut in range(24, end, 7):
        bad.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match="truncated|corrupt"):
            read_gguf_header(bad)
