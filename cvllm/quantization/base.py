"""LinearMethod / QuantizationConfig interfaces.

A ``QuantizationConfig`` is built once by the loader from the checkpoint (or None for
plain weights) and handed to the model constructor; each parallel linear asks it for its
``LinearMethod`` (``get_quant_method``). The method creates the layer's parameters,
turns loaded weights into the compute layout, and does the matmul. The layer keeps the
sharding: parameters carry ``output_dim`` / ``input_dim`` attributes telling the layer's
``weight_loader`` which axis to slice; models never see either.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Dict, List, Optional

import torch


def set_weight_attrs(param: torch.Tensor, attrs: Optional[Dict[str, Any]]) -> None:
    """Attach loading metadata (``output_dim``, ``input_dim``, ``weight_loader``) to a param."""
    for key, value in (attrs or {}).items():
        if hasattr(param, key):
            raise AttributeError(f"overwriting existing weight attribute {key!r}")
        setattr(param, key, value)


class LinearMethodBase(ABC):
    """How one linear layer stores its weights and multiplies by them."""

    @abstractmethod
    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: List[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        """Register this rank's parameters on ``layer``. ``output_partition_sizes`` are the
        per-rank widths of the fused outputs (q, k, v or gate, up); ``extra_weight_attrs``
        (``weight_loader``) go onto every parameter."""

    @abstractmethod
    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """``x [.., in_per_partition] -> [.., out_per_partition]``."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Repack loaded weights for compute (called once, after all weights are in)."""


class QuantizationConfig(ABC):
    """A checkpoint's quantization scheme; picks a ``LinearMethod`` per layer."""

    @abstractmethod
    def get_name(self) -> str: ...

    @abstractmethod
    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> Optional[LinearMethodBase]:
        """The method for ``layer`` (named ``prefix`` in the model), or None for plain."""
