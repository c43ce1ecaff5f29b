"""Weight loading for models with ``FusedMoE`` layers (Qwen2/3-MoE, DeepSeek, Qwen3-Next).

Called by a MoE model's ``load_weights`` on every rank. Expert tensors arrive in one of
three layouts and all go through the ``FusedMoE`` parameter's own loaders (which cut this
rank's slice):

- per expert, as Hub checkpoints and transformers' ``save_pretrained`` store them:
  ``...mlp.experts.{e}.gate_proj|up_proj|down_proj.weight`` -> ``weight_loader``;
- all experts in one tensor: transformers' fused ``...experts.gate_up_proj [E, 2I, H]`` /
  ``...experts.down_proj [E, H, I]`` (Qwen3.5-MoE checkpoints), or the GGUF loader's
  ``...experts.gate_proj|up_proj|down_proj.weight`` from llama.cpp's stacked
  ``ffn_*_exps`` -> ``load_stacked``.

Every other tensor loads as in ``models/utils.load_weights_with_mapping``.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Sequence, Set, Tuple

import torch
from torch import nn

from cvllm.quantization.packed import weight_view
from cvllm.layers.moe import parse_expert_weight_name
from cvllm.layers.utils import default_weight_loader
from cvllm.models.utils import StackedParamsMapping, WeightLoadError, process_weights_after_loading

_SHARD_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def load_moe_model_weights(
    model: nn.Module,
    weights: Iterable[Tuple[str, torch.Tensor]],
    stacked_params_mapping: StackedParamsMapping,
    ignore_substrings: Sequence[str] = (),
    skip_names: Sequence[str] = (),
) -> Set[str]:
    """Load HF-named tensors into a model with ``FusedMoE`` layers; raises
    ``WeightLoadError`` on unknown, missing or mis-shaped tensors; returns the names
    loaded. Ends with every layer's ``process_weights_after_loading``."""
    params = dict(model.named_parameters())
    seen: Set[str] = set()
    # FusedMoE param name -> the (expert_id, shard_id) pairs loaded so far
    expert_parts: Dict[str, Set[Tuple[int, str]]] = {}
    unknown: List[str] = []
    for name, tensor in weights:
        if name in skip_names or any(s in name for s in ignore_substrings):
            continue
        expert = parse_expert_weight_name(name)
        if expert is not None and expert[0] in params:
            _load_expert(params[expert[0]], tensor, name, expert, expert_parts)
        elif not _load_dense(params, name, tensor, stacked_params_mapping):
            unknown.append(name)
            continue
        seen.add(name)
    if unknown:
        raise WeightLoadError(f"checkpoint has {len(unknown)} tensor(s) the model does not "
                              f"know: {', '.join(sorted(unknown))}")
    missing = _missing(params, seen, expert_parts, stacked_params_mapping)
    if missing:
        shown = ", ".join(missing[:20]) + (" ..." if len(missing) > 20 else "")
        raise WeightLoadError(f"checkpoint lacks {len(missing)} tensor(s) the model needs: {shown}")
    process_weights_after_loading(model)
    return seen


def _load_expert(param: nn.Parameter, tensor: torch.Tensor, name: str,
                 parsed: Tuple[str, object, str],
                 expert_parts: Dict[str, Set[Tuple[int, str]]]) -> None:
    pname, expert_id, shard = parsed
    shards = ("w1", "w3") if shard == "w13" else (shard,)
    try:
        if expert_id is None:
            param.load_stacked(param, tensor, shard)
            experts = range(weight_view(param).shape[0])  # packed: its logical shape
        else:
            param.weight_loader(param, tensor, expert_id, shard)
            experts = (expert_id,)
    except ValueError as e:
        raise WeightLoadError(f"{name}: {e}") from e
    expert_parts.setdefault(pname, set()).update((e, s) for e in experts for s in shards)


def _load_dense(params: dict, name: str, tensor: torch.Tensor,
                mapping: StackedParamsMapping) -> bool:
    target, shard_id = name, None
    for param_part, ckpt_part, sid in mapping:
        if ckpt_part in name:
            target, shard_id = name.replace(ckpt_part, param_part), sid
            break
    param = params.get(target)
    if param is None:
        return False
    loader = getattr(param, "weight_loader", default_weight_loader)
    try:
        loader(param, tensor) if shard_id is None else loader(param, tensor, shard_id)
    except ValueError as e:
        raise WeightLoadError(f"{name}: {e}") from e
    return True


def _missing(params: dict, seen: Set[str], expert_parts: Dict[str, Set[Tuple[int, str]]],
             mapping: StackedParamsMapping) -> List[str]:
    """Checkpoint names still needed, spelled per expert for expert params."""
    missing: List[str] = []
    for pname, param in params.items():
        if hasattr(param, "load_stacked"):  # a FusedMoE parameter
            prefix = pname.rsplit(".", 1)[0]  # ...mlp.experts
            have = expert_parts.get(pname, set())
            shards = ("w2",) if pname.endswith("w2_weight") else ("w1", "w3")
            experts = weight_view(param).shape[0]  # packed: its logical shape
            missing.extend(f"{prefix}.{e}.{_SHARD_PROJ[s]}.weight" for e in range(experts)
                           for s in shards if (e, s) not in have)
            continue
        if pname in seen:
            continue
        parts = [pname.replace(p, c) for p, c, _ in mapping if p in pname]
        if parts:
            missing.extend(n for n in parts if n not in seen)
        else:
            missing.append(pname)
    return sorted(missing)
