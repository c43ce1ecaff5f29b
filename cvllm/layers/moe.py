"""Mixture-of-experts: routing (``select_experts``), the fused expert computation
(``fused_experts``) and the ``FusedMoE`` layer that owns the experts' weights.

Built by the MoE model classes (Qwen2/3-MoE, DeepSeek V2/V3, Qwen3-Next/3.5) once per
sparse decoder layer, on every rank. The model computes the router logits (a replicated
linear), calls ``select_experts`` with the settings its config names, and hands the
routing to ``FusedMoE.forward``. ``FusedMoE`` holds this rank's slice of every expert:
``w13_weight [E, 2I/tp, H]`` (gate rows then up rows) and ``w2_weight [E, H, I/tp]``; its
``weight_loader`` cuts the slice out of each checkpoint tensor (DESIGN rule 6), and its
forward ends with the TP all-reduce, like ``RowParallelLinear``.

The experts' storage and math belong to a ``MoEMethodBase`` from the quantization config
(``quantization/``): plain weights take one path, tokens sorted by expert and one grouped
matmul per expert over only the tokens routed to it (the Triton kernel
``kernels/fused_moe.py`` on CUDA, its torch reference elsewhere); GGUF experts keep their
blocks.
"""

from __future__ import annotations

import re
from typing import List, Optional, Tuple

import torch
from torch import nn

from cvllm.distributed import parallel_state
from cvllm.distributed.comm import tensor_model_parallel_all_reduce
from cvllm.kernels.reference.fused_moe import MOE_ACTIVATIONS
from cvllm.layers.utils import copy_checked, divide
from cvllm.quantization.base import MoEMethodBase, QuantizationConfig
from cvllm.quantization.packed import weight_view
from cvllm.quantization.unquantized import UnquantizedMoEMethod

# (param name part, checkpoint name part, expert_id, shard_id); see expert_params_mapping.
ExpertParamsMapping = List[Tuple[str, str, int, str]]
SHARD_IDS = ("w1", "w3", "w2", "w13")


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scoring_func: str = "softmax",
    e_score_correction_bias: Optional[torch.Tensor] = None,
    num_expert_group: Optional[int] = None,
    topk_group: Optional[int] = None,
    routed_scaling_factor: float = 1.0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pick ``top_k`` experts per token from ``router_logits [T, E]``.

    Returns ``topk_weights [T, K]`` float32 and ``topk_ids [T, K]`` int64.

    - Qwen2/3-MoE: ``softmax``, ``renormalize = norm_topk_prob``.
    - DeepSeek V2 ``greedy``: softmax, no groups; ``group_limited_greedy``: softmax with
      ``num_expert_group``/``topk_group`` (a group scores by its best expert).
    - DeepSeek V3 ``noaux_tc``: ``sigmoid`` plus ``e_score_correction_bias`` (a group scores
      by the sum of its two best biased experts); the bias only chooses, the weights are the
      unbiased scores.
    As in vLLM, the group score follows the bias: best expert without one, top-2 sum with
    one. Weights are renormalised (when asked) and then scaled by
    ``routed_scaling_factor``, as transformers' DeepSeek routers do.
    """
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, E], got {tuple(router_logits.shape)}")
    num_experts = router_logits.shape[-1]
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k {top_k} must be in 1..{num_experts}")
    logits = router_logits.to(torch.float32)
    if scoring_func == "softmax":
        scores = logits.softmax(dim=-1)  # [T, E]
    elif scoring_func == "sigmoid":
        scores = logits.sigmoid()  # [T, E]
    else:
        raise ValueError(f"scoring_func must be 'softmax' or 'sigmoid', got {scoring_func!r}")
    choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
    if num_expert_group is not None and num_expert_group > 1:
        choice = _mask_to_top_groups(
            choice, num_expert_group, topk_group, top_k, e_score_correction_bias is not None
        )
    topk_ids = torch.topk(choice, k=top_k, dim=-1)[1]  # [T, K]
    topk_weights = scores.gather(1, topk_ids)  # [T, K]
    if renormalize:
        denominator = topk_weights.sum(dim=-1, keepdim=True)
        if scoring_func == "sigmoid":
            denominator = denominator + 1e-20  # transformers' DeepSeek V3 guard
        topk_weights = topk_weights / denominator
    if routed_scaling_factor != 1.0:
        topk_weights = topk_weights * routed_scaling_factor
    return topk_weights, topk_ids.to(torch.int64)


def _mask_to_top_groups(
    choice: torch.Tensor, num_groups: int, topk_group: Optional[int], top_k: int, use_top2: bool
) -> torch.Tensor:
    """Keep only the experts of each token's ``topk_group`` best groups (others -> -inf)."""
    num_tokens, num_experts = choice.shape
    if topk_group is None or not 0 < topk_group <= num_groups:
        raise ValueError(f"topk_group must be in 1..{num_groups}, got {topk_group!r}")
    if top_k > topk_group * (num_experts // num_groups):
        raise ValueError(f"top_k {top_k} exceeds the {topk_group} kept groups' experts")
    grouped = choice.view(num_tokens, num_groups, divide(num_experts, num_groups))  # [T, G, E/G]
    if use_top2:
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
    else:
        group_scores = grouped.max(dim=-1).values  # [T, G]
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1)[1]  # [T, topk_group]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool)
    group_mask.scatter_(1, group_idx, True)
    score_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
    # Masked experts are never chosen: top_k fits in the kept groups (checked above), so
    # transformers' V2 fill (0.0) and V3 fill (-inf) pick the same experts as this one.
    return choice.masked_fill(~score_mask, float("-inf"))


