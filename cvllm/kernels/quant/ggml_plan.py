"""The plans of the GGUF GPU kernels (``ggml_cuda``): which path a product takes and each
launch's tiles, K split and warps, from the rows, the weight's shape and layout
(``PackSpec``), the GPU's SM count and the tuning switches (``utils/tuning.py``).

Pure arithmetic on ints (torch only, no Triton): tested on the CPU
(tests/kernels/test_ggml_plan.py). Called by ``ggml_cuda`` at every launch (``plan_mm`` is
cached), by ``ggml_head`` and ``cuda_backend``; no state. Every plan is fixed by the
shape, so one shape always sums in one order (outputs do not depend on timing or on the
CUDA graph). The sweeps behind the numbers are in docs/kernels.md.

The paths (``choose_path``), by the number of rows M and the type:

- ``gemv_i8`` (M = 1, Q4_0 / Q4_1 / Q4_K / Q8_0 / Q6_K): the activations rounded to int8
  per 32 elements (Q6_K: per 16, its scales' granularity), the products summed by
  ``dp4a`` (``ggml_i8_kernels``): the float path spends about 6.4 instructions an element
  of Q4_K and is bound by its issue slots, this one 2.7; ``CVLLM_GGML_INT8_GEMV=0`` turns
  it off. It also takes a gate_up row and applies the gated activation on load. Where row
  blocks alone leave the SMs short of work (qkv, down), K is split over programs
  (``plan_gemv_i8``). Weights prepared ``exact`` (the LM head, whose logits pick the
  greedy token) keep the float ``gemv``; so does a Q6_K weight whose int8 plan would split
  K in four (``q6k_takes_int8``).
- ``gemv`` (M <= ``GEMV_MAX_M`` = 2): float32 FMA in registers, the weight streamed once
  (``ggml_kernels.ggml_gemv_kernel``, ``plan_gemv``); batch-1 decode is a pure weight
  stream.
- ``mm`` (up to 128 rows): weight tiles dequantized in registers into ``tl.dot``, K split
  over several programs when the tiles alone leave SMs idle (``plan_mm``). On Hopper, up
  to 32 rows (and from 65 for the lighter tiles) it computes the transposed product
  (``SWAP``: the decoded weight is the A operand of wgmma, read from registers, and the
  weight's rows its M of 64; unswapped, a 16- or 32-row x tile is the M of an
  ``mma.sync``); other GPUs keep the earlier plan.
- ``dense`` (M >= ``DENSE_MIN_M`` = 129, prefill): the weight dequantized into a bf16 /
  fp16 scratch, then cuBLAS.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

from cvllm.kernels.quant.ggml_pack import PackSpec
from cvllm.utils import tuning

GEMV_MAX_M = 2
"""Most rows the FMA GEMV takes; more go to the tensor-core kernel (the GEMV's FMAs grow
with the rows, the tensor-core kernel decodes each weight element once for up to 16;
H100 at 2 rows: docs/kernels.md)."""
DENSE_MIN_M = 129
"""Fewest rows that take the dequantize + cuBLAS path (faster from 256 rows on an H100,
slower at 64; docs/kernels.md)."""
SEM_ROWS = 4
"""Fewest rows a program of the split-K int8 GEMV takes (``CudaGgmlWeight.sem``)."""


def cdiv(x: int, d: int) -> int:
    """``triton.cdiv``: the ceiling of ``x / d``."""
    return (x + d - 1) // d


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2``: the smallest power of two >= ``n`` (0 for 0)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


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
"""The H100 sweep's best tiles of each class (tools/bench_ggml.py, 8B shapes); the other
types follow their class, checked for register spills (docs/kernels.md)."""


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
    bk = max(spec.sb, min(bk, next_power_of_2(k)))
    while bn > 1 and cdiv(n, bn) < num_sms:
        bn //= 2
    programs = cdiv(n, bn)
    if m == 1 and _is_q4k(spec) and bk == 4096 and 4 * num_sms < programs <= 8 * num_sms:
        bk = 2048  # past one wave of 4096-element programs, within one of 2048 (qkv)
    elif m == 1 and cls == "q6" and programs >= 32 * num_sms:
        bk, warps = 1024, 2  # many waves (the LM head): smaller programs, more resident
    return bn, bk, warps, prefetch and k > bk


@functools.lru_cache(maxsize=4096)
def plan_mm(m: int, n: int, k: int, spec: PackSpec, num_sms: int, wgmma: bool = True
            ) -> Tuple[int, int, int, int, int, int, int, bool]:
    """``(BM, BN, BK, num_warps, num_stages, GROUP_M, SPLIT, SWAP)`` of the tensor-core
    kernel; ``wgmma``: the GPU has Hopper's wgmma (``ggml_cuda.has_wgmma``).

    With wgmma (the H200 sweep, docs/kernels.md): up to 32 rows and from 65 a 64-row
    weight tile, 16 or 32 x rows with 4 warps and 256-element K steps (128 for 32 rows
    unsplit), 128 x rows with 8 warps and 128-element steps, K split in 2, 4, .. until the
    tiles fill the SMs, on the transposed product (``SWAP``: the decoded weight as wgmma's
    register A operand), except at 128 rows for the heavier tiles (Q8_0, Q5_*, Q6_K: faster
    unswapped). Without wgmma (and at 33-64 rows with it) the earlier H100 plan: up to 16
    rows a 16-row tile 64 wide, K split 4 ways; up to 32 rows the same with 32; up to 64
    rows 64x64 with K split 4 ways while the tiles leave SMs idle, else 64x128 unsplit
    (2-bit types: 64 wide, Triton 3.6's dot-operand pass crashes on their 128-wide tile);
    more rows 128x64. Q4_K at up to 64 rows: 64-element K steps where the 64x128 tiles fit
    two an SM (gate_up), and for a long K (down) 256-element steps split 2 ways; with
    wgmma, gate_up 128-element steps and down 64x128 tiles of 64-element steps split 8
    ways, transposed. A split keeps at least two K steps."""
    swap = False
    if wgmma and (m <= 32 or m > 64):
        heavy = spec.lb == 8 or (spec.lb == 4 and spec.hb > 0)  # Q8_0, Q5_*, Q6_K
        swap = m <= 32 or not heavy
        bm = 16 if m <= 16 else 32 if m <= 32 else 128
        bn, warps, split = 64, (8 if bm == 128 else 4), 1
        tiles = cdiv(m, bm) * cdiv(n, bn)
        while tiles * split < num_sms and split < 8:
            split *= 2
        bk = 128 if bm == 128 or (bm == 32 and split == 1) else 256
    elif m <= 16:
        bm, bn, bk, warps, split = 16, 64, 256, 4, 4
    elif m <= 32:
        bm, bn, bk, warps, split = 32, 64, 128, 4, 4
    elif m <= 64:
        bm, bk, warps = 64, 128, 4
        bn = 128 if cdiv(n, 128) >= num_sms and spec.lb != 2 else 64
        split = 4 if cdiv(n, bn) < num_sms else 1
        if _is_q4k(spec) and bn == 128 and cdiv(n, bn) <= 2 * num_sms:
            bk = 128 if wgmma else 64  # Q4_K, N = 28672: two tiles an SM, in one wave
        elif _is_q4k(spec) and split > 1 and k >= 8192:  # Q4_K, long K (down)
            if wgmma:
                bn, split, bk, swap = 128, 8, 64, True
            else:
                bn, split, bk = 64, 2, 256
    else:
        bm, bn, bk, warps = 128, 64, 128, 4
        split = 4 if cdiv(m, bm) * cdiv(n, bn) < num_sms else 1
    bk = max(spec.sb, bk)
    while split > 1 and k // (bk * split) < 2:
        split //= 2
    return bm, bn, bk, warps, 3, 8, split, swap


def takes_int8_gemv(spec: PackSpec) -> bool:
    """The types of the int8 GEMV: ``ggml_gemv_i8_kernel``'s 4-bit quants in 32-element
    sub-blocks, no high bits, no value table (Q4_0, Q4_1, Q4_K), and Q8_0 (a byte an
    element); ``ggml_gemv_i8_q6_kernel``'s Q6_K."""
    return (spec.lb in (4, 8) and spec.hb == 0 and not spec.lut and spec.sb == 32
            and spec.mode in (0, 1, 3)) or is_q6k(spec)


def is_q6k(spec: PackSpec) -> bool:
    """Q6_K's layout: 16-element sub-blocks of 4 low and 2 high bits, ``d * sc``."""
    return spec.sb == 16 and spec.lb == 4 and spec.hb == 2 and spec.mode == 2 \
        and not spec.lut


def i8_plan_wps(spec: PackSpec) -> int:
    """The ``wps`` the int8 GEMV's tile plans take for this type: 8 (half the 4-bit K
    step) for Q8_0 and Q6_K, 4 for the 4-bit types."""
    return 8 if is_q6k(spec) else sub_words(spec)


def i8_group(spec: PackSpec) -> int:
    """Elements of x that the int8 GEMV rounds with one absmax step: Q6_K's 16 (its
    scales' granularity), else 32."""
    return 16 if is_q6k(spec) else 32


def sub_words(spec: PackSpec) -> int:
    """Words of a 32-element sub-block: 4 (4-bit quants) or 8 (Q8_0)."""
    return spec.sb * spec.lb // 32


def plan_gemv_i8(n: int, k: int, num_sms: int, prequant: bool = False, wps: int = 4
                 ) -> Tuple[int, int, int, bool, int]:
    """``(BN, BK, num_warps, prefetch, split)`` of ``ggml_gemv_i8_kernel``, the H200
    sweep's best with K split over programs (Q4_K, 8B shapes, docs/kernels.md): 16 rows
    and 2048-element K steps, unsplit, where 16-row programs fill the SMs eight times over
    (gate_up); the same steps split in two where they fill them two to eight times (qkv),
    32 rows a program for the 4-bit types; 16 rows of 1024, split in four, for a long row
    of few programs (down); else 16 rows of 4096 in one step (o_proj). With x rounded
    beforehand (``prequant``, the gated down projection) 4 rows, 2048-element steps and 2
    warps, prefetched. ``CVLLM_GGML_I8_SPLIT=0``: the H100 plan before the split (8 rows of
    2048 where programs fill the SMs two to eight times or x is rounded beforehand, else
    as above unsplit). Q8_0 (``wps`` 8 words a sub-block) takes half the K step: the same
    words a program holds."""
    programs = cdiv(n, 16)
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
    bk = max(32, min(bk * 4 // wps, next_power_of_2(k)))
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
    total = cdiv(k, bk)
    steps = cdiv(total, min(split, total))
    return bn, bk, warps, prefetch, cdiv(total, steps), steps


def prequant_default(act: int) -> bool:
    mode = tuning.current().ggml_q8_x
    return mode == "all" or (mode == "gated" and act != 0)


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


def choose_path(m: int, spec: Optional[PackSpec] = None, exact: bool = False,
                shape: Optional[Tuple[int, int]] = None, num_sms: int = 132) -> str:
    """``"gemv_i8"``, ``"gemv"``, ``"mm"`` or ``"dense"`` for ``m`` input rows of a weight
    of layout ``spec`` (``exact``: activations kept as they are; see the module
    docstring) and, when known, ``shape`` ``(N, K)`` on a GPU of ``num_sms`` SMs: a Q6_K
    weight whose int8 plan splits K more than in two keeps the float GEMV
    (``q6k_takes_int8``)."""
    if (m == 1 and spec is not None and tuning.current().ggml_int8_gemv and not exact
            and takes_int8_gemv(spec)):
        if shape is None or not is_q6k(spec) or q6k_takes_int8(*shape, num_sms):
            return "gemv_i8"
    if m <= GEMV_MAX_M:
        return "gemv"
    return "mm" if m < DENSE_MIN_M else "dense"


def q6k_takes_int8(n: int, k: int, num_sms: int) -> bool:
    """Whether a Q6_K ``[n, k]`` weight takes the int8 GEMV at one row: where its plan
    splits K in two at most (split in four, the 8B down projection, it was 1.8x slower
    than the float GEMV on an H200; docs/kernels.md)."""
    return plan_gemv_i8(n, k, num_sms, False, 8)[4] <= 2
