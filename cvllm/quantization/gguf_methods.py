"""The methods of GGML-typed weights kept in their blocks: linears, token embeddings /
LM heads and fused MoE experts.

Made by the GGUF config (``quantization/gguf.py``: ``get_quant_method``,
``get_embedding_method``, ``get_moe_method``) for each layer that stays quantized, and
owned by that layer. A method owns the layer's packed parameter (``packed.py``: the
file's bytes, sharded by the layer's loader) and, after loading, the backend's prepared
weights (``kernels/quant/backend.py``: Triton on CUDA, the CPU kernels, or the torch
reference), one per run of same-type output rows. The prepared state lives on the method
object, so a tied LM head that shares the embedding's method shares its weights. Batch
copies are granted from the config's ``BatchCopyBudget`` (``batch_copies.py``).
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from cvllm.kernels.quant.backend import GgmlBackend, GgmlWeight, RawWeight, ReferenceBackend
from cvllm.kernels.quant.dispatch import backend_for
from cvllm.kernels.quant.ggml_types import GgmlType, block_shape
from cvllm.quantization.base import (
    EmbeddingMethodBase, LinearMethodBase, MoEMethodBase, act_then, set_weight_attrs,
)
from cvllm.quantization.batch_copies import BatchCopyBudget
from cvllm.quantization.packed import check_input_split, create_packed
from cvllm.utils import tuning


class _Prepared:
    """The backend's weights of one layer: ``(backend, weight, checkpoint parts)`` per run
    of same-type output rows, in row order (usually one run)."""

    def __init__(self, param: torch.nn.Parameter, dtype: torch.dtype,
                 budget: Optional[BatchCopyBudget] = None, exact: bool = False):
        layout = param.packed
        self.rows = layout.rows
        self.groups: List[Tuple[GgmlBackend, GgmlWeight, int]] = []
        for _, _, t, ids in layout.groups():
            parts = [layout.part_tensor(param.data, i) for i in ids]
            raw = parts[0] if len(parts) == 1 else torch.cat(parts, 0)  # [rows, row bytes]
            backend = backend_for(param.device, t, dtype)
            shape = (raw.shape[0], raw.shape[1] // block_shape(t)[1] * block_shape(t)[0])
            copy = budget is not None and budget.take(backend.batch_copy_bytes(t, shape))
            weight = backend.prepare(raw.contiguous(), t, dtype, batch_copy=copy, exact=exact)
            self.groups.append((backend, weight, len(ids)))

    def linear(self, x: torch.Tensor, bias: Optional[torch.Tensor],
               head: bool = False) -> torch.Tensor:
        """``x @ W^T (+ bias)``; ``head``: an LM head's (``GgmlBackend.linear_head``)."""
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # [M, K]: no op when 2-D
        if len(self.groups) == 1:
            backend, w, _ = self.groups[0]
            y = (backend.linear_head if head else backend.linear)(x2, w, bias)  # [M, N]
        else:
            y = torch.cat([b.linear(x2, w) for b, w, _ in self.groups], dim=-1)  # [M, N]
            if bias is not None:
                y = y + bias
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.rows)

    def breakdown(self) -> List[Tuple[str, int, int]]:
        return [(w.ggml_type.name, n, w.nbytes()) for _, w, n in self.groups]