def expert_params_mapping(num_experts: int) -> ExpertParamsMapping:
    """Per-expert checkpoint names -> ``FusedMoE`` params, for a model's ``load_weights``:
    ``(param part, checkpoint part, expert_id, shard_id)``; a name containing the
    checkpoint part loads into ``name.replace(ckpt part, param part)`` (like the stacked
    params mapping), e.g. ``mlp.experts.3.up_proj.weight`` -> ``mlp.experts.w13_weight``,
    expert 3, ``w3``."""
    mapping: ExpertParamsMapping = []
    for e in range(num_experts):
        for ckpt, param, shard in (("gate_proj", "w13", "w1"), ("up_proj", "w13", "w3"),
                                   ("down_proj", "w2", "w2")):
            mapping.append((f"experts.{param}_weight", f"experts.{e}.{ckpt}.weight", e, shard))
    return mapping


# An expert weight's checkpoint name: one expert (``...experts.3.up_proj.weight``) or all
# experts stacked in one tensor (transformers' fused ``...experts.gate_up_proj`` /
# ``...experts.down_proj``, the GGUF loader's ``...experts.gate_proj.weight`` etc.).
_PER_EXPERT_RE = re.compile(
    r"(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight")
_STACKED_RE = re.compile(
    r"(?P<prefix>.*\.experts)\.(?P<proj>gate_up_proj|gate_proj|up_proj|down_proj)(\.weight)?")
_PROJ_SHARD = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2", "gate_up_proj": "w13"}


def parse_expert_weight_name(name: str) -> Optional[Tuple[str, Optional[int], str]]:
    """``(param name, expert_id or None for a stacked tensor, shard_id)`` of an expert
    weight's checkpoint name, or None when ``name`` is not one. ``param name`` is the
    ``FusedMoE`` parameter (``model.layers.0.mlp.experts.w13_weight``)."""
    m = _PER_EXPERT_RE.fullmatch(name)
    expert: Optional[int] = None
    if m is not None:
        expert = int(m.group("e"))
    else:
        m = _STACKED_RE.fullmatch(name)
        if m is None:
            return None
    shard = _PROJ_SHARD[m.group("proj")]
    return f"{m.group('prefix')}.{'w2' if shard == 'w2' else 'w13'}_weight", expert, shard


