"""Programmatic dependent launch (PDL, Hopper and newer): a kernel may start while the
one before it on the stream is finishing, and waits only where it reads that kernel's
results.

Used by ``kernels/gemv.py``: a batch-1 GEMV is a pure weight stream, and weights never
depend on the kernel before it, so each program loads its first weight tile, then waits
(``gdc_wait``) before it reads the input row. The kernels that precede a GEMV in a decoder
step (RMSNorm, the custom all-reduce, attention's decode and merge, the gated activation,
another GEMV) call ``gdc_launch_dependents``, which lets the GEMV's programs take the SMs
they leave idle: its weight stream overlaps their tail and, at TP > 1, the all-reduce's
wait for its peers. Launched without PDL, or followed by a kernel that is not, the
trigger does nothing. CUDA graphs keep the dependency (as a programmatic edge). The GEMV
itself triggers only after its own wait, so the kernel after it (a PDL GEMV, or the
custom all-reduce of the values a GEMV pushed, ``kernels/allreduce.py``, which waits on
the values instead of on the kernel) starts only once every kernel before the GEMV has
completed.

The attention kernels of a decode step are launched with PDL too, but wait first thing:
the fused rotary + K/V-cache write (``kernels/rotary.rotary_write_kv``, after the QKV
GEMV), the decode kernel after it and the split merge after that
(``kernels/paged_attention/decode.py``); so are the RMSNorm (``kernels/rmsnorm.py``) and the
gated activation (``kernels/activation.py``). They have nothing to load before their
inputs, so what they gain is their launch: each one's programs are already resident
when the kernel before it finishes (the measurements: docs/kernels.md).

Some of those small kernels trigger at entry instead, before their own wait
(``early_trigger``, the sites of ``CVLLM_PDL_EARLY``): the RMSNorm before a QKV projection (and
the final one, before the LM head) and the int8 rounding before the down projection.
Their GEMV's programs then become resident and read their first weight tiles while the
GEMV before the small kernel is still finishing, not only once it has (``CVLLM_PDL_EARLY``,
docs/kernels.md). Only where the next GEMV's programs fit on the SMs in one wave: before
gate_up (many waves) the early programs only sit on SM slots, and the rotary kernel's and
the attention's early triggers cost more than they gained.

Rules a PDL-launched kernel keeps: before ``gdc_wait`` it reads only data no earlier
kernel writes (weights, constants, step inputs copied in before the step's first kernel)
and writes nothing; it triggers its dependents after its own ``gdc_wait``, or (a small
kernel at an ``EARLY`` site) at entry. A kernel that has passed its wait knows that
every kernel before it on the stream has completed: the one just before it has, and
that one completed only after its own wait. The one exception: the pushed all-reduce
(``kernels/allreduce.py``) triggers at entry and waits on no kernel, so past it one knows
only that the pushing GEMV before it has passed its own wait and pushed all its values,
not that its grid has exited; a GEMV therefore always triggers after its wait.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch
import triton
import triton.language as tl

from cvllm.kernels.device import INTERPRETED
from cvllm.utils import tuning

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    HAVE_GDC = True
except ImportError:  # an older Triton: no PDL (kernels only name these under PDL=True)
    gdc_launch_dependents = gdc_wait = None
    HAVE_GDC = False




@functools.lru_cache(maxsize=None)
def _device_ok(device_index: int) -> bool:
    if torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def enabled(x: torch.Tensor) -> bool:
    """Whether kernels on ``x``'s device use PDL: an NVIDIA device of compute capability
    9+ (griddepcontrol), a Triton that has it, not the interpreter, and ``CVLLM_PDL`` not
    0 (``utils/tuning.py``)."""
    if not x.is_cuda or not HAVE_GDC or INTERPRETED or not tuning.current().pdl:
        return False
    return _device_ok(x.device.index if x.device.index is not None
                      else torch.cuda.current_device())


SITES = tuning.PDL_SITES
"""The small PDL kernels that may trigger their dependents at entry (``early_trigger``);
which of them do is ``CVLLM_PDL_EARLY`` (``utils/tuning.py``; default ``qkv,q8,norm``, from
the H200 sweep of ``tools/bench_ablate.py``'s ``early_*`` variants, docs/kernels.md)."""


def early_trigger(x: torch.Tensor, site: str) -> bool:
    """Whether the small PDL kernel at ``site`` on ``x``'s device triggers its dependents
    at entry (``CVLLM_PDL_EARLY``) instead of after its own ``gdc_wait`` (see the module
    docstring):
    safe for any follower, whose ``gdc_wait`` returns only once this kernel has
    completed, which it does only after its own wait; the one kernel that waits on
    nothing (the pushed all-reduce) follows a GEMV, never one of these."""
    return site in tuning.current().pdl_early and enabled(x)


@triton.jit
def gdc_enter(EARLY: tl.constexpr):
    """A PDL kernel's wait for the kernels before it (``gdc_wait``), with its trigger of
    the kernels after it at entry (``EARLY``: ``early_trigger``) or right after the wait.
    Call it under ``if PDL:`` (without PDL both do nothing, and an older Triton has
    neither)."""
    if EARLY:
        gdc_launch_dependents()
    gdc_wait()
    if not EARLY:
        gdc_launch_dependents()


_GRAPH_LAUNCHES = threading.local()


@contextlib.contextmanager
def _launches_as_in_graphs(on: bool):
    before = getattr(_GRAPH_LAUNCHES, "on", False)
    _GRAPH_LAUNCHES.on = on
    try:
        yield
    finally:
        _GRAPH_LAUNCHES.on = before


def graph_launches():
    """Within: launches take ``launch_pdl`` as during a CUDA-graph capture. The decode
    graphs' pre-capture warm-up forward runs inside it: ``launch_pdl`` is one of Triton's
    compile options, so a warm-up launched without it would compile the other variant and
    leave every PDL kernel to compile inside the capture."""
    return _launches_as_in_graphs(True)


def eager_launches():
    """Within: launches take no ``launch_pdl`` even inside ``graph_launches``: the
    attention launched eagerly between the captured pieces of a mixed step
    (``worker/mixed_graph.py``) in its warm-up forward, as it will be at every replay."""
    return _launches_as_in_graphs(False)


def launch_args(x: torch.Tensor) -> dict:
    """Launch options of a kernel on ``x``'s device that waits (``gdc_wait``) before it
    reads anything an earlier kernel wrote: ``launch_pdl`` where PDL is ``enabled`` and a
    CUDA graph is being captured (every decode step; ``graph_launches``). Launched eagerly
    (prefill and mixed steps), a PDL kernel held the host until the GPU had caught up, so
    the host's launches and the GPU's kernels ran one after the other instead of side by
    side (an eager step took about twice as long; docs/kernels.md). ``launch_pdl`` is a
    Triton compile option: a kernel has one compiled variant for the graphs and one for
    eager steps (the start-up warm-up compiles the eager ones); launched without it,
    ``gdc_wait`` and ``gdc_launch_dependents`` do nothing."""
    if enabled(x) and (getattr(_GRAPH_LAUNCHES, "on", False)
                       or torch.cuda.is_current_stream_capturing()):
        return {"launch_pdl": True}
    return {}