class GGUFLinearMethod(LinearMethodBase):
    """A linear whose output parts are GGML-typed rows (``part_types``, in order)."""

    def __init__(self, part_types: Sequence[GgmlType], prefix: str = "",
                 budget: Optional[BatchCopyBudget] = None):
        self.part_types = [GgmlType(t) for t in part_types]
        self.prefix = prefix
        self.budget = budget
        self.prepared: Optional[_Prepared] = None

    def input_granularity(self) -> int:
        return max(block_shape(t)[0] for t in self.part_types)

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes,
                       input_size, output_size, params_dtype, **extra_weight_attrs) -> None:
        types = self.part_types
        if len(types) == 1 and len(output_partition_sizes) > 1:
            types = types * len(output_partition_sizes)  # a pre-fused checkpoint tensor
        if len(types) != len(output_partition_sizes):
            raise ValueError(f"{self.prefix}: {len(types)} part types for "
                             f"{len(output_partition_sizes)} output parts")
        weight = create_packed((), list(zip(output_partition_sizes, types)),
                               input_size_per_partition, self.prefix)
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0})
        set_weight_attrs(weight, extra_weight_attrs)
        layer.register_parameter("weight", weight)
        self.params_dtype = params_dtype

    def process_weights_after_loading(self, layer) -> None:
        if self.prepared is not None:
            return
        self.prepared = _Prepared(layer.weight, self.params_dtype, self.budget)
        layer.weight = None  # the backend's weights replace the file's bytes

    def apply(self, layer, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.prepared.linear(x, bias)

    def host_linear(self, layer, act_fn: Optional[torch.nn.Module] = None
                    ) -> Callable[[torch.Tensor], torch.Tensor]:
        if len(self.prepared.groups) != 1:
            return super().host_linear(layer, act_fn)
        backend, w, _ = self.prepared.groups[0]
        if act_fn is not None and type(backend).linear_gated is not GgmlBackend.linear_gated:
            return super().host_linear(layer, act_fn)  # apply_fused may fuse: call it
        fn = backend.linear_fn(w, layer.bias)  # the backend's own callable, calls less
        return fn if act_fn is None else act_then(act_fn, fn)

    def apply_fused(self, layer, x: torch.Tensor, bias: Optional[torch.Tensor],
                    act_fn: Optional[torch.nn.Module], sink: Any) -> torch.Tensor:
        """``apply(layer, act_fn(x), bias)``; where the backend's batch-1 kernel applies
        the gated activation itself (``linear_gated``), in one launch. No push to
        ``sink``: the caller's reduction runs as usual."""
        fuse = tuning.current().gemv_act  # CVLLM_GEMV_ACT
        act = getattr(act_fn, "kernel_activation", None) if fuse else None
        if act is not None and len(self.prepared.groups) == 1:
            backend, w, _ = self.prepared.groups[0]
            x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # [M, 2K]
            y = backend.linear_gated(x2, w, act, bias)
            if y is not None:
                return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])
        if act_fn is not None:
            x = act_fn(x)  # [.., I]
        return self.apply(layer, x, bias)

    def weight_breakdown(self) -> List[Tuple[str, int, int]]:
        if self.prepared is None:
            return []
        return self.prepared.breakdown()

    def rounded_input(self) -> int:
        """The int8 input form (words a sub-block) the batch-1 product of the most rows
        reads when its input row carries it (``GgmlBackend.rounded_input``); 0: none
        (and always 0 with ``CVLLM_GGML_NORM_Q8=0``: the RMSNorms then write no int8
        form, ``layers/layernorm.pair_norm_outputs``, and the GEMVs round it themselves)."""
        if self.prepared is None or not tuning.current().ggml_norm_q8:
            return 0
        backend, w, _ = max(self.prepared.groups, key=lambda g: g[1].shape[0])
        return backend.rounded_input(w)


class GGUFEmbeddingMethod(EmbeddingMethodBase):
    """A vocabulary-parallel embedding or LM head of one GGML type.

    When the backend multiplies in a narrower dtype than the model's (the CPU's int4
    kernel takes bf16 activations, with bf16 block scales), the file's bytes are kept
    beside its weights: token lookups dequantize them exactly, and the LM head's
    ``REFINE_TOP`` largest logits per row are recomputed from them in the model dtype, so
    greedy choices and top log-probabilities see the exact head (the rows are few; the
    bytes cost one more copy of this one tensor). The CUDA backend does the same itself at
    one row (``GgmlBackend.linear_head``: the int8 GEMV, its 16 largest logits recomputed
    by the float GEMV on those rows)."""

    REFINE_TOP = 16

    def __init__(self, t: GgmlType, prefix: str = "", budget: Optional[BatchCopyBudget] = None,
                 is_head: bool = False):
        self.t = GgmlType(t)
        self.prefix = prefix
        self.budget = budget
        self.is_head = is_head
        """Whether this method multiplies (an LM head, or an embedding tied to one): only
        then may it keep a batch copy (lookups never use one)."""
        self.prepared: Optional[_Prepared] = None
        self.exact: Optional[RawWeight] = None
        """The file's bytes, kept when the backend is not exact in the model dtype."""

    def create_weights(self, layer, num_rows: int, embedding_dim: int,
                       params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        weight = create_packed((), [(num_rows, self.t)], embedding_dim, self.prefix)
        set_weight_attrs(weight, {"output_dim": 0})
        set_weight_attrs(weight, extra_weight_attrs)
        layer.register_parameter("weight", weight)
        self.params_dtype = params_dtype

    def process_weights_after_loading(self, layer) -> None:
        if self.prepared is None:
            self.prepared = _Prepared(layer.weight, self.params_dtype,
                                      self.budget if self.is_head else None, exact=True)
            backend, _, _ = self.prepared.groups[0]
            if not backend.exact(self.params_dtype):
                raw = layer.weight.packed.part_tensor(layer.weight.data, 0)
                self.exact = ReferenceBackend().prepare(raw.clone(), self.t, self.params_dtype)
        layer.weight = None

    def tie_as_head(self) -> None:
        self.is_head = True

    def embedding(self, layer, ids: torch.Tensor) -> torch.Tensor:
        if self.exact is not None:
            return ReferenceBackend().embedding(self.exact, ids, self.params_dtype)
        backend, w, _ = self.prepared.groups[0]
        return backend.embedding(w, ids, self.params_dtype)  # [T, hidden]

    def apply(self, layer, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        y = self.prepared.linear(x, bias, head=True)  # [.., V_per_partition]
        if self.exact is None:
            return y
        return self._refine(x, y, bias)

    def _refine(self, x: torch.Tensor, y: torch.Tensor,
                bias: Optional[torch.Tensor]) -> torch.Tensor:
        """``y`` with each row's ``REFINE_TOP`` largest entries recomputed exactly."""
        from cvllm.kernels.quant.reference import dequantize

        x2, y2 = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])  # [M, K], [M, V]
        top = y2.topk(min(self.REFINE_TOP, y2.shape[-1]), dim=-1).indices  # [M, R]
        rows = dequantize(self.exact.raw[top.reshape(-1)], self.t, x.dtype)  # [M*R, K]
        exact = torch.bmm(rows.view(*top.shape, -1), x2.unsqueeze(-1)).squeeze(-1)  # [M, R]
        if bias is not None:
            exact = exact + bias[top]
        return y2.scatter_(-1, top, exact.to(y2.dtype)).view(y.shape)  # y: the head's own

    def weight_breakdown(self) -> List[Tuple[str, int, int]]:
        if self.prepared is None:
            return []
        (name, n, nbytes), = self.prepared.breakdown()
        return [(name, n, nbytes + (self.exact.nbytes() if self.exact is not None else 0))]


