"""Attention backend selection.

Called by each attention layer (``layers/attention.py``) at construction, which the
worker runs under ``with torch.device(...)`` (``ModelRunner._load_model``): the default
backend follows that device -- the Triton kernels (``backends/triton_backend.py``) on
CUDA, the plain torch reference (``backends/torch_ref.py``) on the CPU. The worker may
force one by name for the whole model build with ``forced_attn_backend`` (the
``--attention-backend`` flag; tests compare the two on one GPU). MLA layers
(``layers/mla.py``) pick their own backend and are not affected.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional

import torch

BACKEND_NAMES = ("torch_ref", "triton")

_forced = threading.local()


def _load(key: str) -> type:
    if key == "torch_ref":
        from cvllm.attention.backends.torch_ref import TorchRefAttentionBackend

        return TorchRefAttentionBackend
    # Imported lazily: Triton is only needed where it is selected.
    from cvllm.attention.backends.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend


def default_backend_name(device: Optional[torch.device | str] = None) -> str:
    """``triton`` for a CUDA device, ``torch_ref`` otherwise; ``device`` defaults to
    torch's current default device (the one a ``with torch.device(...)`` block sets)."""
    dev = torch.device(device) if device is not None else torch.get_default_device()
    return "triton" if dev.type == "cuda" else "torch_ref"


def get_attn_backend(name: Optional[str] = None,
                     device: Optional[torch.device | str] = None) -> type:
    """The backend class called ``name``; else the forced one (``forced_attn_backend``);
    else the default for ``device`` (see ``default_backend_name``)."""
    key = name or getattr(_forced, "name", None) or default_backend_name(device)
    if key not in BACKEND_NAMES:
        raise ValueError(
            f"unknown attention backend {key!r}; known: {', '.join(BACKEND_NAMES)}"
        )
    return _load(key)


@contextlib.contextmanager
def forced_attn_backend(name: Optional[str]) -> Iterator[None]:
    """Within the block (this thread), ``get_attn_backend()`` returns backend ``name``;
    None or ``auto`` keeps the per-device default."""
    if name in (None, "auto"):
        yield
        return
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(BACKEND_NAMES)}")
    previous = getattr(_forced, "name", None)
    _forced.name = name
    try:
        yield
    finally:
        _forced.name = previous