def _check_dim(src, dim: int, want: int, shard_id: str) -> None:
    if src.dim() < 2 or src.shape[dim] != want:
        raise ValueError(f"shape mismatch: expert tensor {tuple(src.shape)} for {shard_id!r} needs "
                         f"{want} in dim {dim}")


class FusedMoE(nn.Module):
    """The routed experts of one layer, intermediate dim split over TP ranks."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        params_dtype: Optional[torch.dtype] = None,
        prefix: str = "",
        activation: str = "silu",
        reduce_results: bool = True,
        quant_config: Optional[QuantizationConfig] = None,
    ):
        super().__init__()
        if activation not in MOE_ACTIVATIONS:
            raise ValueError(f"unsupported MoE activation {activation!r}; "
                             f"supported: {', '.join(MOE_ACTIVATIONS)}")
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.activation, self.prefix = activation, prefix
        self.reduce_results = reduce_results
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.intermediate_size_per_partition = divide(intermediate_size, self.tp_size)
        dtype = params_dtype or torch.get_default_dtype()
        method = quant_config.get_moe_method(self, prefix) if quant_config is not None else None
        self.quant_method: MoEMethodBase = method or UnquantizedMoEMethod()
        self.quant_method.create_weights(self, num_experts, hidden_size,
                                         self.intermediate_size_per_partition, dtype,
                                         weight_loader=self.weight_loader,
                                         load_stacked=self.load_stacked)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, expert_id: int, shard_id: str
    ) -> None:
        """Load one expert's full checkpoint tensor: ``w1`` (gate) / ``w3`` (up) ``[I, H]``,
        ``w2`` (down) ``[H, I]``, or ``w13`` (gate and up stacked) ``[2I, H]``."""
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert_id {expert_id} out of range 0..{self.num_experts - 1}")
        self._load_expert(weight_view(param)[expert_id], loaded_weight, shard_id,
                          param is self.w2_weight)

    def load_stacked(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        """Load all experts at once from a tensor ``[E, ...]`` (fused HF or GGUF layout)."""
        if loaded.dim() != 3 or loaded.shape[0] != self.num_experts:
            raise ValueError(f"stacked expert tensor {tuple(loaded.shape)} must be "
                             f"[{self.num_experts}, ., .]")
        self._load_expert(weight_view(param), loaded, shard_id, param is self.w2_weight)

    def _load_expert(
        self, dst: torch.Tensor, src: torch.Tensor, shard_id: str, is_w2: bool
    ) -> None:
        """Copy this rank's slice of ``src`` into ``dst`` (one expert or all, the last two
        dims being ``[out, in]``)."""
        inter, rank = self.intermediate_size_per_partition, self.tp_rank
        if shard_id not in SHARD_IDS or is_w2 != (shard_id == "w2"):
            raise ValueError(f"shard_id {shard_id!r} does not fit "
                             f"{'w2_weight' if is_w2 else 'w13_weight'}")
        # Narrow before copy_checked reads: a lazy tensor reads only this rank's slice.
        full = self.intermediate_size
        if shard_id == "w2":  # down: split the input (intermediate) dim
            _check_dim(src, -1, full, shard_id)
            copy_checked(dst, src.narrow(-1, rank * inter, inter))
        elif shard_id == "w13":
            _check_dim(src, -2, 2 * full, shard_id)
            self._load_expert(dst, src.narrow(-2, 0, full), "w1", False)
            self._load_expert(dst, src.narrow(-2, full, full), "w3", False)
        else:  # gate rows first, then up rows, each this rank's slice of I
            _check_dim(src, -2, full, shard_id)
            offset = 0 if shard_id == "w1" else inter
            copy_checked(dst.narrow(-2, offset, inter), src.narrow(-2, rank * inter, inter))

    def forward(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """``hidden [T, H]`` with routing ``[T, K]`` -> ``[T, H]`` (summed over TP ranks)."""
        out = self.quant_method.apply(
            self, hidden, topk_weights, topk_ids, self.activation
        )  # [T, H] partial sum over this rank's slice of I
        if self.reduce_results and self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
                f"inter={self.intermediate_size}, tp={self.tp_rank}/{self.tp_size}")
