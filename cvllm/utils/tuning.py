"""The process's tuning switches (the ``CVLLM_*`` variables of docs/kernels.md), read
once into one frozen ``TuningSettings``.

Every switch chooses between two ways of computing the same thing (a kernel variant, a
fusion, a launch mode, a poll policy), kept for comparisons and for machines where the
default measured worse; none changes what a model means. ``current()`` reads
``os.environ`` the first time it is called, never at import, and returns the same object
after; a bad value raises ``ValueError`` naming its variable there. The kernels, the GGUF
and unquantized linear methods, the custom all-reduce and the control plane call it
where they used to read their module constants, so a per-call read costs one function
call (about 30 ns). Tests and tools change the switches with ``configure`` (a context
manager) instead of patching modules; ``from_environ`` parses a mapping of their own.

It lives in ``utils/`` (stdlib only, the bottom row of the layer table) because
``distributed/`` reads two of the switches and sits below ``kernels/``. The reasons behind
each default, with the measurements, are in docs/kernels.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from typing import Iterator, Mapping, Optional

PDL_SITES = ("qkv", "mlp", "norm", "rope", "q8", "act", "attn")
"""The small PDL kernels that may trigger their dependents at entry (``kernels/pdl.py``):
the RMSNorm before the attention's QKV projection (``qkv``), before the MLP's gate_up
(``mlp``), any other RMSNorm (``norm``), the rotary + K/V write (``rope``), the int8
rounding of the gated activation (``q8``), the gated activation (``act``), the decode
attention (``attn``)."""
Q8_X_CHOICES = ("gated", "all", "0")
ALLREDUCE_CHOICES = ("auto", "custom", "nccl")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class TuningSettings:
    """One value per ``CVLLM_*`` switch; the defaults are the measured best (built by
    ``from_environ``, held by ``current``)."""

    pdl: bool = True
    """``CVLLM_PDL``: programmatic dependent launch on Hopper and newer."""
    pdl_early: frozenset = frozenset({"qkv", "q8", "norm"})
    """``CVLLM_PDL_EARLY`` (a comma list of ``PDL_SITES``, or 0 for none): the small PDL
    kernels that trigger their dependents at entry instead of after their wait."""
    fused_merge: bool = True
    """``CVLLM_FUSED_MERGE``: decode attention merges its splits inside the decode
    kernel (0: a second kernel)."""
    gemv_act: bool = True
    """``CVLLM_GEMV_ACT``: a batch-1 GEMV applies the gated activation to its input."""
    gemv_push: bool = True
    """``CVLLM_GEMV_PUSH``: row-parallel batch-1 GEMVs push their rows to the custom
    all-reduce themselves."""
    ggml_int8_gemv: bool = True
    """``CVLLM_GGML_INT8_GEMV``: batch-1 GGUF products round the activations to int8."""
    ggml_i8_split: bool = True
    """``CVLLM_GGML_I8_SPLIT``: the int8 GEMV may split K over several programs."""
    ggml_q8_x: str = "gated"
    """``CVLLM_GGML_Q8_X`` (``Q8_X_CHOICES``): which int8 GEMV inputs a kernel of their
    own rounds first."""
    ggml_norm_q8: bool = True
    """``CVLLM_GGML_NORM_Q8``: RMSNorms write the int8 form of their batch-1 output."""
    ggml_int8_head: bool = True
    """``CVLLM_GGML_INT8_HEAD``: a GGUF LM head at one row takes the int8 GEMV, its
    largest logits recomputed exactly."""
    allreduce: str = "auto"
    """``CVLLM_ALLREDUCE`` (``ALLREDUCE_CHOICES``): the one-node all-reduce path."""
    hot_poll_s: Optional[float] = None
    """``CVLLM_HOT_POLL_S`` (seconds >= 0): how long a worker polls for the next step
    without sleeping; None: ``distributed/control_plane.HOT_WINDOW_S``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "pdl_early", frozenset(self.pdl_early))
        bad = self.pdl_early - set(PDL_SITES)
        if bad:
            raise ValueError(f"CVLLM_PDL_EARLY names unknown sites {sorted(bad)}; known: "
                             f"{', '.join(PDL_SITES)} (or 0: none)")
        if self.ggml_q8_x not in Q8_X_CHOICES:
            raise ValueError(f"CVLLM_GGML_Q8_X must be gated, all or 0; got {self.ggml_q8_x!r}")
        if self.allreduce not in ALLREDUCE_CHOICES:
            raise ValueError(f"CVLLM_ALLREDUCE={self.allreduce!r}: expected one of "
                             f"{', '.join(ALLREDUCE_CHOICES)}")
        if self.hot_poll_s is not None and not self.hot_poll_s >= 0:  # also NaN
            raise ValueError(f"CVLLM_HOT_POLL_S={self.hot_poll_s!r}: expected seconds >= 0")


