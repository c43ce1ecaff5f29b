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
scales), within 1.05x of the GGUF bytes. ``linear`` takes one of four paths by the number
of rows and the type, with the tiles ``ggml_plan`` chooses: ``gemv_i8`` (one row, the
int8 GEMV of ``ggml_i8_kernels``; a gated gate_up row too: the MLP's down projection in
one kernel; K split over programs, the last of a row block to arrive adding the partial
sums, ``CudaGgmlWeight.sem`` holding the counts), ``gemv`` (float FMA, ``ggml_kernels``),
``mm`` (tensor cores) and ``dense`` (dequantize, then cuBLAS). What each streams at the
8B shapes: docs/kernels.md.

Numerics: float32 dequantization (one rounding of ``s * q + m``) and float32 accumulation;
the ``mm`` and ``dense`` paths round the weight to x's dtype before the product (as a
bf16 layer does), the ``gemv`` path does not; one rounding of the output. ``gemv_i8``
computes exactly (integer sums, float32 scaling) the product with x rounded to int8 per
32-element block with an absmax scale (llama.cpp's q8_1 rounding, which its CUDA kernels
use for every quantized product): about 0.3 / 127 of each block's largest |x| per
element, 0.5-1% of the output's RMS on random data (tests/kernels/test_ggml_cuda.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch
import triton

from cvllm.kernels import pdl
from cvllm.kernels.device import INTERPRETED, capability, sms_of
from cvllm.kernels.quant import ggml_i8_kernels as gi
from cvllm.kernels.quant import ggml_kernels as gk
from cvllm.kernels.quant.ggml_pack import SPECS, PackSpec, repack
from cvllm.kernels.quant.ggml_types import GgmlType, block_shape
from cvllm.kernels.quant.ggml_plan import (
    SEM_ROWS, choose_path, i8_config, i8_plan_wps, is_q6k, mm_config, plan_gemv,
    prequant_default, sub_words, takes_int8_gemv,
)
from cvllm.kernels.quant.q8form import attached_q8, quantize_q8

X_DTYPES = (torch.float16, torch.bfloat16)
"""Activation dtypes the kernels take."""
MAX_K = 1 << 20
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
    (``ggml_i8_kernels.ggml_gemv_i8_kernel``, ``SPLIT``), back at zero after every call.
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


def type_consts(spec: PackSpec) -> dict:
    """The ``tl.constexpr`` arguments that describe a layout to the float kernels."""
    return dict(SB=spec.sb, LB=spec.lb, HB=spec.hb, SUPER=spec.superblock, MODE=spec.mode,
                OFF=spec.off, LUT=spec.lut, DD=spec.dd)


def has_wgmma(x: torch.Tensor) -> bool:
    """Whether ``x``'s GPU has Hopper's wgmma (sm_90: the H100 / H200 the plans were
    measured on); True off the GPU (the interpreter runs the wgmma plans' shapes)."""
    return not x.is_cuda or capability(x.device.index or 0)[0] == 9


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
    if x.dtype not in X_DTYPES:
        raise ValueError(f"x must be one of {X_DTYPES}; got {x.dtype}")
    if x.device != w.lo.device:
        raise ValueError(f"x is on {x.device}, the weight on {w.lo.device}")
    if bias is not None and (tuple(bias.shape) != (n,) or bias.dtype != x.dtype
                             or bias.device != x.device):
        raise ValueError(f"bias must be [{n}] {x.dtype} on {x.device}; got "
                         f"{tuple(bias.shape)} {bias.dtype} {bias.device}")


def launch_gemv(x2: torch.Tensor, w: CudaGgmlWeight, bias, y: torch.Tensor, config,
                ids: Optional[torch.Tensor] = None) -> None:
    """``ids`` (int64 ``[R]``): only those rows, at the whole weight's tiles (``IDS``)."""
    m, k = x2.shape
    n = w.shape[0] if ids is None else ids.numel()
    bn, bk, warps, prefetch = config or plan_gemv(m, w.shape[0], k, w.spec, sms_of(x2))
    ptrs, strides = w.args
    gk.ggml_gemv_kernel[(triton.cdiv(n, bn),)](
        x2, y, bias if bias is not None else y, *ptrs, y if ids is None else ids, m, n, k,
        x2.stride(0), y.stride(0), *strides, _MAGIC, **type_consts(w.spec),
        BM=triton.next_power_of_2(m), BN=bn, NSUB=bk // w.spec.sb, HAS_BIAS=bias is not None,
        EVEN_K=k % bk == 0, PREFETCH=prefetch, PDL=pdl.enabled(x2), WARPS=warps,
        IDS=ids is not None, num_warps=warps, **pdl.launch_args(x2))


