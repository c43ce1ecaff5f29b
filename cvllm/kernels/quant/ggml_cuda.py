"""GGUF block-quantized weights on the GPU: kept in their blocks, multiplied by Triton.

Called by the GGUF linear method (``quantization/gguf``: ``prepare`` at load, ``linear``
in ``apply``, ``embedding`` for the token embedding); the plain-torch reference is
``kernels/quant/reference.py`` (``dequantize``, ``ggml_linear_ref``) and the tests are
tests/kernels/test_ggml_cuda.py (also under ``TRITON_INTERPRET=1`` on the CPU). Each rank
prepares its own shard; a ``CudaGgmlWeight`` is owned by its layer and lives on that
rank's device. Nothing else keeps state, except the dense scratch of the large-M path
(``_scratch``: one buffer per device and dtype, reused call after call on one stream).

Layout: ``prepare`` splits each GGUF row into per-field arrays (``ggml_pack.py``: quants
as int32 words in a sub-block field-major order, fp16 block scales, unpacked sub-block
scales), within 1.05x of the GGUF bytes. ``linear`` picks one of four paths by the
number of rows M and the type (``choose_path``):

- ``gemv_i8`` (M = 1, Q4_0 / Q4_1 / Q4_K / Q8_0 / Q6_K): the activations rounded to int8
  per 32 elements (Q6_K: per 16, its scales' granularity), the products summed by
  ``dp4a`` (``ggml_kernels.ggml_gemv_i8_kernel``, ``ggml_gemv_i8_q6_kernel``): the float
  path spends about 6.4 instructions an element of Q4_K and is bound by its issue slots,
  this one 2.7; ``CVLLM_GGML_INT8_GEMV=0`` turns it off. It also takes a gate_up row and
  applies the gated activation on load (``linear(.., act=)``, ``CudaBackend.linear_gated``:
  the MLP's down projection in one kernel). Where row blocks alone leave the SMs short
  of work (qkv, down), K is split over programs and the last of a row block to arrive
  adds the partial sums (``plan_gemv_i8``; ``CudaGgmlWeight.sem`` holds the counts).
  Weights prepared ``exact`` (the LM head, whose logits pick the greedy token) keep the
  float ``gemv``.
- ``gemv`` (M <= ``GEMV_MAX_M`` = 2): float32 FMA in registers, the weight streamed once
  (``ggml_kernels.ggml_gemv_kernel``); batch-1 decode is a pure weight stream.
- ``mm`` (up to 128 rows): weight tiles dequantized in registers into ``tl.dot``, K split
  over several programs when the tiles alone leave SMs idle (a second kernel adds them).
  On Hopper, up to 32 rows (and from 65 for the lighter tiles) it computes the transposed
  product (``SWAP``: the decoded weight is the A operand of wgmma, read from registers,
  and the weight's rows its M of 64; unswapped, a 16- or 32-row x tile is the M of an
  ``mma.sync``); other GPUs keep the earlier plan (``plan_mm``).
- ``dense`` (M >= ``DENSE_MIN_M`` = 129, prefill): the weight dequantized into a bf16 /
  fp16 scratch, then cuBLAS.

Measured on an H100 (tools/bench_ggml.py, docs/benchmarks/ggml-h100.json; 8B Llama
shapes qkv / o_proj / gate_up / down; device-to-device copy 2955 GB/s): Q4_K at one row
streams 1863 / 1618 / 2135 / 1764 GB/s of its blocks on the float path (0.55-0.72 of the
copy rate), 1919 / 2012 / 2537 / 1939 on ``gemv_i8`` (7.6 / 4.8 / 26.8 / 17.5 us); Q8_0
2118 / 2392 / 2888 / 2700; at 64 rows a Q4_K layer's four products take 199 us against
bf16 cuBLAS' 173 (0.87x its throughput); the Q6_K LM head (128256 x 4096) 187 us at one
row, 393 us at 64 (bf16 392); at 2048 rows (prefill) the dense path runs at 0.84-0.87x
bf16.

Numerics: float32 dequantization (one rounding of ``s * q + m``) and float32 accumulation;
the ``mm`` and ``dense`` paths round the weight to x's dtype before the product (as a
bf16 layer does), the ``gemv`` path does not; one rounding of the output. ``gemv_i8``
computes exactly (integer sums, float32 scaling) the product with x rounded to int8 per
32-element block with an absmax scale (llama.cpp's q8_1 rounding, which its CUDA kernels
use for every quantized product): about 0.3 / 127 of each block's largest |x| per
element, 0.5-1% of the output's RMS on random data (tests/kernels/test_ggml_cuda.py).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch
import triton

from cvllm.kernels import pdl
from cvllm.kernels.quant import ggml_kernels as gk
from cvllm.kernels.quant.backend import GgmlBackend
from cvllm.kernels.quant.ggml_pack import SPECS, PackSpec, repack
from cvllm.kernels.quant.ggml_types import GgmlType, block_shape
from cvllm.kernels.quant.q8form import attached_q8, quantize_q8
from cvllm.utils import tuning

_DTYPES = (torch.float16, torch.bfloat16)
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # fixed before triton compiles
GEMV_MAX_M = 2
"""Most rows the FMA GEMV takes; more go to the tensor-core kernel (the GEMV's FMAs grow
with the rows, the tensor-core kernel decodes each weight element once for up to 16).
H100, Q4_K at 2 rows: the GEMV 9.2 / 14.4 / 53.6 / 31.8 us for o_proj / qkv / gate_up /
down against 17-22 / 87 / 52 us for the tensor-core kernel's best."""
DENSE_MIN_M = 129
"""Fewest rows that take the dequantize + cuBLAS path. H100 at 256 rows: dense 34 / 53 /
227 / 124 us against the tensor-core kernel's best 43 / 72 / 246 / 191 us for Q4_K
(o_proj / qkv / gate_up / down), likewise for Q6_K; Q8_0 within 15% either way. At 64 rows
the tensor-core kernel wins by 1.3-2x; 128 was not measured (it decodes each weight once
there, as at 64)."""
MAX_K = 1 << 20
SEM_ROWS = 4
"""Fewest rows a program of the split-K int8 GEMV takes (``CudaGgmlWeight.sem``)."""
_MAGIC = 0x4B000000
"""The exponent bits of ``2**23``, passed as a run-time argument: a literal would let ptxas
put it in LOP3's immediate slot and re-create the per-field mask before every LOP3."""


