"""Which ``backend.GgmlBackend`` a GGUF weight gets: the fastest on its device that takes
its type with the model's activation dtype.

Called by the GGUF quantization method (``quantization/gguf_methods.py``) once per run of
same-type rows after loading. The device kernels are imported only when a weight of
their device asks (the CPU path never imports Triton). Stateless: a backend is built per
call.
"""

from __future__ import annotations

import torch

from cvllm.kernels.quant.backend import DequantizedBackend, GgmlBackend, ReferenceBackend
from cvllm.kernels.quant.ggml_types import GgmlType


def backend_for(device: torch.device, t: GgmlType, dtype: torch.dtype) -> GgmlBackend:
    """The fastest backend on ``device`` that takes ``t`` with ``dtype`` activations."""
    candidates: list = []
    if device.type == "cuda":
        from cvllm.kernels.quant.cuda_backend import CudaBackend

        candidates += [CudaBackend(), DequantizedBackend()]
    elif device.type == "cpu":
        from cvllm.kernels.quant.ggml_cpu import CpuBackend

        candidates += [CpuBackend(), DequantizedBackend()]
    for backend in candidates:
        if backend.supports(t, dtype):
            return backend
    return ReferenceBackend()