class GGUFMoEMethod(MoEMethodBase):
    """Fused MoE experts in GGML types: gate and up (``w13``) and down (``w2``)."""

    graph_safe = False  # the expert loop reads the per-expert token counts on the host

    def __init__(self, w13_types: Sequence[GgmlType], w2_type: GgmlType, prefix: str = ""):
        self.w13_types = [GgmlType(t) for t in w13_types]
        self.w2_type = GgmlType(w2_type)
        self.prefix = prefix

    def create_weights(self, layer, num_experts: int, hidden_size: int, inter_per_partition: int,
                       params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        check_input_split(f"{self.prefix}.down_proj", layer.intermediate_size,
                          layer.intermediate_size // inter_per_partition, inter_per_partition,
                          block_shape(self.w2_type)[0])
        inter = inter_per_partition
        layer.w13_weight = create_packed((num_experts,), [(inter, t) for t in self.w13_types],
                                         hidden_size, f"{self.prefix}.w13")  # [E, 2I/tp, H]
        layer.w2_weight = create_packed((num_experts,), [(hidden_size, self.w2_type)], inter,
                                        f"{self.prefix}.w2")  # [E, H, I/tp]
        for p in (layer.w13_weight, layer.w2_weight):
            set_weight_attrs(p, extra_weight_attrs)
        self.params_dtype = params_dtype

    def _expert(self, param: torch.nn.Parameter, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert ``e``'s weight ``[out, in]`` dequantized (each part in its own type)."""
        from cvllm.kernels.quant.reference import dequantize

        layout = param.packed
        return torch.cat([dequantize(layout.part_tensor(param.data, i)[e], t, dtype)
                          for i, (_, t) in enumerate(layout.parts)], 0)

    def apply(self, layer, hidden: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str) -> torch.Tensor:
        """``hidden [T, H]`` -> ``[T, H]``: the experts that received tokens, one at a time,
        each dequantized for its matmul (the reference path; a fused quantized MoE kernel is
        not written yet)."""
        from cvllm.kernels.reference.fused_moe import moe_act_and_mul, sort_tokens_by_expert

        T, K = topk_ids.shape
        order, counts = sort_tokens_by_expert(topk_ids, layer.num_experts)
        out = torch.zeros(T * K, hidden.shape[1], dtype=torch.float32, device=hidden.device)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                rows = order[start:start + n]  # [n] flat (token, slot) pairs
                x = hidden[rows // K]  # [n, H]
                h = moe_act_and_mul(F.linear(x, self._expert(layer.w13_weight, e, x.dtype)),
                                    activation)  # [n, I]
                out[rows] = F.linear(h, self._expert(layer.w2_weight, e, x.dtype)).float()
                start += n
        out = out.view(T, K, -1) * topk_weights.unsqueeze(-1).float()  # [T, K, H]
        return out.sum(1).to(hidden.dtype)
