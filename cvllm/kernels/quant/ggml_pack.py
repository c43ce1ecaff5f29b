"""GGUF blocks -> the split layout the GPU kernels of ``ggml_cuda.py`` read (torch, at load).

Called once per weight by ``ggml_cuda.prepare`` on the rank that owns the shard; the
result is a plain dict of tensors that ``CudaGgmlWeight`` owns. No state.

Why a layout of our own: a GGUF block interleaves its scales with its quants, and the
quants of a block are in an order of the CPU kernels' convenience (Q4_K: byte ``l`` of a
64-element chunk holds elements ``l`` and ``l + 32``; Q6_K splits each element over two
planes of different strides). A Triton tile wants one element order for every type, each
field in an array of its own with coalesced rows, and scales it can load without bit
surgery. So each type is described by a ``PackSpec`` and stored as:

- ``lo``  int32 ``[N, K * LB / 32]``: the low ``LB`` bits (2, 4 or 8) of every element's
  unsigned quant, ``EPW = 32 / LB`` a word at bits ``LB * f`` (field ``f``), ``WPS``
  words a sub-block. Field-major within a sub-block: field ``f`` of word ``w`` is
  element ``f * WPS + w``, so field ``f`` of all the sub-block's words pairs with a
  contiguous run of ``WPS`` activations (one vector load of x per field in the GEMV).
- ``hi``  int16/int32 ``[N, K / SB]``: the ``HB`` high bits (1 or 2) of the ``SB``
  elements of each scale sub-block, those of word ``w``, field ``f`` at bits
  ``HB * (EPW * w + f)`` (Q3_K, Q5_*, Q6_K).
- ``d``   fp16 ``[N, K / SUPER]``: the block scale (``SUPER`` = the GGUF block: 32 or 256).
- ``dm``  fp16 ``[N, K / SUPER]``: the block min / ``dmin`` (Q4_1, Q5_1).
- ``sc``  int8/uint8 ``[N, K / SB]``: the sub-block scale, unpacked from its 6-bit (Q3_K,
  Q4_K, Q5_K, IQ4_XS) or nibble (Q2_K) packing.
- K-quants but Q3_K (``PackSpec.dd``): ``d`` int32, the fp16 bits of ``d`` in the low half
  and of ``dmin`` in the high half (0: no min), no ``dm``. Q4_K, Q5_K (``PackSpec.scm``):
  ``sc`` int16, the scale in the low byte and the sub-block min in the high one.
  Why: the tensor-core GEMM reads these every K step, and a load of under 4 bytes a row
  cannot be an asynchronous copy (Triton issues it as a plain load the step waits for):
  one H200, a Q4_K 8B layer at 64 rows took 196 us with the four fields loaded apart
  and 119 us with no scale loads at all (``docs/benchmarks/ggml-scale-loads-h200.json``).

Quants are made unsigned (Q8_0 stores ``q + 128``, Q6_K ``q + 32``, Q3_K ``q + 4``) and
the offset goes into the sub-block's additive term, so every type dequantizes as
``value = s * q + m`` per sub-block (IQ4_*: ``s * kvalues[q]``); see ``ggml_tiles.py``.
The unpacked sub-block scales cost at most 4 bytes per 256 elements and the packed ``d`` of
the d-only K-quants 2 more: Q3_K grows by 3.6%, Q4_K by 2.8%, IQ4_XS by 2.9%, Q5_K by 2.3%,
Q6_K by 1.0%, the rest not at all (the 5% budget holds).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch

from cvllm.kernels.quant.ggml_fields import IQ4_LEVELS
from cvllm.kernels.quant.ggml_types import GgmlType, block_shape

MODE_D, MODE_DM, MODE_DSC, MODE_DSCMN, MODE_Q2K = 0, 1, 2, 3, 4
"""How a sub-block's ``(s, m)`` come from the fields: ``(d, OFF*d)``, ``(d, dm)``,
``(d*sc, OFF*d*sc)``, ``(d*sc, -dm*mn)``, ``(d*(sc&15), -dm*(sc>>4))``."""

IQ4_KVALUES = IQ4_LEVELS


@dataclass(frozen=True)
class PackSpec:
    """Kernel-side description of one GGML type (all become ``tl.constexpr``)."""

    sb: int
    """Elements of a scale sub-block."""
    lb: int
    """Low bits per element in ``lo`` (2, 4 or 8)."""
    hb: int
    """High bits per element in ``hi`` (0: no ``hi``)."""
    superblock: int
    """Elements per ``d`` (and ``dm``): the GGUF block."""
    mode: int
    """One of the ``MODE_*`` codes."""
    off: int = 0
    """The quant offset of MODE_D / MODE_DSC (``m = off * s``)."""
    lut: bool = False
    """Values are ``IQ4_KVALUES[q]`` (IQ4_NL, IQ4_XS)."""

    @property
    def dd(self) -> bool:
        """``d`` is int32 ``[N, K / SUPER]``: the fp16 bits of ``d`` low, of ``dm`` (0 where
        the type has none) high, one 4-byte load a row and K step. The K-quants but Q3_K
        (whose budget the extra 2 bytes a 256-block would break)."""
        return self.superblock > 32 and not (self.mode == MODE_DSC and self.lb == 2)

    @property
    def scm(self) -> bool:
        """``sc`` is int16 ``[N, K / SB]``: the sub-block scale low byte, min high (Q4_K,
        Q5_K), one 2-byte field a sub-block instead of two 1-byte ones."""
        return self.mode == MODE_DSCMN


SPECS: Dict[GgmlType, PackSpec] = {
    GgmlType.Q4_0: PackSpec(32, 4, 0, 32, MODE_D, -8),
    GgmlType.Q4_1: PackSpec(32, 4, 0, 32, MODE_DM),
    GgmlType.Q5_0: PackSpec(32, 4, 1, 32, MODE_D, -16),
    GgmlType.Q5_1: PackSpec(32, 4, 1, 32, MODE_DM),
    GgmlType.Q8_0: PackSpec(32, 8, 0, 32, MODE_D, -128),
    GgmlType.IQ4_NL: PackSpec(32, 4, 0, 32, MODE_D, 0, True),
    GgmlType.Q2_K: PackSpec(16, 2, 0, 256, MODE_Q2K),
    GgmlType.Q3_K: PackSpec(16, 2, 1, 256, MODE_DSC, -4),
    GgmlType.Q4_K: PackSpec(32, 4, 0, 256, MODE_DSCMN),
    GgmlType.Q5_K: PackSpec(32, 4, 1, 256, MODE_DSCMN),
    GgmlType.Q6_K: PackSpec(16, 4, 2, 256, MODE_DSC, -32),
    GgmlType.IQ4_XS: PackSpec(32, 4, 0, 256, MODE_DSC, 0, True),
}

_CHUNK_ELEMS = 1 << 23
"""Elements repacked at a time (int64 temporaries: 64 MiB)."""


def _f16(blocks: torch.Tensor, off: int) -> torch.Tensor:
    """The fp16 at byte ``off`` of each block: ``[n, nb, S]`` uint8 -> ``[n, nb]``."""
    return blocks[..., off:off + 2].contiguous().view(torch.float16)[..., 0]


def _shifted(b: torch.Tensor, shifts, mask: int, shape) -> torch.Tensor:
    """``(b >> shifts) & mask`` with ``shifts`` broadcast along a new axis (the GGUF
    packing's element order), reshaped to ``shape``."""
    sh = torch.tensor(shifts, dtype=torch.uint8, device=b.device)
    return ((b.unsqueeze(-2) >> sh.view(-1, 1)) & mask).reshape(shape)


def _legacy(blocks: torch.Tensor, t: GgmlType):
    """Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL: unsigned quants ``[n, nb, 32]`` and fields."""
    n, nb, _ = blocks.shape
    f = {"d": _f16(blocks, 0)}
    pos = 2
    if t in (GgmlType.Q4_1, GgmlType.Q5_1):
        f["dm"], pos = _f16(blocks, 2), 4
    if t == GgmlType.Q8_0:
        return blocks[..., 2:34] ^ 0x80, f  # int8 q -> q + 128
    qh = None
    if t in (GgmlType.Q5_0, GgmlType.Q5_1):
        qh, pos = blocks[..., pos:pos + 4], pos + 4
    q = _shifted(blocks[..., pos:pos + 16], (0, 4), 0x0F, (n, nb, 32))
    if qh is not None:  # bit e of the little-endian uint32 is element e's 5th bit
        q |= _shifted(qh, range(8), 1, (n, nb, 8, 4)).transpose(-1, -2).reshape(n, nb, 32) << 4
    return q, f


def _scale_min_k4(scales: torch.Tensor):
    """Q4_K / Q5_K: twelve bytes -> eight 6-bit scales and eight 6-bit mins (uint8)."""
    dd, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([dd & 63, (md & 15) | ((dd >> 2) & 48)], dim=-1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=-1)
    return sc, mn


def _kquant(blocks: torch.Tensor, t: GgmlType):
    """Q2_K .. Q6_K, IQ4_XS: unsigned quants ``[n, nb, 256]`` and fields."""
    n, nb, _ = blocks.shape
    shape = (n, nb, 256)
    if t == GgmlType.Q2_K:
        q = _shifted(blocks[..., 16:80].reshape(n, nb, 2, 32), (0, 2, 4, 6), 3, shape)
        return q, {"sc": blocks[..., 0:16], "d": _f16(blocks, 80), "dm": _f16(blocks, 82)}
    if t == GgmlType.Q3_K:
        q = _shifted(blocks[..., 32:96].reshape(n, nb, 2, 32), (0, 2, 4, 6), 3, shape)
        q |= _shifted(blocks[..., 0:32], range(8), 1, shape) << 2  # value = d*sc*(q - 4)
        s = blocks[..., 96:108]
        lo = _shifted(s[..., 0:8], (0, 4), 15, (n, nb, 16))
        hi = _shifted(s[..., 8:12], (0, 2, 4, 6), 3, (n, nb, 16))
        sc = ((lo | (hi << 4)).to(torch.int16) - 32).to(torch.int8)
        return q, {"sc": sc, "d": _f16(blocks, 108)}
    if t in (GgmlType.Q4_K, GgmlType.Q5_K):
        sc, mn = _scale_min_k4(blocks[..., 4:16])
        f = {"d": _f16(blocks, 0), "dm": _f16(blocks, 2), "sc": sc, "mn": mn}
        if t == GgmlType.Q4_K:
            return _shifted(blocks[..., 16:144].reshape(n, nb, 4, 32), (0, 4), 15, shape), f
        q = _shifted(blocks[..., 48:176].reshape(n, nb, 4, 32), (0, 4), 15, shape)
        return q | (_shifted(blocks[..., 16:48], range(8), 1, shape) << 4), f
    if t == GgmlType.Q6_K:
        q = _shifted(blocks[..., 0:128].reshape(n, nb, 2, 64), (0, 4), 15, shape)
        q |= _shifted(blocks[..., 128:192].reshape(n, nb, 2, 32), (0, 2, 4, 6), 3, shape) << 4
        sc = blocks[..., 192:208].contiguous().view(torch.int8)
        return q, {"sc": sc, "d": _f16(blocks, 208)}  # value = d*sc*(q - 32)
    if t == GgmlType.IQ4_XS:
        sh4 = torch.tensor([0, 4], dtype=torch.uint8, device=blocks.device)
        sl = ((blocks[..., 4:8].unsqueeze(-1) >> sh4) & 15).reshape(n, nb, 8)  # 2 per byte
        sh16 = blocks[..., 2].to(torch.int32) | (blocks[..., 3].to(torch.int32) << 8)
        sh = (sh16.unsqueeze(-1) >> (2 * torch.arange(8, device=blocks.device))) & 3
        sc = ((sl.to(torch.int32) | (sh << 4)) - 32).to(torch.int8)
        q = _shifted(blocks[..., 8:136].reshape(n, nb, 8, 16), (0, 4), 15, shape)
        return q, {"d": _f16(blocks, 0), "sc": sc}
    raise ValueError(f"no GPU layout for {GgmlType(t).name}")


def _pack_bits(v: torch.Tensor, bits: int, per: int, dtype: torch.dtype) -> torch.Tensor:
    """``v [n, X]`` small unsigned ints -> ``[n, X / per]`` words of ``dtype``, element
    ``e`` of a group of ``per`` at bits ``bits * e`` (two's complement wrap)."""
    n = v.shape[0]
    sh = torch.arange(per, device=v.device, dtype=torch.int64) * bits
    w = (v.reshape(n, -1, per).to(torch.int64) << sh).sum(-1)  # [n, X / per]
    width = torch.iinfo(dtype).bits
    return torch.where(w >= 1 << (width - 1), w - (1 << width), w).to(dtype)


def _field_major(q: torch.Tensor, spec: PackSpec) -> torch.Tensor:
    """``[n, K]`` element order -> the order of the packed words: within each sub-block,
    word ``w`` field ``f`` holds element ``f * WPS + w`` (WPS = words per sub-block), so
    one field of all a sub-block's words is a contiguous run of ``WPS`` elements."""
    epw = 32 // spec.lb
    wps = spec.sb // epw
    n = q.shape[0]
    return q.reshape(n, -1, epw, wps).transpose(-1, -2).reshape(n, -1)


def _repack_rows(raw: torch.Tensor, t: GgmlType, spec: PackSpec) -> Dict[str, torch.Tensor]:
    """One chunk of rows: ``raw [n, nb*S]`` -> the fields (see the module docstring)."""
    elems, nbytes = block_shape(t)
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, nbytes)  # [n, nb, S]
    q, f = (_legacy if elems == 32 else _kquant)(blocks, t)
    q = _field_major(q.reshape(n, -1), spec)  # [n, K] unsigned quants, word order
    if spec.dd:
        bits = f["d"].view(torch.int16).to(torch.int32) & 0xFFFF
        if "dm" in f:
            bits |= f.pop("dm").contiguous().view(torch.int16).to(torch.int32) << 16
        f["d"] = bits
    if spec.scm:
        f["sc"] = f["sc"].to(torch.int16) | (f.pop("mn").to(torch.int16) << 8)
    out = {k: v.reshape(n, -1).contiguous() for k, v in f.items()}
    out["lo"] = _pack_bits(q & ((1 << spec.lb) - 1), spec.lb, 32 // spec.lb, torch.int32)
    if spec.hb:
        hi_t = torch.int16 if spec.sb * spec.hb == 16 else torch.int32
        out["hi"] = _pack_bits(q >> spec.lb, spec.hb, spec.sb, hi_t)
    return out


def repack(raw: torch.Tensor, t: GgmlType) -> Dict[str, torch.Tensor]:
    """``raw`` uint8 ``[N, K / B * S]`` (GGUF rows) -> the split fields, on raw's device,
    repacked a few rows at a time to bound the temporaries."""
    spec = SPECS[GgmlType(t)]
    elems, nbytes = block_shape(t)
    rows, width = raw.shape
    k = width // nbytes * elems
    step = max(1, _CHUNK_ELEMS // max(k, 1))
    parts = [_repack_rows(raw[r:r + step], t, spec) for r in range(0, rows, step)]
    return {name: torch.cat([p[name] for p in parts]) if len(parts) > 1 else parts[0][name]
            for name in parts[0]}


def unpack_ref(fields: Dict[str, torch.Tensor], t: GgmlType,
               dtype: Optional[torch.dtype] = torch.float32) -> torch.Tensor:
    """Plain-torch dequantization of the split layout (the oracle of the layout itself;
    must equal ``reference.dequantize`` of the raw blocks): fields -> ``[N, K]``."""
    spec = SPECS[GgmlType(t)]
    lo = fields["lo"]
    n = lo.shape[0]
    per = 32 // spec.lb
    sh = torch.arange(per, device=lo.device, dtype=torch.int32) * spec.lb
    q = ((lo.unsqueeze(-1) >> sh) & ((1 << spec.lb) - 1)).reshape(n, -1)  # [N, K]
    k = q.shape[1]
    if spec.hb:
        hs = torch.arange(spec.sb, device=lo.device, dtype=torch.int32) * spec.hb
        hi = (fields["hi"].to(torch.int32).unsqueeze(-1) >> hs) & ((1 << spec.hb) - 1)
        q = q | (hi.reshape(n, k) << spec.lb)
    wps = spec.sb // per
    q = q.reshape(n, -1, wps, per).transpose(-1, -2).reshape(n, k)  # word order -> elements
    per_sub = lambda v, size: v.float().repeat_interleave(size, dim=1)  # noqa: E731
    fields = dict(fields)
    if spec.dd:  # int32: fp16 d low, dm high
        bits = fields["d"]
        fields["d"] = (bits & 0xFFFF).to(torch.int16).view(torch.float16)
        fields["dm"] = (bits >> 16).to(torch.int16).view(torch.float16)
    if spec.scm:  # int16: sc low byte, mn high
        scm = fields["sc"].to(torch.int32)
        fields["sc"], fields["mn"] = scm & 255, (scm >> 8) & 255
    d = per_sub(fields["d"], spec.superblock // spec.sb)  # [N, K / SB]
    if spec.mode == MODE_D:
        s, m = d, spec.off * d
    elif spec.mode == MODE_DM:
        s, m = d, per_sub(fields["dm"], spec.superblock // spec.sb)
    elif spec.mode == MODE_DSC:
        s = d * fields["sc"].float()
        m = spec.off * s
    elif spec.mode == MODE_DSCMN:
        s = d * fields["sc"].float()
        m = -per_sub(fields["dm"], spec.superblock // spec.sb) * fields["mn"].float()
    else:
        sc = fields["sc"].to(torch.int32)
        s = d * (sc & 15).float()
        m = -per_sub(fields["dm"], spec.superblock // spec.sb) * (sc >> 4).float()
    if spec.lut:
        qf = torch.tensor(IQ4_KVALUES, dtype=torch.float32, device=lo.device)[q.long()]
    else:
        qf = q.float()
    w = qf * per_sub(s, spec.sb) + per_sub(m, spec.sb)  # [N, K]
    return w.to(dtype)
