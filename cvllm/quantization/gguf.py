"""GGML-typed weights kept in their blocks: the config, from a GGUF file's tensor types or
from ``--isq``; the methods it hands each layer are ``quantization/gguf_methods.py``'s.

The config is chosen by the loader on every rank (``loader/quant_scheme.py``) while the
engine config is built, before the model exists, and reaches the model constructor as
``EngineConfig.quant``; each layer asks it for its method, which owns the layer's packed
parameter and its backend's prepared weights.

Which type each layer gets:
- ``gguf``: each checkpoint tensor's type in the file. A fused layer (qkv, gate_up)
  takes its parts' types in order (the model's ``stacked_params_mapping`` names them);
  parts may differ (Q4_K_M keeps some v / down in Q6_K). Layers whose tensors are float
  stay unquantized; a type without kernels was dequantized by the loader (one warning).
- ``isq``: every linear and MoE expert at the ``--isq`` type, the token embedding too; the
  LM head at Q6_K (Q8_0 for ``q8_0``) as llama.cpp keeps ``output.weight``. A row length
  that is not whole blocks of the type takes llama.cpp's fallback (Q4_K -> Q5_0, ...).

The config also holds the model's budget for batch copies (``quantization/batch_copies.py``,
``--cpu-dense-gb``), made when the model's first layer asks for its method.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from cvllm.kernels.quant.ggml_types import (
    FLOAT_TYPES, QUANTIZED_TYPES, GgmlType, block_shape, parse_isq,
)
from cvllm.quantization.base import (
    EmbeddingMethodBase, LinearMethodBase, MoEMethodBase, QuantizationConfig,
)
from cvllm.quantization.batch_copies import BatchCopyBudget, batch_copy_budget
from cvllm.quantization.gguf_methods import GGUFEmbeddingMethod, GGUFLinearMethod, GGUFMoEMethod

logger = logging.getLogger("cvllm.quantization")

KEPT_TYPES = QUANTIZED_TYPES | FLOAT_TYPES
"""Types a packed weight may hold (float parts of a quantized fused layer included)."""

_FALLBACK = {GgmlType.Q2_K: GgmlType.Q4_0, GgmlType.Q3_K: GgmlType.Q4_0,
             GgmlType.Q4_K: GgmlType.Q5_0, GgmlType.Q5_K: GgmlType.Q5_1,
             GgmlType.Q6_K: GgmlType.Q8_0}
"""llama.cpp's choice for rows that are not whole 256-blocks."""
_SHARD_ORDER = {"q": 0, "k": 1, "v": 2}


def _kept(types: List[Optional[GgmlType]]) -> Optional[List[GgmlType]]:
    """``types`` when a layer made of tensors of these types stays quantized: every one has
    kernels (or is float) and at least one is quantized; else None (a float layer)."""
    if all(t in KEPT_TYPES for t in types) and not all(t in FLOAT_TYPES for t in types):
        return types
    return None


class GGUFQuantConfig(QuantizationConfig):
    """Per-layer GGML types, from a GGUF file's tensor types or from ``--isq``."""

    def __init__(self, tensor_types: Optional[Dict[str, int]] = None,
                 isq: Optional[str] = None,
                 stacked_params_mapping: Sequence[Tuple[str, str, object]] = (),
                 cpu_dense_gib: Optional[float] = 0.0):
        if (tensor_types is None) == (isq is None):
            raise ValueError("give the GGUF tensor types or an --isq type, not both")
        self.tensor_types = {k: GgmlType(v) for k, v in (tensor_types or {}).items()}
        self.isq = parse_isq(isq) if isq is not None else None
        self.mapping = list(stacked_params_mapping)
        self.cpu_dense_gib = cpu_dense_gib
        """``--cpu-dense-gb`` (None: auto, ``batch_copy_budget``)."""
        self._budget: Optional[BatchCopyBudget] = None

    @property
    def budget(self) -> BatchCopyBudget:
        """The batch copies' budget of the model built from this config, made when its
        first layer asks (auto: a quarter of the memory available then)."""
        if self._budget is None:
            self._budget = BatchCopyBudget(batch_copy_budget(self.cpu_dense_gib))
        return self._budget

    def loaded_note(self) -> str:
        return self._budget.note() if self._budget is not None else ""

    def get_name(self) -> str:
        return "gguf" if self.isq is None else f"isq:{self.isq.name}"

    def part_types(self, prefix: str, cols: int, head: bool = False) -> Optional[List[GgmlType]]:
        """The types of the checkpoint tensors behind a layer, in output order (one for an
        unfused layer or a pre-fused tensor); None when it stays unquantized."""
        if self.isq is not None:
            t = self.isq
            if head:
                t = GgmlType.Q8_0 if self.isq == GgmlType.Q8_0 else GgmlType.Q6_K
            while cols % block_shape(t)[0] and t in _FALLBACK:
                t = _FALLBACK[t]
            return [t] if cols % block_shape(t)[0] == 0 else None
        name = f"{prefix}.weight"
        if name in self.tensor_types:
            types = [self.tensor_types[name]]
        else:
            parts = [(sid, name.replace(p, c)) for p, c, sid in self.mapping if p in name]
            if not parts or not all(isinstance(s, int) or s in _SHARD_ORDER for s, _ in parts):
                return None
            parts.sort(key=lambda sp: sp[0] if isinstance(sp[0], int) else _SHARD_ORDER[sp[0]])
            if any(n not in self.tensor_types for _, n in parts):
                return None
            types = [self.tensor_types[n] for _, n in parts]
        return _kept(types)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> Optional[LinearMethodBase]:
        types = self.part_types(prefix, layer.input_size)
        return GGUFLinearMethod(types, prefix, self.budget) if types else None

    def get_embedding_method(self, layer: torch.nn.Module, prefix: str,
                             is_lm_head: bool) -> Optional[EmbeddingMethodBase]:
        types = self.part_types(prefix, layer.embedding_dim, head=is_lm_head)
        if not types or len(types) != 1:
            return None
        return GGUFEmbeddingMethod(types[0], prefix, self.budget, is_lm_head)

    def get_moe_method(self, layer: torch.nn.Module, prefix: str) -> Optional[MoEMethodBase]:
        if self.isq is not None:
            t13 = self.part_types(prefix, layer.hidden_size)
            t2 = self.part_types(prefix, layer.intermediate_size)
            if not t13 or not t2:
                return None
            return GGUFMoEMethod([t13[0], t13[0]], t2[0], prefix)
        names = [f"{prefix}.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
        types = _kept([self.tensor_types.get(n) for n in names])
        return GGUFMoEMethod(types[:2], types[2], prefix) if types else None