def _launch_gemv_i8_q6(x2: torch.Tensor, w: CudaGgmlWeight, bias, y: torch.Tensor,
                       config, act: int) -> None:
    """Q6_K's int8 GEMV (``ggml_gemv_i8_q6_kernel``): x always rounded by each program (per
    16 elements, a granularity ``ggml_q8_kernel`` does not make); tiles as planned for
    Q8_0 (half the 4-bit K step: a 16-element sub-block's 2.5 words and scale), or as
    given (a prefetch flag is taken and ignored)."""
    n, k = w.shape
    bn, bk, warps, _prefetch, split, steps = i8_config(config, n, k, sms_of(x2), False,
                                                       i8_plan_wps(w.spec))
    if bk % 16:
        raise ValueError(f"a Q6_K int8 GEMV step must be a multiple of 16 elements; got {bk}")
    (lo, hi, d, _dm, sc), (s_lo, s_sub, s_d) = w.args
    ws = torch.empty(split, n, dtype=torch.float32, device=y.device) if split > 1 else y
    gi.ggml_gemv_i8_q6_kernel[(triton.cdiv(n, bn) * split,)](
        x2, y, bias if bias is not None else y, lo, hi, d, sc, ws, w.sem, n, k, s_lo, s_sub,
        s_d, BN=bn, NSUB=bk // 16, HAS_BIAS=bias is not None, EVEN_K=k % bk == 0,
        PDL=pdl.enabled(x2), WIDE=n * s_lo >= 1 << 31, ASM=not INTERPRETED, ACT=act,
        SPLIT=split, STEPS=steps, num_warps=warps, **pdl.launch_args(x2))


def _launch_gemv_i8(x2: torch.Tensor, w: CudaGgmlWeight, bias, y: torch.Tensor,
                    config, act: int = 0, prequant: Optional[bool] = None,
                    given: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> None:
    n, k = w.shape
    if is_q6k(w.spec):
        _launch_gemv_i8_q6(x2, w, bias, y, config, act)
        return
    prequant = prequant_default(act) if prequant is None else prequant
    wps = sub_words(w.spec)
    bn, bk, warps, prefetch, split, steps = i8_config(config, n, k, sms_of(x2), prequant, wps)
    (lo, _hi, d, dm, sc), (s_lo, s_sub, s_d) = w.args
    spec = w.spec
    xq, xs = x2, x2
    if given is not None and not act:  # rounded by the kernel that wrote x (same bits)
        xq, xs = given
    elif prequant:
        xq, xs = quantize_q8(x2, k, act, wps)
        act = 0
    ws = torch.empty(split, n, dtype=torch.float32, device=y.device) if split > 1 else y
    gi.ggml_gemv_i8_kernel[(triton.cdiv(n, bn) * split,)](
        xq, xs, y, bias if bias is not None else y, lo, d, dm, sc, ws, w.sem, n, k, s_lo,
        s_sub, s_d, SUPER=spec.superblock, MODE=spec.mode, OFF=spec.off, BN=bn,
        NSUB=bk // 32, HAS_BIAS=bias is not None, EVEN_K=k % bk == 0,
        PREFETCH=prefetch and steps > 1, PDL=pdl.enabled(x2), WIDE=n * s_lo >= 1 << 31,
        ASM=not INTERPRETED, ACT=act, XQ=xq is not x2, WPS=wps, SPLIT=split, STEPS=steps,
        num_warps=warps, **pdl.launch_args(x2))


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
        config, m, n, k, w.spec, sms_of(x2), has_wgmma(x2))
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
            x2.stride(0), y.stride(0), *strides, _MAGIC, **type_consts(w.spec), BM=bm, BN=bn,
            NSUB=bk // w.spec.sb, GROUP_M=group, HAS_BIAS=bias is not None,
            EVEN_K=k % bk == 0, EVICT_FIRST=triton.cdiv(m, bm) == 1, SPLIT=split,
            UPCAST=INTERPRETED and x2.dtype == torch.bfloat16, SWAP=swap,
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


def gated_fusable(x: torch.Tensor, w: CudaGgmlWeight) -> bool:
    """Whether ``linear(x, w, act=...)`` applies a gated activation itself for this
    ``[.., 2K]`` input: one row on the ``gemv_i8`` path."""
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    return rows == 1 and choose_path(1, w.spec, w.exact, w.shape, sms_of(x)) == "gemv_i8"


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
        path = path or choose_path(m, w.spec, w.exact, w.shape, sms_of(x))
        if path == "gemv_i8":
            if m != 1 or not takes_int8_gemv(w.spec):
                raise ValueError(f"the gemv_i8 path takes one row of Q4_0 / Q4_1 / Q4_K / "
                                 f"Q8_0 / Q6_K; got {m} rows of {w.ggml_type.name}")
            _launch_gemv_i8(x2, w, bias, y, config, act_code, prequant,
                            attached_q8(x, sub_words(w.spec)))
        elif path == "gemv":
            if m > 16:
                raise ValueError(f"the gemv path takes at most 16 rows; got {m}")
            launch_gemv(x2, w, bias, y, config)
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
        _MAGIC, **type_consts(w.spec), BN=bn, NSUB=bk // w.spec.sb, HAS_IDS=ids is not None,
        EVEN_K=k % bk == 0, num_warps=4)


def dequantize(w: CudaGgmlWeight, dtype: torch.dtype = torch.bfloat16,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The dense weight ``[N, K]`` in ``dtype`` (float32 arithmetic, one rounding);
    ``out`` (a flat buffer of at least N*K) to write into."""
    _is_weight(w)
    if dtype not in X_DTYPES + (torch.float32,):
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
    if dtype not in X_DTYPES + (torch.float32,):
        raise ValueError(f"dtype must be float16, bfloat16 or float32; got {dtype}")
    n, k = w.shape
    flat = ids.reshape(-1).contiguous()  # [T]
    if not flat.is_cuda and flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= n):
        raise ValueError(f"ids out of range [0, {n})")
    out = torch.empty(flat.numel(), k, dtype=dtype, device=w.lo.device)  # [T, K]
    if flat.numel() and k:
        _launch_dequant(w, out, flat)
    return out.reshape(ids.shape + (k,))
