"""``triton.jit`` for kernels whose arguments change from step to step.

Used by the kernels that run eagerly in mixed prefill steps (``paged_attention/``).
Triton compiles one variant of a kernel per *specialization* of its arguments: each
integer is classed as 1, a multiple of 16 or neither, and each pointer as 16-byte aligned
or not. Values that follow the batch (a block table's width, a split count, a metadata
array sliced past the batch's decodes) then pick a variant that no start-up warm-up can
promise to have met, and the first step that meets it waits for the compile: on an H100,
in ``tools/bench_serving.py``'s multi-turn workload with the prefix cache, six compiles of
the prefill, decode and merge kernels (0.26-0.78 s each) stalled the first pass, and its
first-token p90 was 1.8 s against 0.2 s once they were compiled. Arguments named here
are not specialized (one variant serves every value); those are scalar index loads and
loop bounds, for which the hints bought nothing measurable.
"""

from __future__ import annotations

import inspect
from typing import Sequence

import triton

_HAS_ALIGNMENT_OPTION = "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters


def jit_per_step(ints: Sequence[str] = (), pointers: Sequence[str] = ()):
    """``triton.jit`` without the specializations of the integer arguments ``ints`` and of
    the alignment of the pointer arguments ``pointers`` (by parameter name)."""
    if _HAS_ALIGNMENT_OPTION:
        return triton.jit(do_not_specialize=list(ints),
                          do_not_specialize_on_alignment=list(pointers))
    # older Triton: a pointer named in do_not_specialize loses its alignment class
    return triton.jit(do_not_specialize=list(ints) + list(pointers))