def supports(t: GgmlType) -> bool:
    """Whether ``t`` can be kept quantized on the GPU (every type of QUANTIZED_TYPES)."""
    try:
        return GgmlType(t) in SPECS
    except ValueError:
        return False


@dataclass(eq=False)
class CudaGgmlWeight:
    """A ``[N, K]`` GGML weight in the split layout (``ggml_pack.py``). Built by
    ``prepare``; owned by its layer; immutable (the fields are checked once, here, and
    the kernel arguments kept). Absent fields are None."""

    ggml_type: GgmlType
    shape: Tuple[int, int]
    lo: torch.Tensor
    """int32 ``[N, K * LB / 32]``: the low bits of the quants, in element order."""
    d: torch.Tensor
    """fp16 ``[N, K / SUPER]``: block scales (int32 with the mins: ``PackSpec.dd``)."""
    hi: Optional[torch.Tensor] = None
    dm: Optional[torch.Tensor] = None
    sc: Optional[torch.Tensor] = None
    exact: bool = False
    """Products keep the activations as they are (no ``gemv_i8``): an LM head, whose
    logits pick the greedy token."""
    args: tuple = field(init=False, repr=False)
    """``(pointers, row strides)`` of the kernels (absent fields stand in as ``lo``)."""
    sem: torch.Tensor = field(init=False, repr=False)
    """int32 zeros, one per ``SEM_ROWS`` rows: the split-K int8 GEMV's arrival counts
    (``ggml_kernels.ggml_gemv_i8_kernel``, ``SPLIT``), back at zero after every call.
    Made here, at load, never inside a CUDA-graph capture (4 bytes per 4 rows)."""

    def __post_init__(self) -> None:
        _check_weight(self)
        lo = self.lo
        ptrs = [lo] + [v if v is not None else lo for v in
                       (self.hi, self.d, self.dm, self.sc)]
        self.args = (ptrs, (lo.stride(0), self.shape[1] // self.spec.sb, self.d.stride(0)))
        self.sem = torch.zeros(-(-self.shape[0] // SEM_ROWS), dtype=torch.int32,
                               device=lo.device)

    @property
    def spec(self) -> PackSpec:
        return SPECS[self.ggml_type]

    def tensors(self) -> Dict[str, torch.Tensor]:
        names = ("lo", "d", "hi", "dm", "sc")
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


def prepare(raw: torch.Tensor, t: GgmlType, exact: bool = False) -> CudaGgmlWeight:
    """``raw`` uint8 ``[N, K / B * S]`` (GGUF rows, any device) -> the split weight on
    raw's device (``exact``: see ``CudaGgmlWeight.exact``). The caller may free ``raw``
    afterwards."""
    if not supports(t):
        raise ValueError(f"GGML type {t!r} has no GPU kernels here")
    t = GgmlType(t)
    elems, nbytes = block_shape(t)
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % nbytes:
        raise ValueError(f"raw must be uint8 [N, K/{elems}*{nbytes}] for {t.name}; got "
                         f"{raw.dtype} {tuple(raw.shape)}")
    n, k = raw.shape[0], raw.shape[1] // nbytes * elems
    if k > MAX_K:
        raise ValueError(f"K={k} exceeds {MAX_K}")
    return CudaGgmlWeight(t, (n, k), **repack(raw.contiguous(), t), exact=exact)


def _check_weight(w: CudaGgmlWeight) -> None:
    """The fields agree with the type and shape (a wrong layout would read garbage)."""
    if not supports(w.ggml_type):
        raise ValueError(f"GGML type {w.ggml_type!r} has no GPU kernels here")
    spec, (n, k) = w.spec, w.shape
    want = {"lo": ((n, k * spec.lb // 32), (torch.int32,)),
            "d": ((n, k // spec.superblock), (torch.int32 if spec.dd else torch.float16,))}
    if spec.hb:
        want["hi"] = ((n, k // spec.sb), (torch.int16, torch.int32))
    if spec.mode == 1:
        want["dm"] = ((n, k // spec.superblock), (torch.float16,))
    if spec.mode >= 2:
        want["sc"] = ((n, k // spec.sb), (torch.int16,) if spec.scm else (torch.int8,
                                                                           torch.uint8))
    for name, (shape, dtypes) in want.items():
        v = getattr(w, name)
        if v is None or tuple(v.shape) != shape or v.dtype not in dtypes or not v.is_contiguous():
            raise ValueError(f"{w.ggml_type.name} field {name} must be contiguous {shape} "
                             f"{dtypes}; got {None if v is None else (tuple(v.shape), v.dtype)}")
        if v.device != w.lo.device:
            raise ValueError("all fields of a weight must be on one device")


def _type_consts(spec: PackSpec) -> dict:
    return dict(SB=spec.sb, LB=spec.lb, HB=spec.hb, SUPER=spec.superblock, MODE=spec.mode,
                OFF=spec.off, LUT=spec.lut, DD=spec.dd)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _sms(x: torch.Tensor) -> int:
    return _num_sms(x.device.index or 0) if x.is_cuda else 1


def _gemv_class(spec: PackSpec) -> str:
    """The GEMV tiling class of a type: 4-bit plain (Q4_0, Q4_1, Q4_K), Q6_K, 4-bit with a
    1-bit plane or the IQ4 value polynomial (Q5_*, IQ4_*: more registers and ALU work an
    element), 8-bit (Q8_0), 2-bit (Q2_K, Q3_K)."""
    if spec.lb == 4:
        if spec.hb == 2:
            return "q6"
        return "q4" if spec.hb == 0 and not spec.lut else "q4h"
    return "q8" if spec.lb == 8 else "q2"


def _is_q4k(spec: PackSpec) -> bool:
    """Q4_K's layout (4-bit, no high plane, 256-element super-blocks of 32-element
    sub-blocks): the type the tensor-core plan's Q4_K-only choices were measured on."""
    return spec.lb == 4 and spec.hb == 0 and not spec.lut and spec.superblock == 256 \
        and spec.sb == 32


_GEMV_TILES = {  # class -> (BN at M = 1, BN at M = 2, BK, prefetch)
    "q4": (8, 16, 4096, False), "q6": (8, 16, 2048, True), "q4h": (8, 4, 2048, True),
    "q8": (8, 8, 2048, False), "q2": (8, 4, 2048, False),
}
"""The H100 sweep (tools/bench_ggml.py, 8B shapes; Triton 3.6): Q4_K's best at M = 1 was
(8, 4096) at every shape and (16, 4096) at M = 2; Q6_K's (8, 2048) with the next K step
prefetched (8-20% faster than one 4096 step), (16, 2048) at M = 2; Q8_0's (8, 2048) at
M = 1 and 2. Two exceptions at M = 1, from a second H100 sweep: Q4_K halves its K step
where the grid runs past one wave of 4096-element programs (about 4 an SM) but fits in one
of 2048 (qkv, N = 6144: 7.9 us against 9.1); Q6_K takes 1024-element steps and 2 warps
where the grid is many waves deep (the LM head, N = 128256: 187 us against 204). The
others follow their class (checked only for register spills in the
sm_90 compile: Q5_* and IQ4_* take BN 4 at M = 2, Q6_K's 16 spills for them; the 2-bit
types spill past BN 8 at 4096-element steps)."""


def plan_gemv(m: int, n: int, k: int, spec: PackSpec, num_sms: int
              ) -> Tuple[int, int, int, bool]:
    """``(BN, BK, num_warps, prefetch)`` of the GEMV for ``m`` (1 or 2) rows of an ``[n, k]``
    weight (``_GEMV_TILES``). K steps of 512 words for 4-bit quants, whose activation runs
    are then wide enough that a thread holds whole sub-blocks (its scales are fetched once
    per sub-block: the layout ``ggml_gemv_kernel`` asks its loads for); a ragged last step
    is masked. The row block halves while the grid would leave SMs idle. Fixed by shape:
    one summation order per shape."""
    cls = _gemv_class(spec)
    bn1, bn2, bk, prefetch = _GEMV_TILES[cls]
    bn, warps = (bn2 if m >= 2 else bn1), 4
    bk = max(spec.sb, min(bk, triton.next_power_of_2(k)))
    while bn > 1 and triton.cdiv(n, bn) < num_sms:
        bn //= 2
    programs = triton.cdiv(n, bn)
    if m == 1 and _is_q4k(spec) and bk == 4096 and 4 * num_sms < programs <= 8 * num_sms:
        bk = 2048  # past one wave of 4096-element programs, within one of 2048 (qkv)
    elif m == 1 and cls == "q6" and programs >= 32 * num_sms:
        bk, warps = 1024, 2  # many waves (the LM head): smaller programs, more resident
    return bn, bk, warps, prefetch and k > bk


@functools.lru_cache(maxsize=4096)
def plan_mm(m: int, n: int, k: int, spec: PackSpec, num_sms: int, wgmma: bool = True
            ) -> Tuple[int, int, int, int, int, int, int, bool]:
    """``(BM, BN, BK, num_warps, num_stages, GROUP_M, SPLIT, SWAP)`` of the tensor-core
    kernel; ``wgmma``: the GPU has Hopper's wgmma (``_has_wgmma``).

    With wgmma, from the H200 sweep over the 8B shapes (Q4_K; tools/bench_ggml.py
    ``--sweep``, docs/benchmarks/ggml-mm-variants-h200.json): up to 32 rows and from 65 a
    64-row weight tile, 16 or 32 x rows with 4 warps and 256-element K steps (128 for 32
    rows unsplit), 128 x rows with 8 warps and 128-element steps, K split in 2, 4, .. until
    the tiles fill the SMs; on it the transposed product (``SWAP``: the decoded weight as
    wgmma's register A operand). A Q4_K layer's four products against the mma.sync plan:
    176.6 -> 138.1 us at 16 rows, 245.4 -> 158.9 at 32, 380.0 -> 277.7 at 128 (bf16 cuBLAS
    121.6 / 124.3 / 140.8); every type measured gained at 16 and 32 rows (IQ4_XS's gate_up
    even), but at 128 the types with the heavier tiles (Q8_0's 8-bit words, a high plane:
    Q5_*, Q6_K) were 5-11% faster on the same tiles unswapped
    (docs/benchmarks/ggml-swap-h200.json, ``swap_flipped_us``), so they keep them.

    Without wgmma (and at 33-64 rows with it) the earlier plan, from an H100 sweep (Q4_K,
    Q6_K, Q8_0): up to 16 rows a 16-row tile 64 wide, K split 4 ways; up to 32 rows the
    same with 32; up to 64 rows 64x64 with K split 4 ways while the tiles leave SMs idle,
    else 64x128 unsplit (2-bit types: 64 wide, Triton 3.6's dot-operand pass crashes on
    their 128-wide tile); more rows 128x64. Q4_K at up to 64 rows: 64-element K steps
    where the 64x128 tiles fit two an SM (gate_up: 97 us against 105), and for a long K
    (down, K = 14336) 256-element steps split 2 ways (64 against 70). With wgmma, since
    the scales load asynchronously (``PackSpec.dd`` / ``scm``; H200 sweep,
    docs/benchmarks/ggml-dd-h200.json): gate_up 128-element steps (69.2 us against 85.4
    for 64), down 64x128 tiles of 64-element steps split 8 ways, transposed (42.0 against
    47.5 unswapped with 128-element steps). A split keeps at least two K steps."""
    swap = False
    if wgmma and (m <= 32 or m > 64):
        heavy = spec.lb == 8 or (spec.lb == 4 and spec.hb > 0)  # Q8_0, Q5_*, Q6_K
        swap = m <= 32 or not heavy
        bm = 16 if m <= 16 else 32 if m <= 32 else 128
        bn, warps, split = 64, (8 if bm == 128 else 4), 1
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
        while tiles * split < num_sms and split < 8:
            split *= 2
        bk = 128 if bm == 128 or (bm == 32 and split == 1) else 256
    elif m <= 16:
        bm, bn, bk, warps, split = 16, 64, 256, 4, 4
    elif m <= 32:
        bm, bn, bk, warps, split = 32, 64, 128, 4, 4
    elif m <= 64:
        bm, bk, warps = 64, 128, 4
        bn = 128 if triton.cdiv(n, 128) >= num_sms and spec.lb != 2 else 64
        split = 4 if triton.cdiv(n, bn) < num_sms else 1
        if _is_q4k(spec) and bn == 128 and triton.cdiv(n, bn) <= 2 * num_sms:
            bk = 128 if wgmma else 64  # Q4_K, N = 28672: two tiles an SM, in one wave
        elif _is_q4k(spec) and split > 1 and k >= 8192:  # Q4_K, long K (down)
            if wgmma:
                bn, split, bk, swap = 128, 8, 64, True
            else:
                bn, split, bk = 64, 2, 256
    else:
        bm, bn, bk, warps = 128, 64, 128, 4
        split = 4 if triton.cdiv(m, bm) * triton.cdiv(n, bn) < num_sms else 1
    bk = max(spec.sb, bk)
    while split > 1 and k // (bk * split) < 2:
        split //= 2
    return bm, bn, bk, warps, 3, 8, split, swap


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> Tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def _has_wgmma(x: torch.Tensor) -> bool:
    """Whether ``x``'s GPU has Hopper's wgmma (sm_90: the H100 / H200 the plans were
    measured on); True off the GPU (the interpreter runs the wgmma plans' shapes)."""
    return not x.is_cuda or _capability(x.device.index or 0)[0] == 9


def _is_weight(w) -> None:
    if not isinstance(w, CudaGgmlWeight):
        raise ValueError(f"w must be a CudaGgmlWeight from prepare(); got {type(w).__name__}")


def _check_inputs(x: torch.Tensor, w: CudaGgmlWeight, bias: Optional[torch.Tensor],
                  gated: bool = False) -> None:
    _is_weight(w)
    n, k = w.shape
    if x.dim() < 1 or x.shape[-1] != (2 * k if gated else k):
        raise ValueError(f"x [.., {'2K' if gated else 'K'}] and the weight [N, K] = "
                         f"{w.shape} disagree: {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"x must be one of {_DTYPES}; got {x.dtype}")
    if x.device != w.lo.device:
        raise ValueError(f"x is on {x.device}, the weight on {w.lo.device}")
    if bias is not None and (tuple(bias.shape) != (n,) or bias.dtype != x.dtype
                             or bias.device != x.device):
        raise ValueError(f"bias must be [{n}] {x.dtype} on {x.device}; got "
                         f"{tuple(bias.shape)} {bias.dtype} {bias.device}")


def _launch_gemv(x2: torch.Tensor, w: CudaGgmlWeight, bias, y: torch.Tensor, config,
                 ids: Optional[torch.Tensor] = None) -> None:
    """``ids`` (int64 ``[R]``): only those rows, at the whole weight's tiles (``IDS``)."""
    m, k = x2.shape
    n = w.shape[0] if ids is None else ids.numel()
    bn, bk, warps, prefetch = config or plan_gemv(m, w.shape[0], k, w.spec, _sms(x2))
    ptrs, strides = w.args
    gk.ggml_gemv_kernel[(triton.cdiv(n, bn),)](
        x2, y, bias if bias is not None else y, *ptrs, y if ids is None else ids, m, n, k,
        x2.stride(0), y.stride(0), *strides, _MAGIC, **_type_consts(w.spec),
        BM=triton.next_power_of_2(m), BN=bn, NSUB=bk // w.spec.sb, HAS_BIAS=bias is not None,
        EVEN_K=k % bk == 0, PREFETCH=prefetch, PDL=pdl.enabled(x2), WARPS=warps,
        IDS=ids is not None, num_warps=warps, **pdl.launch_args(x2))


def takes_int8_gemv(spec: PackSpec) -> bool:
    """The types of the int8 GEMV: ``ggml_gemv_i8_kernel``'s 4-bit quants in 32-element
    sub-blocks, no high bits, no value table (Q4_0, Q4_1, Q4_K), and Q8_0 (a byte an
    element); ``ggml_gemv_i8_q6_kernel``'s Q6_K."""
    return (spec.lb in (4, 8) and spec.hb == 0 and not spec.lut and spec.sb == 32
            and spec.mode in (0, 1, 3)) or _is_q6k(spec)


def _is_q6k(spec: PackSpec) -> bool:
    """Q6_K's layout: 16-element sub-blocks of 4 low and 2 high bits, ``d * sc``."""
    return spec.sb == 16 and spec.lb == 4 and spec.hb == 2 and spec.mode == 2 \
        and not spec.lut


def i8_plan_wps(spec: PackSpec) -> int:
    """The ``wps`` the int8 GEMV's tile plans take for this type: 8 (half the 4-bit K
    step) for Q8_0 and Q6_K, 4 for the 4-bit types."""
    return 8 if _is_q6k(spec) else _wps(spec)


def i8_group(spec: PackSpec) -> int:
    """Elements of x that the int8 GEMV rounds with one absmax step: Q6_K's 16 (its
    scales' granularity), else 32."""
    return 16 if _is_q6k(spec) else 32


def _wps(spec: PackSpec) -> int:
    """Words of a 32-element sub-block: 4 (4-bit quants) or 8 (Q8_0)."""
    return spec.sb * spec.lb // 32


def plan_gemv_i8(n: int, k: int, num_sms: int, prequant: bool = False, wps: int = 4
                 ) -> Tuple[int, int, int, bool, int]:
    """``(BN, BK, num_warps, prefetch, split)`` of ``ggml_gemv_i8_kernel``, from the H200
    sweep with K split over programs (Q4_K, 8B shapes, 33 configs,
    docs/benchmarks/ggml-split-h200.json): 16 rows and 2048-element K steps, unsplit,
    where 16-row programs fill the SMs eight times over (gate_up, N = 28672: 20.0 us;
    split 2 or 4: 23.2); the same steps split in two where they fill them two to eight
    times (qkv, N = 6144: 5.96 us against 6.55 for the earlier 8 rows unsplit), at 32 rows
    a program for the 4-bit types (5.71 against 6.03 us for 16 in the same run; 64 rows or
    32 elsewhere were slower: docs/benchmarks/ggml-wide-h200.json); 16 rows
    and 1024, split in four, for a long row of few programs (down, K = 14336: 11.9 us
    against 14.1 for 16 rows of 4096, the best unsplit); else 16 rows of 4096 in one step
    (o_proj, N = K = 4096: 4.47 us, no split faster). With x rounded beforehand
    (``prequant``, the gated down projection) 4 rows, 2048-element steps and 2 warps,
    prefetched (12.2 us with the rounding kernel, 13.1 for the earlier 8 rows of 4 warps,
    13.4 for the best split). ``CVLLM_GGML_I8_SPLIT=0``: the plan before the split (H100
    sweep: 8 rows of 2048 where programs fill the SMs two to eight times or x is rounded
    beforehand, else as above unsplit). Q8_0 (``wps`` 8 words a sub-block) takes half
    the K step: the same words a program holds."""
    programs = triton.cdiv(n, 16)
    bn, bk, warps, prefetch, split = 16, 4096, 4, False, 1
    if not tuning.current().ggml_i8_split:
        if prequant or 2 * num_sms < programs < 8 * num_sms:
            bn, bk = 8, 2048
        elif programs >= 8 * num_sms:
            bk = 2048
    elif prequant:
        bn, bk, warps, prefetch = 4, 2048, 2, True
    elif programs >= 8 * num_sms:
        bk = 2048
    elif programs > 2 * num_sms:
        bk, split = 2048, 2
        if wps == 4:  # 4-bit: 32 rows a program (H200 sweep at 32 and 64 rows)
            bn = 32
    elif k > 2 * bk:
        bk, split = 1024, 4
    bk = max(32, min(bk * 4 // wps, triton.next_power_of_2(k)))
    return bn, bk, warps, prefetch, split


def i8_config(config: Optional[tuple], n: int, k: int, num_sms: int, prequant: bool,
              wps: int) -> Tuple[int, int, int, bool, int, int]:
    """``(BN, BK, num_warps, prefetch, split, steps)`` of one int8 GEMV call: the plan's,
    or ``config`` as given (four values: no split; or five), refused (ValueError) where
    the kernel cannot take it. ``split`` is trimmed so that every run of ``steps`` K
    steps has at least one."""
    cfg = tuple(config) if config else plan_gemv_i8(n, k, num_sms, prequant, wps)
    if len(cfg) == 4:
        cfg = cfg + (1,)
    if len(cfg) != 5:
        raise ValueError(f"an int8 GEMV config is (BN, BK, num_warps, prefetch[, split]); "
                         f"got {config!r}")
    bn, bk, warps, prefetch, split = cfg
    if split < 1 or (split > 1 and bn < SEM_ROWS):
        raise ValueError(f"an int8 GEMV split must be >= 1, with BN >= {SEM_ROWS} when > 1; "
                         f"got {config!r}")
    total = triton.cdiv(k, bk)
    steps = triton.cdiv(total, min(split, total))
    return bn, bk, warps, prefetch, triton.cdiv(total, steps), steps


def _prequant(act: int) -> bool:
    mode = tuning.current().ggml_q8_x
    return mode == "all" or (mode == "gated" and act != 0)


def _launch_gemv_i8_q6(x2: torch.Tensor, w: CudaGgmlWeight, bias, y: torch.Tensor,
                       config, act: int) -> None:
    """Q6_K's int8 GEMV (``ggml_gemv_i8_q6_kernel``): x always rounded by each program (per
    16 elements, a granularity ``ggml_q8_kernel`` does not make); tiles as planned for
    Q8_0 (half the 4-bit K step: a 16-element sub-block's 2.5 words and scale), or as
    given (a prefetch flag is taken and ignored)."""
    n, k = w.shape
    bn, bk, warps, _prefetch, split, steps = i8_config(config, n, k, _sms(x2), False,
                                                       i8_plan_wps(w.spec))
    if bk % 16:
        raise ValueError(f"a Q6_K int8 GEMV step must be a multiple of 16 elements; got {bk}")
    (lo, hi, d, _dm, sc), (s_lo, s_sub, s_d) = w.args
    ws = torch.empty(split, n, dtype=torch.float32, device=y.device) if split > 1 else y
    gk.ggml_gemv_i8_q6_kernel[(triton.cdiv(n, bn) * split,)](
        x2, y, bias if bias is not None else y, lo, hi, d, sc, ws, w.sem, n, k, s_lo, s_sub,
        s_d, BN=bn, NSUB=bk // 16, HAS_BIAS=bias is not None, EVEN_K=k % bk == 0,
        PDL=pdl.enabled(x2), WIDE=n * s_lo >= 1 << 31, ASM=not _INTERPRETED, ACT=act,
        SPLIT=split, STEPS=steps, num_warps=warps, **pdl.launch_args(x2))


def _launch_gemv_i8(x2: torch.Tensor, w: CudaGgmlWeight, bias, y: torch.Tensor,
                    config, act: int = 0, prequant: Optional[bool] = None,
                    given: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> None:
    n, k = w.shape
    if _is_q6k(w.spec):
        _launch_gemv_i8_q6(x2, w, bias, y, config, act)
        return
    prequant = _prequant(act) if prequant is None else prequant
    wps = _wps(w.spec)
    bn, bk, warps, prefetch, split, steps = i8_config(config, n, k, _sms(x2), prequant, wps)
    (lo, _hi, d, dm, sc), (s_lo, s_sub, s_d) = w.args
    spec = w.spec
    xq, xs = x2, x2
    if given is not None and not act:  # rounded by the kernel that wrote x (same bits)
        xq, xs = given
    elif prequant:
        xq, xs = quantize_q8(x2, k, act, wps)
        act = 0
    ws = torch.empty(split, n, dtype=torch.float32, device=y.device) if split > 1 else y
    gk.ggml_gemv_i8_kernel[(triton.cdiv(n, bn) * split,)](
        xq, xs, y, bias if bias is not None else y, lo, d, dm, sc, ws, w.sem, n, k, s_lo,
        s_sub, s_d, SUPER=spec.superblock, MODE=spec.mode, OFF=spec.off, BN=bn,
        NSUB=bk // 32, HAS_BIAS=bias is not None, EVEN_K=k % bk == 0,
        PREFETCH=prefetch and steps > 1, PDL=pdl.enabled(x2), WIDE=n * s_lo >= 1 << 31,
        ASM=not _INTERPRETED, ACT=act, XQ=xq is not x2, WPS=wps, SPLIT=split, STEPS=steps,
        num_warps=warps, **pdl.launch_args(x2))


def mm_config(config: Optional[tuple], m: int, n: int, k: int, spec: PackSpec,
              num_sms: int, wgmma: bool = True
              ) -> Tuple[int, int, int, int, int, int, int, bool]:
    """The tensor-core kernel's config ``(BM, BN, BK, num_warps, num_stages, GROUP_M,
    SPLIT, SWAP)``: ``plan_mm``'s (cached: every launch asks), or ``config`` as given
    (seven values: unswapped; or all eight), refused (ValueError) where the kernel cannot
    take it."""
    if not config:
        return plan_mm(m, n, k, spec, num_sms, wgmma)
    cfg = tuple(config)
    if len(cfg) == 7:
        cfg = cfg + (False,)
    if len(cfg) != 8:
        raise ValueError(f"an mm config is (BM, BN, BK, num_warps, num_stages, GROUP_M, "
                         f"SPLIT[, SWAP]); got {config!r}")
    why = mm_refusal(spec, *cfg)
    if why:
        raise ValueError(f"mm config {cfg} refused: {why}")
    return cfg


def mm_refusal(spec: PackSpec, bm: int, bn: int, bk: int, warps: int = 4, stages: int = 3,
               group: int = 8, split: int = 1, swap: bool = False) -> Optional[str]:
    """Why ``ggml_mm_kernel`` cannot take this config for ``spec`` (None: it can): said
    here instead of by the compiler or a division by zero."""
    for name, v in (("BM", bm), ("BN", bn), ("BK", bk)):
        if v < 16 or v & (v - 1):
            return f"{name}={v} must be a power of two >= 16 (tl.dot)"
    if bk % spec.sb:
        return f"BK={bk} is not a whole number of {spec.sb}-element sub-blocks"
    if warps not in (1, 2, 4, 8, 16):
        return f"num_warps={warps} must be 1, 2, 4, 8 or 16"
    for name, v in (("num_stages", stages), ("GROUP_M", group), ("SPLIT", split)):
        if not isinstance(v, int) or v < 1:
            return f"{name}={v!r} must be a positive integer"
    if not isinstance(swap, bool):
        return f"SWAP={swap!r} must be True or False"
    return None


def _compile_failure(e: Exception) -> bool:
    """Whether ``e`` is Triton's compiler (or its resource check) refusing a kernel, as
    opposed to a failure of the launch or of the device."""
    name, mod = type(e).__name__, type(e).__module__ or ""
    return (mod.startswith("triton") and not name.startswith("Interpreter")) \
        or "CompilationError" in name or "PassManager" in str(e)


def _launch_mm(x2: torch.Tensor, w: CudaGgmlWeight, bias, y: torch.Tensor, config) -> None:
    m, k = x2.shape
    n = w.shape[0]
    bm, bn, bk, warps, stages, group, split, swap = mm_config(
        config, m, n, k, w.spec, _sms(x2), _has_wgmma(x2))
    steps_per = triton.cdiv(triton.cdiv(k, split), bk)  # whole K steps a split
    split = triton.cdiv(k, steps_per * bk)
    ws = y
    if split > 1:
        ws = torch.empty(split, m, n, dtype=torch.float32, device=x2.device)  # [S, M, N]
    ptrs, strides = w.args
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), split)
    try:
        gk.ggml_mm_kernel[grid](
            x2, y, bias if bias is not None else y, ws, *ptrs, m, n, k, steps_per,
            x2.stride(0), y.stride(0), *strides, _MAGIC, **_type_consts(w.spec), BM=bm, BN=bn,
            NSUB=bk // w.spec.sb, GROUP_M=group, HAS_BIAS=bias is not None,
            EVEN_K=k % bk == 0, EVICT_FIRST=triton.cdiv(m, bm) == 1, SPLIT=split,
            UPCAST=_INTERPRETED and x2.dtype == torch.bfloat16, SWAP=swap,
            num_warps=warps, num_stages=stages)
    except Exception as e:  # noqa: BLE001 - only the compiler's refusals are re-worded
        if not _compile_failure(e):
            raise
        raise ValueError(f"ggml_mm_kernel cannot compile or launch for {w.ggml_type.name} with "
                         f"(BM, BN, BK, warps, stages, GROUP_M, SPLIT, SWAP) = "
                         f"{(bm, bn, bk, warps, stages, group, split, swap)}: "
                         f"{type(e).__name__}: {str(e)[:500]}") from e
    if split > 1:
        block = 1024
        gk.ggml_splitk_reduce[(triton.cdiv(m * n, block),)](
            ws, y, bias if bias is not None else y, m, n, y.stride(0), SPLIT=split,
            HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)


def choose_path(m: int, spec: Optional[PackSpec] = None, exact: bool = False,
                shape: Optional[Tuple[int, int]] = None, num_sms: int = 132) -> str:
    """``"gemv_i8"``, ``"gemv"``, ``"mm"`` or ``"dense"`` for ``m`` input rows of a weight
    of layout ``spec`` (``exact``: activations kept as they are; see the module
    docstring) and, when known, ``shape`` ``(N, K)`` on a GPU of ``num_sms`` SMs: a Q6_K
    weight whose int8 plan splits K more than in two keeps the float GEMV
    (``q6k_takes_int8``)."""
    if m == 1 and spec is not None and tuning.current().ggml_int8_gemv and not exact and takes_int8_gemv(spec):
        if shape is None or not _is_q6k(spec) or q6k_takes_int8(*shape, num_sms):
            return "gemv_i8"
    if m <= GEMV_MAX_M:
        return "gemv"
    return "mm" if m < DENSE_MIN_M else "dense"


def q6k_takes_int8(n: int, k: int, num_sms: int) -> bool:
    """Whether a Q6_K ``[n, k]`` weight takes the int8 GEMV at one row: where its plan
    splits K in two at most. H200, the 8B shapes at Q6_K (``ggml-q6k-{i8,float}-h200.json``):
    gate_up 32.5 against 44.8 us on the float GEMV, the LM head's shape 128 against 179,
    o_proj 7.1 against 7.7, qkv 11.3 both; the down projection (K = 14336, split in four)
    41.9 against 23.3."""
    return plan_gemv_i8(n, k, num_sms, False, 8)[4] <= 2


def gated_fusable(x: torch.Tensor, w: CudaGgmlWeight) -> bool:
    """Whether ``linear(x, w, act=...)`` applies a gated activation itself for this
    ``[.., 2K]`` input: one row on the ``gemv_i8`` path."""
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    return rows == 1 and choose_path(1, w.spec, w.exact, w.shape, _sms(x)) == "gemv_i8"


def linear(x: torch.Tensor, w: CudaGgmlWeight, bias: Optional[torch.Tensor] = None, *,
           path: Optional[str] = None, config: Optional[tuple] = None,
           act: Optional[str] = None, prequant: Optional[bool] = None) -> torch.Tensor:
    """``x [.., K]`` (bf16 / fp16) -> ``x @ W^T (+ bias)`` ``[.., N]`` in x's dtype; any
    number of rows. ``path`` / ``config`` override ``choose_path`` and the tile plans (the
    benchmark's sweep); ``gemv`` takes at most 16 rows, ``gemv_i8`` one row of Q4_0 /
    Q4_1 / Q4_K / Q8_0. ``act`` (a key of ``kernels/activation.ACTIVATIONS``): x is a gate_up
    output ``[.., 2K]`` and the product is with ``act(gate) * up``, applied by the kernel
    (``gemv_i8`` only: ``gated_fusable``). ``prequant``: on ``gemv_i8``, round x in its own
    kernel first (default: ``CVLLM_GGML_Q8_X``'s choice); an x that carries its int8 form
    (``attach_q8``: an RMSNorm's output) is not rounded again."""
    _check_inputs(x, w, bias, gated=act is not None)
    n, k = w.shape
    act_code = 0
    if act is not None:
        from cvllm.kernels.activation import ACTIVATIONS

        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {act!r}; supported: {list(ACTIVATIONS)}")
        if not gated_fusable(x, w) or path not in (None, "gemv_i8"):
            raise ValueError("a gated input needs one row on the gemv_i8 path")
        act_code, k = ACTIVATIONS[act] + 1, 2 * k
    x2 = x.reshape(-1, k)  # [M, K] (or [1, 2K] gated)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)  # [M, N]
    if m and n:
        if bias is not None and bias.stride(0) != 1:
            bias = bias.contiguous()
        path = path or choose_path(m, w.spec, w.exact, w.shape, _sms(x))
        if path == "gemv_i8":
            if m != 1 or not takes_int8_gemv(w.spec):
                raise ValueError(f"the gemv_i8 path takes one row of Q4_0 / Q4_1 / Q4_K / "
                                 f"Q8_0 / Q6_K; got {m} rows of {w.ggml_type.name}")
            _launch_gemv_i8(x2, w, bias, y, config, act_code, prequant,
                            attached_q8(x, _wps(w.spec)))
        elif path == "gemv":
            if m > 16:
                raise ValueError(f"the gemv path takes at most 16 rows; got {m}")
            _launch_gemv(x2, w, bias, y, config)
        elif path == "mm":
            _launch_mm(x2, w, bias, y, config)
        elif path == "dense":
            dense = dequantize(w, x.dtype, out=_scratch(n * k, x.dtype, x.device))
            torch.matmul(x2, dense.t(), out=y)
            if bias is not None:
                y += bias
        else:
            raise ValueError(f"unknown path {path!r}")
    return y.reshape(x.shape[:-1] + (n,))


_SCRATCH: Dict[Tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _scratch(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat buffer of at least ``numel`` for the dense path: one per (device, dtype),
    grown to the largest weight seen (stream-ordered reuse); a fresh one while a CUDA
    graph is being captured."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.empty(numel, dtype=dtype, device=device)
    key = (device, dtype)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < numel:
        _SCRATCH.pop(key, None)
        buf = _SCRATCH[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


def _launch_dequant(w: CudaGgmlWeight, out: torch.Tensor, ids: Optional[torch.Tensor]) -> None:
    rows = out.shape[0]
    n, k = w.shape
    bk = max(w.spec.sb, min(triton.next_power_of_2(k), 512))
    bn = max(1, 4096 // bk)
    ptrs, strides = w.args
    grid = (triton.cdiv(rows, bn), triton.cdiv(k, bk))
    gk.ggml_dequant_kernel[grid](
        out, ids if ids is not None else out, *ptrs, rows, n, k, out.stride(0), *strides,
        _MAGIC, **_type_consts(w.spec), BN=bn, NSUB=bk // w.spec.sb, HAS_IDS=ids is not None,
        EVEN_K=k % bk == 0, num_warps=4)


def dequantize(w: CudaGgmlWeight, dtype: torch.dtype = torch.bfloat16,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The dense weight ``[N, K]`` in ``dtype`` (float32 arithmetic, one rounding);
    ``out`` (a flat buffer of at least N*K) to write into."""
    _is_weight(w)
    if dtype not in _DTYPES + (torch.float32,):
        raise ValueError(f"dtype must be float16, bfloat16 or float32; got {dtype}")
    n, k = w.shape
    if out is None:
        out = torch.empty(n * k, dtype=dtype, device=w.lo.device)
    dense = out[:n * k].view(n, k)  # [N, K]
    if n and k:
        _launch_dequant(w, dense, None)
    return dense


def embedding(w: CudaGgmlWeight, ids: torch.Tensor,
              dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Rows ``ids [..]`` of the dequantized weight -> ``[.., K]`` in ``dtype`` (the token
    embedding). Ids must be in ``[0, N)``: checked on the CPU; on the GPU (no host sync)
    an id out of range reads the nearest row."""
    _is_weight(w)
    if ids.dtype not in (torch.int32, torch.int64) or ids.device != w.lo.device:
        raise ValueError(f"ids must be int32/int64 on {w.lo.device}; got {ids.dtype} "
                         f"on {ids.device}")
    if dtype not in _DTYPES + (torch.float32,):
        raise ValueError(f"dtype must be float16, bfloat16 or float32; got {dtype}")
    n, k = w.shape
    flat = ids.reshape(-1).contiguous()  # [T]
    if not flat.is_cuda and flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= n):
        raise ValueError(f"ids out of range [0, {n})")
    out = torch.empty(flat.numel(), k, dtype=dtype, device=w.lo.device)  # [T, K]
    if flat.numel() and k:
        _launch_dequant(w, out, flat)
    return out.reshape(ids.shape + (k,))


class CudaBackend(GgmlBackend):
    """``backend.GgmlBackend`` over this module's functions (bf16 / fp16 activations)."""

    name = "triton"

    def supports(self, t: GgmlType, dtype: torch.dtype) -> bool:
        return supports(t) and dtype in _DTYPES

    def prepare(self, raw: torch.Tensor, t: GgmlType, dtype: torch.dtype,
                batch_copy: bool = False, exact: bool = False) -> CudaGgmlWeight:
        return prepare(raw, t, exact)  # batched calls decode tiles on the fly: no copy

    def linear(self, x: torch.Tensor, w: CudaGgmlWeight,
               bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return linear(x, w, bias)

    def linear_head(self, x: torch.Tensor, w: CudaGgmlWeight, bias=None) -> torch.Tensor:
        from cvllm.kernels.quant import ggml_head  # (it imports this module)
        return ggml_head.head_linear(x, w, bias)

    def linear_gated(self, x: torch.Tensor, w: CudaGgmlWeight, act: str,
                     bias: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        return linear(x, w, bias, act=act) if gated_fusable(x, w) else None

    def rounded_input(self, w: CudaGgmlWeight) -> int:
        q6 = _is_q6k(w.spec)  # rounds per 16 elements itself: no form made for it
        return _wps(w.spec) if choose_path(1, w.spec, w.exact) == "gemv_i8" and not q6 else 0

    def embedding(self, w: CudaGgmlWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return embedding(w, ids, dtype)
