"""LinearMethod / QuantizationConfig interfaces.

A ``QuantizationConfig`` is built once by the loader from the checkpoint (or None for
plain weights) and handed to the model constructor; each parallel linear asks it for its
``LinearMethod`` (``get_quant_method``). The method creates the layer's parameters,
turns loaded weights into the compute layout, and does the matmul. The layer keeps the
sharding: parameters carry ``output_dim`` / ``input_dim`` attributes telling the layer's
``weight_loader`` which axis to slice; models never see either.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch


def act_then(act_fn: torch.nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]
             ) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> fn(act_fn(x))``: a ``host_linear`` whose ``apply_fused`` is the activation
    first, then the plain product (``act_fn``, a module without hooks, by its forward)."""
    act = act_fn.forward
    return lambda x: fn(act(x))


def set_weight_attrs(param: torch.Tensor, attrs: Optional[Dict[str, Any]]) -> None:
    """Attach loading metadata (``output_dim``, ``input_dim``, ``weight_loader``) to a param."""
    for key, value in (attrs or {}).items():
        if hasattr(param, key):
            raise AttributeError(f"overwriting existing weight attribute {key!r}")
        setattr(param, key, value)


def frozen_param(data: torch.Tensor, **attrs: Any) -> torch.nn.Parameter:
    """``data`` as a parameter without grad, carrying the loading metadata ``attrs``
    (``weight_loader``, ``output_dim``, ...): how layers make the parameters they own."""
    param = torch.nn.Parameter(data, requires_grad=False)
    set_weight_attrs(param, attrs)
    return param


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

    def apply_fused(self, layer: torch.nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor],
                    act_fn: Optional[torch.nn.Module], sink: Any) -> torch.Tensor:
        """``apply(layer, act_fn(x), bias)`` (``act_fn``: a gated activation or None). A
        method whose batch-1 kernel can apply the activation itself, or push its rows to
        ``sink`` (a ``CustomAllReduce``: the all-reduce then reads them and expects the
        returned tensor next, ``sink.mark_pushed``), overrides this; by default neither
        happens and the caller's reduction runs as usual."""
        if act_fn is not None:
            x = act_fn(x)  # [.., I]
        return self.apply(layer, x, bias)

    def host_linear(self, layer: torch.nn.Module, act_fn: Optional[torch.nn.Module] = None
                    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """``x -> apply(layer, x, layer.bias)`` (with ``act_fn``: ``apply_fused``'s
        ``apply(layer, act_fn(x), layer.bias)``) as one callable with the weights bound,
        for a caller that runs this layer's math outside its module on one rank (the
        CPU's flat decode loop, ``models/flat_decode.py``); a method overrides it where
        it can call its kernel more directly. Same results as those calls."""
        if act_fn is not None:
            return functools.partial(self.apply_fused, layer, bias=layer.bias, act_fn=act_fn,
                                     sink=None)
        return functools.partial(self.apply, layer, bias=layer.bias)

    def input_granularity(self) -> int:
        """Input features a split of this weight must keep together (a quantization
        block; 1 for plain weights)."""
        return 1

    def rounded_input(self) -> int:
        """Words a 32-element sub-block of the int8 form of one input row that the batch-1
        product reads instead of rounding the row itself, when the row carries that form
        (an RMSNorm's output: ``layers/layernorm.pair_norm_outputs``); 0: it takes none."""
        return 0

    def weight_breakdown(self) -> List[Tuple[str, int, int]]:
        """``(stored type, checkpoint tensors, device bytes)`` of the weights this method
        holds outside the layer's parameters (the start-up log, the benchmarks)."""
        return []

    def weight_nbytes(self) -> int:
        return sum(nbytes for _, _, nbytes in self.weight_breakdown())


class EmbeddingMethodBase(ABC):
    """How a vocabulary-parallel embedding / LM head stores its rows and uses them."""

    @abstractmethod
    def create_weights(self, layer: torch.nn.Module, num_rows: int, embedding_dim: int,
                       params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
        """Register ``layer.weight``: this rank's ``num_rows`` vocabulary rows."""

    @abstractmethod
    def embedding(self, layer: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """``ids [T]`` (local row numbers) -> ``[T, embedding_dim]``."""

    @abstractmethod
    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """LM head: ``x [.., dim] -> [.., num_rows]``."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Called once per layer using this method after loading (a tied LM head calls it
        again on the same method: idempotent)."""

    def tie_as_head(self) -> None:
        """This embedding's method now also multiplies as the LM head (tied embeddings,
        before loading); a method that prepares differently for a head hears it here."""

    def weight_breakdown(self) -> List[Tuple[str, int, int]]:
        return []

    def weight_nbytes(self) -> int:
        return sum(nbytes for _, _, nbytes in self.weight_breakdown())


class MoEMethodBase(ABC):
    """How fused MoE experts store ``w13 [E, 2I/tp, H]`` / ``w2 [E, H, I/tp]`` and compute."""

    graph_safe = True
    """Whether ``apply`` can be captured in a CUDA graph (no host reads of device data)."""

    @abstractmethod
    def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                       inter_per_partition: int, params_dtype: torch.dtype,
                       **extra_weight_attrs: Any) -> None:
        """Register ``layer.w13_weight`` and ``layer.w2_weight``."""

    @abstractmethod
    def apply(self, layer: torch.nn.Module, hidden: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str) -> torch.Tensor:
        """``hidden [T, H]`` with routing ``[T, K]`` -> ``[T, H]`` (this rank's partial sum)."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        pass

    def weight_breakdown(self) -> List[Tuple[str, int, int]]:
        """None: the experts' weights are the layer's parameters."""
        return []

    def weight_nbytes(self) -> int:
        return 0


class QuantizationConfig(ABC):
    """A checkpoint's quantization scheme; picks a ``LinearMethod`` per layer."""

    @abstractmethod
    def get_name(self) -> str: ...

    @abstractmethod
    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> Optional[LinearMethodBase]:
        """The method for ``layer`` (named ``prefix`` in the model), or None for plain."""

    def get_embedding_method(self, layer: torch.nn.Module, prefix: str,
                             is_lm_head: bool) -> Optional["EmbeddingMethodBase"]:
        """The method of a token embedding / LM head, or None for plain rows."""
        return None

    def get_moe_method(self, layer: torch.nn.Module, prefix: str) -> Optional["MoEMethodBase"]:
        """The method of a fused MoE layer's experts, or None for plain weights."""
        return None

    def loaded_note(self) -> str:
        """A line for the start-up log once the weights are loaded (copies the methods
        kept, ...); empty for none."""
        return ""
