"""``backend.GgmlBackend`` on CUDA: the GGUF linear method's calls routed to
``ggml_cuda`` (weights and launches), ``ggml_head`` (an LM head at one row) and
``ggml_plan`` (what a weight's batch-1 product reads). Built by
``dispatch.backend_for`` for every weight on a CUDA device (bf16 / fp16 activations);
no state of its own."""

from __future__ import annotations

from typing import Optional

import torch

from cvllm.kernels.quant.backend import GgmlBackend
from cvllm.kernels.quant.ggml_cuda import (
    X_DTYPES, CudaGgmlWeight, embedding, gated_fusable, linear, prepare, supports,
)
from cvllm.kernels.quant.ggml_head import head_linear
from cvllm.kernels.quant.ggml_plan import choose_path, is_q6k, sub_words
from cvllm.kernels.quant.ggml_types import GgmlType


class CudaBackend(GgmlBackend):
    """``backend.GgmlBackend`` over ``ggml_cuda`` (bf16 / fp16 activations)."""

    name = "triton"

    def supports(self, t: GgmlType, dtype: torch.dtype) -> bool:
        return supports(t) and dtype in X_DTYPES

    def prepare(self, raw: torch.Tensor, t: GgmlType, dtype: torch.dtype,
                batch_copy: bool = False, exact: bool = False) -> CudaGgmlWeight:
        return prepare(raw, t, exact)  # batched calls decode tiles on the fly: no copy

    def linear(self, x: torch.Tensor, w: CudaGgmlWeight,
               bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return linear(x, w, bias)

    def linear_head(self, x: torch.Tensor, w: CudaGgmlWeight, bias=None) -> torch.Tensor:
        return head_linear(x, w, bias)

    def linear_gated(self, x: torch.Tensor, w: CudaGgmlWeight, act: str,
                     bias: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        return linear(x, w, bias, act=act) if gated_fusable(x, w) else None

    def rounded_input(self, w: CudaGgmlWeight) -> int:
        q6 = is_q6k(w.spec)  # rounds per 16 elements itself: no form made for it
        return sub_words(w.spec) if choose_path(1, w.spec, w.exact) == "gemv_i8" and not q6 else 0

    def embedding(self, w: CudaGgmlWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return embedding(w, ids, dtype)
