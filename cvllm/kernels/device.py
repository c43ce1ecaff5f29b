"""What the kernels' launch plans ask of the GPU they run on, asked once per device.

Used by the wrappers that size their grids to the SMs (``gemv``, ``paged_attention``,
``quant/ggml_cuda``) or pick a plan by architecture. The SM counts and capabilities are
cached per device index for the process (a device does not change under it); nothing
else is kept. Torch only, so the CPU planning code can import it without Triton.
"""

from __future__ import annotations

import functools
import os
from typing import Tuple

import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Whether Triton's interpreter runs the kernels (the CPU tests): fixed before Triton
compiles anything, so read once."""


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    """The streaming multiprocessors of CUDA device ``device_index``."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sms_of(x: torch.Tensor) -> int:
    """``num_sms`` of ``x``'s GPU; 1 off the GPU (the interpreter's plans)."""
    return num_sms(x.device.index or 0) if x.is_cuda else 1


@functools.lru_cache(maxsize=None)
def capability(device_index: int) -> Tuple[int, int]:
    """The compute capability ``(major, minor)`` of CUDA device ``device_index``."""
    return torch.cuda.get_device_capability(device_index)
