"""Weight loading for models with ``FusedMoE`` layers (Qwen2/3-MoE, DeepSeek, Qwen3-Next).

``ExpertWeights``: made by a MoE model's ``load_weights`` (``models/base.py``,
``has_experts``), one per load, for ``models/utils.load_weights_with_mapping`` on every
rank. Expert tensors arrive in one of three layouts and all go through the ``FusedMoE``
parameter's own loaders (which cut this rank's slice):

- per expert, as Hub checkpoints and transformers' ``save_pretrained`` store them:
  ``...mlp.experts.{e}.gate_proj|up_proj|down_proj.weight`` -> ``weight_loader``;
- all experts in one tensor: transformers' fused ``...experts.gate_up_proj [E, 2I, H]`` /
  ``...experts.down_proj [E, H, I]`` (Qwen3.5-MoE checkpoints), or the GGUF loader's
  ``...experts.gate_proj|up_proj|down_proj.weight`` from llama.cpp's stacked
  ``ffn_*_exps`` -> ``load_stacked``.

Every other tensor loads as in a dense model.
"""

from __future__ import annotations

from typing import Dict, List, Set, Tuple

import torch
from torch import nn

from cvllm.layers.moe import parse_expert_weight_name
from cvllm.models.utils import StackedParamsMapping, WeightLoadError, missing_names
from cvllm.quantization.packed import weight_view

_SHARD_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class ExpertWeights:
    """The expert tensors of one load: loaded through their ``FusedMoE`` parameter, and
    which (expert, shard) pairs each parameter still lacks."""

    def __init__(self):
        # FusedMoE param name -> the (expert_id, shard_id) pairs loaded so far
        self.parts: Dict[str, Set[Tuple[int, str]]] = {}

    def load(self, params: Dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> bool:
        parsed = parse_expert_weight_name(name)
        if parsed is None or parsed[0] not in params:
            return False
        pname, expert_id, shard = parsed
        param = params[pname]
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
        self.parts.setdefault(pname, set()).update((e, s) for e in experts for s in shards)
        return True

    def missing(self, params: Dict[str, nn.Parameter], seen: Set[str],
                mapping: StackedParamsMapping) -> List[str]:
        """Checkpoint names still needed, spelled per expert for expert params."""
        missing: List[str] = []
        dense: Dict[str, nn.Parameter] = {}
        for pname, param in params.items():
            if not hasattr(param, "load_stacked"):  # not a FusedMoE parameter
                dense[pname] = param
                continue
            prefix = pname.rsplit(".", 1)[0]  # ...mlp.experts
            have = self.parts.get(pname, set())
            shards = ("w2",) if pname.endswith("w2_weight") else ("w1", "w3")
            experts = weight_view(param).shape[0]  # packed: its logical shape
            missing.extend(f"{prefix}.{e}.{_SHARD_PROJ[s]}.weight" for e in range(experts)
                           for s in shards if (e, s) not in have)
        return sorted(missing + missing_names(dense, seen, mapping))
