"""Weights of a Hugging Face model folder: ``*.safetensors``, single or sharded.

Every shard's header is checked before any tensor is read (each rank loads its own copy,
so a bad file should fail every rank at once, fast): the header length is bounded, each
tensor's byte range must fit in the file and match its dtype and shape, and every tensor
the index names must be in its shard. Tensors come out lazy (``lazy.LazyTensor``), in the
file's dtype: a rank reads only the slices its weight loaders narrow to.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import torch

from .errors import ModelLoadError
from .hf_config import read_json
from .lazy import LazyTensor, Ranges, record_materialized
from .progress import progress

INDEX_NAME = "model.safetensors.index.json"
# safetensors itself refuses headers above 100 MB; the same bound, checked by us first.
MAX_HEADER_BYTES = 100_000_000
_ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
               "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
               "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}


def safetensors_files(folder: Path) -> Tuple[List[Path], Dict[str, str]]:
    """The shard files of ``folder`` and the index's tensor -> shard map ({} if unsharded)."""
    folder = Path(folder)
    index_path = folder / INDEX_NAME
    if index_path.is_file():
        weight_map = read_json(index_path, "safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index_path} has no 'weight_map' object")
        names = sorted(set(weight_map.values()))
        bad = [n for n in names if not isinstance(n, str) or Path(n).name != n]
        if bad:
            raise ModelLoadError(f"{index_path} names shards outside the folder: {bad[:3]}")
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise ModelLoadError(f"{folder} is missing {len(missing)} of the {len(names)} "
                                 f"shards listed in {INDEX_NAME}: {', '.join(missing[:5])}")
        return [folder / n for n in names], weight_map
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        hint = " (only .safetensors weights are supported)" if any(folder.glob("*.bin")) else ""
        raise ModelLoadError(f"{folder} has no *.safetensors weight files{hint}")
    return files, {}


def read_safetensors_header(path: Path) -> Dict[str, Any]:
    """The JSON header of one .safetensors file, after checking it against the file size."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelLoadError(f"{path} is too short ({size} bytes) to be a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise ModelLoadError(f"{path}: header length {n} is impossible for a file of "
                                     f"{size} bytes; the file is truncated or not safetensors")
            header = json.loads(f.read(n))
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e.strerror or e}") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: the safetensors header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path}: the safetensors header is not a JSON object")
    _check_extents(path, header, size - 8 - n)
    return header


def _check_extents(path: Path, header: Dict[str, Any], data_bytes: int) -> None:
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in info["data_offsets"])
            shape = [int(d) for d in info["shape"]]
            dtype = str(info["dtype"])
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"{path}: bad header entry for tensor {name!r}") from e
        if not 0 <= begin <= end or end > data_bytes:
            raise ModelLoadError(
                f"{path}: tensor {name!r} ends at byte {end} of the data but the file holds only "
                f"{data_bytes} bytes of data; the file is truncated (re-download it)")
        item = _ITEM_BYTES.get(dtype)
        if item is not None and math.prod(shape) * item != end - begin:
            raise ModelLoadError(f"{path}: tensor {name!r} of shape {shape} and dtype {dtype} "
                                 f"does not fill its {end - begin} bytes")


_TORCH_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                 "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
                 "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def iter_safetensors_weights(folder: Path) -> Iterator[Tuple[str, LazyTensor]]:
    """Yield ``(name, LazyTensor)`` for every tensor of the folder's safetensors files.

    Nothing is read until a weight loader materialises (a narrowed part of) a tensor:
    the whole tensor through ``get_tensor`` (the one-rank path), a part through
    ``get_slice`` so that a TP rank reads only its shard. Each file stays open (memory
    mapped) as long as a tensor of it is alive."""
    from safetensors import SafetensorError, safe_open

    files, weight_map = safetensors_files(Path(folder))
    headers = {p: read_safetensors_header(p) for p in files}
    _check_index(weight_map, headers)
    total = sum(len([k for k in h if k != "__metadata__"]) for h in headers.values())

    def tensors() -> Iterator[Tuple[str, LazyTensor]]:
        for path in files:
            try:
                handle = safe_open(str(path), framework="pt")
                names = list(handle.keys())
            except SafetensorError as e:
                raise ModelLoadError(f"cannot read {path}: {e}") from e
            for name in names:
                info = headers[path][name]
                yield name, LazyTensor(name, info["shape"], _torch_dtype(path, name, info),
                                       _reader(handle, path, name))

    yield from progress(tensors(), total, "Loading safetensors weights")


def _torch_dtype(path: Path, name: str, info: Dict[str, Any]) -> torch.dtype:
    dtype = getattr(torch, _TORCH_DTYPES.get(str(info["dtype"]), ""), None)
    if not isinstance(dtype, torch.dtype):
        raise ModelLoadError(f"{path}: tensor {name!r} has dtype {info['dtype']}, which "
                             "cvllm cannot load")
    return dtype


def _reader(handle: Any, path: Path, name: str):
    """Reads ranges of one tensor: whole via ``get_tensor``, a part via ``get_slice``."""
    from safetensors import SafetensorError

    def read(ranges: Ranges) -> torch.Tensor:
        try:
            sl = handle.get_slice(name)
            whole = all(s == 0 and n == d for (s, n), d in zip(ranges, sl.get_shape()))
            out = handle.get_tensor(name) if whole else sl[tuple(slice(s, s + n)
                                                                  for s, n in ranges)]
        except SafetensorError as e:
            raise ModelLoadError(f"cannot read {name!r} from {path}: {e}") from e
        record_materialized(out.numel() * out.element_size())
        return out

    return read


def _check_index(weight_map: Dict[str, str], headers: Dict[Path, Dict[str, Any]]) -> None:
    by_name = {p.name: h for p, h in headers.items()}
    missing = [t for t, shard in weight_map.items() if t not in by_name.get(shard, {})]
    if missing:
        raise ModelLoadError(f"{len(missing)} tensors listed in {INDEX_NAME} are not in their "
                             f"shard, e.g. {missing[0]!r}; the download is incomplete")
