"""Attention backend selection: a backend's name -> its one stateless instance.

Called by each attention layer (``layers/attention.py``) at construction, with the name
the model constructor hands it from ``ModelConfig.attention_backend``. In the engine that
name is always resolved (``EngineConfig`` sets it from ``--attention-backend`` and the
device, ``config.resolve_attention_backend``): the Triton kernels
(``backends/triton_backend.py``) on CUDA, the plain torch reference
(``backends/torch_ref.py``) on the CPU. ``auto`` remains for models built by hand (tests,
tools): it follows torch's default device at construction, the one a
``with torch.device(...)`` block sets. MLA layers (``layers/mla.py``) hold their own
backend (``interface.MLABackend``).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from cvllm.attention.interface import AttentionBackend
from cvllm.config import resolve_attention_backend

BACKEND_NAMES = ("torch_ref", "triton")


@functools.lru_cache(maxsize=None)
def _instance(key: str) -> AttentionBackend:
    if key == "torch_ref":
        from cvllm.attention.backends.torch_ref import TorchRefAttentionBackend

        return TorchRefAttentionBackend()
    # Imported lazily: Triton is only needed where it is selected.
    from cvllm.attention.backends.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()


def get_attn_backend(name: str = "auto",
                     device: Optional[torch.device | str] = None) -> AttentionBackend:
    """The backend called ``name``; ``auto``: the default for ``device`` (by default
    torch's current default device)."""
    if name == "auto":
        dev = torch.device(device) if device is not None else torch.get_default_device()
        name = resolve_attention_backend(name, dev.type)
    if name not in BACKEND_NAMES:
        raise ValueError(
            f"unknown attention backend {name!r}; known: {', '.join(BACKEND_NAMES)}"
        )
    return _instance(name)