_BOOLS = {"pdl": "CVLLM_PDL", "fused_merge": "CVLLM_FUSED_MERGE",
          "gemv_act": "CVLLM_GEMV_ACT", "gemv_push": "CVLLM_GEMV_PUSH",
          "ggml_int8_gemv": "CVLLM_GGML_INT8_GEMV", "ggml_i8_split": "CVLLM_GGML_I8_SPLIT",
          "ggml_norm_q8": "CVLLM_GGML_NORM_Q8", "ggml_int8_head": "CVLLM_GGML_INT8_HEAD"}
"""Field -> variable of the on/off switches."""


def _flag(env: Mapping[str, str], name: str) -> Optional[bool]:
    """An on/off variable: 0 / false / no / off or 1 / true / yes / on (any case); unset
    or empty: None (the default)."""
    text = env.get(name, "").strip().lower()
    if not text:
        return None
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise ValueError(f"{name}={env[name]!r}: expected 0 or 1")


def _sites(text: str) -> frozenset:
    """``CVLLM_PDL_EARLY``'s comma list; 0 (or nothing) names none."""
    return frozenset(t.strip() for t in text.split(",") if t.strip()) - {"0"}


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also NaN
        raise ValueError(f"CVLLM_HOT_POLL_S={text!r}: expected seconds >= 0")
    return value


def from_environ(env: Optional[Mapping[str, str]] = None) -> TuningSettings:
    """The settings ``env`` (default ``os.environ``) asks for; unset variables keep the
    defaults. ValueError naming the variable for a value it cannot take."""
    env = os.environ if env is None else env
    values: dict = {}
    for fname, var in _BOOLS.items():
        flag = _flag(env, var)
        if flag is not None:
            values[fname] = flag
    if "CVLLM_PDL_EARLY" in env:  # set but empty: no site
        values["pdl_early"] = _sites(env["CVLLM_PDL_EARLY"])
    if "CVLLM_GGML_Q8_X" in env:
        values["ggml_q8_x"] = env["CVLLM_GGML_Q8_X"].strip().lower()
    allreduce = env.get("CVLLM_ALLREDUCE", "").strip().lower()
    if allreduce:
        values["allreduce"] = allreduce
    hot = env.get("CVLLM_HOT_POLL_S", "").strip()
    if hot:
        values["hot_poll_s"] = _seconds(hot)
    return TuningSettings(**values)


_CURRENT: Optional[TuningSettings] = None


def current() -> TuningSettings:
    """The process's settings: ``from_environ()`` at the first call, the same object
    after (or what ``configure`` put in place)."""
    settings = _CURRENT
    if settings is None:
        settings = _load()
    return settings


def _load() -> TuningSettings:
    global _CURRENT
    _CURRENT = from_environ()
    return _CURRENT


@contextlib.contextmanager
def configure(settings: Optional[TuningSettings] = None, **changes) -> Iterator[TuningSettings]:
    """Within: ``current()`` is ``settings`` (default: the current ones) with ``changes``
    (field names of ``TuningSettings``) applied; the previous settings after. For tests
    and tools; the engine itself only reads the environment."""
    global _CURRENT
    before = _CURRENT
    new = dataclasses.replace(settings or current(), **changes)
    _CURRENT = new
    try:
        yield new
    finally:
        _CURRENT = before
