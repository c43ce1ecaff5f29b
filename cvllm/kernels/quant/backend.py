"""The interface between the GGUF quantization methods and the kernels of one device kind.

``quantization/gguf_methods.py``'s methods hand each run of same-type rows of a weight (GGUF's
bytes, ``uint8 [N, K / B * S]``) to ``dispatch.backend_for(device, type)`` once after
loading (``prepare``: the backend may repack into a layout its kernels read fast, freeing
the bytes), then call ``linear`` every step and ``embedding`` for token lookups. The methods
never look for capabilities by name: what a backend offers is this class.

Backends: the Triton kernels on CUDA (``cuda_backend``), the CPU kernels (``ggml_cpu``);
here, ``DequantizedBackend`` (a dequantized copy) for a type or activation dtype those do
not take (Q6_K on the CPU, float32 activations on CUDA) and ``ReferenceBackend`` (the
torch reference, dequantizing per call: the tests' exact oracle). Built per call of
``dispatch.backend_for``, which picks among them (this module imports none of them);
no state outside the weights they prepare.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

from cvllm.kernels.quant.ggml_types import FLOAT_TYPES, QUANTIZED_TYPES, GgmlType


class GgmlWeight(ABC):
    """A weight prepared by a backend (its own layout)."""

    ggml_type: GgmlType
    shape: Tuple[int, int]
    """Logical ``(N, K)``."""

    @abstractmethod
    def nbytes(self) -> int:
        """Device bytes this weight holds."""


class GgmlBackend(ABC):
    """Kernels for GGML-typed weights on one device kind."""

    name: str = ""

    @abstractmethod
    def supports(self, t: GgmlType, dtype: torch.dtype) -> bool:
        """Whether this backend multiplies ``t`` weights with ``dtype`` activations."""

    @abstractmethod
    def prepare(self, raw: torch.Tensor, t: GgmlType, dtype: torch.dtype,
                batch_copy: bool = False, exact: bool = False) -> GgmlWeight:
        """``raw uint8 [N, K / B * S]`` -> this backend's weight (``dtype``: activations).
        ``batch_copy``: the caller grants ``batch_copy_bytes`` more bytes for a float copy
        that multiplies batches faster (backends without one ignore it). ``exact``: the
        products must not round the activations where the backend has a choice (an LM
        head; ``exact()`` says what a backend always does)."""

    def batch_copy_bytes(self, t: GgmlType, shape: Tuple[int, int]) -> int:
        """Bytes of the float copy ``prepare(batch_copy=True)`` would add for an ``(N, K)``
        weight of ``t``; 0 where the backend keeps none."""
        return 0

    @abstractmethod
    def linear(self, x: torch.Tensor, w: GgmlWeight,
               bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x [M, K] -> [M, N]`` in ``x``'s dtype."""

    def linear_fn(self, w: GgmlWeight,
                  bias: Optional[torch.Tensor] = None) -> Callable[[torch.Tensor], torch.Tensor]:
        """``linear(., w, bias)`` as one callable, for a caller that runs it many times
        outside the layer (the CPU's flat decode loop, ``models/flat_decode.py``); a
        backend may bind its common case to fewer ops. Same results as ``linear``."""
        return functools.partial(self.linear, w=w, bias=bias)

    def linear_gated(self, x: torch.Tensor, w: GgmlWeight, act: str,
                     bias: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """``linear(act(gate) * up, w, bias)`` for a gate_up output ``x [M, 2K]``
        (``act``: a key of ``kernels/activation.ACTIVATIONS``) where the backend's kernel
        applies the activation itself, in one launch; None where it does not (the caller
        runs the activation first)."""
        return None

    def linear_head(self, x: torch.Tensor, w: GgmlWeight,
                    bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``linear`` for an LM head prepared with ``exact=True``: each row's largest
        logits as ``linear`` gives them; a backend may round the activations for the rest
        (CUDA at one row: ``ggml_head.head_linear``)."""
        return self.linear(x, w, bias)

    def rounded_input(self, w: GgmlWeight) -> int:
        """Words a 32-element sub-block of the int8 form of one input row that ``linear``
        reads instead of rounding the row itself when the row carries it (the RMSNorm
        before the product writes it: ``kernels/rmsnorm.py``, ``q8_wps``); 0: none."""
        return 0

    @abstractmethod
    def embedding(self, w: GgmlWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids [T]`` of the dequantized weight: ``[T, K]`` in ``dtype``."""

    def exact(self, dtype: torch.dtype) -> bool:
        """Whether ``linear`` with ``dtype`` activations multiplies by the exactly
        dequantized weight, accumulating at least in ``dtype``, for weights prepared with
        ``exact=True``; False for a backend that rounds activations or scales to a
        narrower type even then."""
        return True


@dataclass
class RawWeight(GgmlWeight):
    """GGUF's bytes as they are."""

    raw: torch.Tensor
    """``uint8 [N, K / B * S]``."""
    ggml_type: GgmlType
    shape: Tuple[int, int]

    def nbytes(self) -> int:
        return self.raw.numel()


class ReferenceBackend(GgmlBackend):
    """The torch reference: every call dequantizes the whole weight (correct everywhere,
    slow; the fallback for a type or device without kernels)."""

    name = "torch reference"

    def supports(self, t: GgmlType, dtype: torch.dtype) -> bool:
        return t in QUANTIZED_TYPES or t in FLOAT_TYPES

    def prepare(self, raw: torch.Tensor, t: GgmlType, dtype: torch.dtype,
                batch_copy: bool = False, exact: bool = False) -> RawWeight:
        from cvllm.kernels.quant.ggml_types import block_shape

        elems, nbytes = block_shape(t)
        return RawWeight(raw, t, (raw.shape[0], raw.shape[1] // nbytes * elems))

    def linear(self, x: torch.Tensor, w: GgmlWeight,
               bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        from cvllm.kernels.quant.reference import dequantize

        weight = dequantize(w.raw, w.ggml_type, x.dtype)  # [N, K]
        return torch.nn.functional.linear(x, weight, bias)

    def embedding(self, w: GgmlWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        from cvllm.kernels.quant.reference import dequantize

        return dequantize(w.raw[ids], w.ggml_type, dtype)  # [T, K]


@dataclass
class DequantizedWeight(GgmlWeight):
    """The weight dequantized once to the activation dtype."""

    weight: torch.Tensor
    """``[N, K]``."""
    ggml_type: GgmlType
    shape: Tuple[int, int]

    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class DequantizedBackend(GgmlBackend):
    """Dequantizes at ``prepare`` and multiplies in float: the CPU's path for a type without
    a CPU kernel (the bytes of a float weight, the speed of one)."""

    name = "dequantized"

    def supports(self, t: GgmlType, dtype: torch.dtype) -> bool:
        return t in QUANTIZED_TYPES or t in FLOAT_TYPES

    def prepare(self, raw: torch.Tensor, t: GgmlType, dtype: torch.dtype,
                batch_copy: bool = False, exact: bool = False) -> DequantizedWeight:
        from cvllm.kernels.quant.reference import dequantize

        w = dequantize(raw, t, dtype)  # [N, K]
        return DequantizedWeight(w, t, tuple(w.shape))

    def linear(self, x: torch.Tensor, w: GgmlWeight,
               bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return torch.nn.functional.linear(x, w.weight, bias)

    def embedding(self, w: GgmlWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, w.weight).to(dtype)
