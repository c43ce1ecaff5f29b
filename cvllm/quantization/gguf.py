"""GGML-typed weights kept in their blocks: the config (GGUF files and ``--isq``) and the
methods of linears, token embeddings / LM heads and fused MoE experts.

The config is chosen by the loader on every rank (``loader/quant_scheme.py``) while the
engine config is built, before the model exists, and reaches the model constructor as
``EngineConfig.quant``; each layer asks it for its method. A method owns the layer's packed parameter (``packed.py``: the
file's bytes, sharded by the layer's loader) and, after loading, the backend's prepared
weights (``kernels/quant/backend.py``: Triton on CUDA, the CPU kernels, or the torch
reference), one per run of same-type output rows. The prepared state lives on the method
object, so a tied LM head that shares the embedding's method shares its weights.

Which type each layer gets:
- ``gguf``: each checkpoint tensor's type in the file. A fused layer (qkv, gate_up)
  takes its parts' types in order (the model's ``stacked_params_mapping`` names them);
  parts may differ (Q4_K_M keeps some v / down in Q6_K). Layers whose tensors are float
  stay unquantized; a type without kernels was dequantized by the loader (one warning).
- ``isq``: every linear and MoE expert at the ``--isq`` type, the token embedding too; the
  LM head at Q6_K (Q8_0 for ``q8_0``) as llama.cpp keeps ``output.weight``. A row length
  that is not whole blocks of the type takes llama.cpp's fallback (Q4_K -> Q5_0, ...).

Batch copies (``BatchCopyBudget``, ``--cpu-dense-gb``): a backend may keep a float copy
beside a weight's blocks that multiplies batches faster (the CPU's bf16 copy for decode
batches of a few rows and up, where the CPU has AMX or AVX-512 BF16). The copies are granted in loading
order until the budget runs out; the rest of the weights multiply every batch from their
blocks. The budget is made when the model's first layer asks for its method (one model
per config: each rank builds its own engine config).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from cvllm.kernels.quant.backend import GgmlBackend, GgmlWeight, RawWeight, ReferenceBackend
from cvllm.kernels.quant.dispatch import backend_for
from cvllm.kernels.quant.ggml_types import (
    FLOAT_TYPES, QUANTIZED_TYPES, GgmlType, block_shape, parse_isq,
)
from cvllm.quantization.base import (
    EmbeddingMethodBase, LinearMethodBase, MoEMethodBase, QuantizationConfig, act_then,
    set_weight_attrs,
)
from cvllm.quantization.packed import check_input_split, create_packed
from cvllm.utils import tuning

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


class BatchCopyBudget:
    """Bytes the backends may spend on float copies for batched calls, granted first come
    first served (one budget per rank)."""

    def __init__(self, nbytes: int):
        self.left = max(0, int(nbytes))
        self.granted = [0, 0]  # weights, bytes
        self.refused = [0, 0]

    def take(self, nbytes: int) -> bool:
        """Whether a copy of ``nbytes`` fits (and is then counted as kept)."""
        if nbytes <= 0:
            return False
        if nbytes > self.left:
            self.refused[0] += 1
            self.refused[1] += nbytes
            return False
        self.left -= nbytes
        self.granted[0] += 1
        self.granted[1] += nbytes
        return True

    def note(self) -> str:
        if not self.granted[0] and not self.refused[0]:
            return ""
        line = (f"batch copies: {self.granted[0]} weights kept a bf16 copy for decode "
                f"batches ({self.granted[1] / 2**20:.0f} MiB, counted above)")
        if self.refused[0]:
            line += (f"; {self.refused[0]} did not fit the budget "
                     f"({self.refused[1] / 2**20:.0f} MiB more; raise --cpu-dense-gb)")
        return line


def batch_copy_budget(setting_gib: Optional[float]) -> int:
    """``--cpu-dense-gb`` in bytes; None (auto): a quarter of the memory available now where
    the copies pay (``ggml_cpu.batch_copy_pays``: AMX or AVX-512 BF16), else none."""
    if setting_gib is not None:
        return int(setting_gib * 2**30)
    from cvllm.kernels.quant.ggml_cpu import batch_copy_pays

    if not batch_copy_pays():
        return 0
    import psutil

    return psutil.virtual_memory().available // 4


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

