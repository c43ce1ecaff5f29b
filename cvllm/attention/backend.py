"""Attention backend selection.

Called by each attention layer (``attention/layer.py``) at construction. Only the plain
torch reference exists for now (CPU and CUDA); the Triton backend will be chosen here for
CUDA once ``kernels/`` has it.
"""

from __future__ import annotations

from typing import Optional

from cvllm.attention.backends.torch_ref import TorchRefAttentionBackend

_BACKENDS = {"torch_ref": TorchRefAttentionBackend}


def get_attn_backend(name: Optional[str] = None) -> type:
    """The backend class called ``name``, or the default one for this build."""
    key = name or "torch_ref"
    if key not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {key!r}; known: {', '.join(sorted(_BACKENDS))}"
        )
    return _BACKENDS[key]
