"""Weight-loading and dummy-init helpers shared by the model classes.

Called by a model's ``load_weights`` / ``init_dummy_weights`` on every rank; each
parameter's own ``weight_loader`` (set by its layer) cuts this rank's shard.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Protocol, Sequence, Set, Tuple

import torch
from torch import nn

from cvllm.layers.layernorm import RMSNorm
from cvllm.layers.utils import copy_checked, default_weight_loader
from cvllm.quantization.packed import weight_view

# (fused parameter name part, checkpoint name part, shard_id)
StackedParamsMapping = Sequence[Tuple[str, str, object]]


class WeightLoadError(ValueError):
    """Checkpoint tensors do not fit the model (unknown, missing, or mis-shaped); the
    message lists them by their checkpoint (HF) names."""


class ExpertLoader(Protocol):
    """Loads a model's fused expert tensors (``models/moe_utils.ExpertWeights``)."""

    def load(self, params: Dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> bool:
        """Load ``name`` if it is an expert tensor of one of ``params``; whether it was."""

    def missing(self, params: Dict[str, nn.Parameter], seen: Set[str],
                mapping: StackedParamsMapping) -> List[str]:
        """Checkpoint names still needed, sorted (the dense ones as ``missing_names``)."""


def load_weights_with_mapping(
    model: nn.Module,
    weights: Iterable[Tuple[str, torch.Tensor]],
    stacked_params_mapping: StackedParamsMapping,
    ignore_substrings: Sequence[str] = (),
    skip_names: Sequence[str] = (),
    experts: Optional[ExpertLoader] = None,
) -> Set[str]:
    """Load HF-named tensors into ``model``: expert tensors through ``experts`` (MoE
    models), names containing a checkpoint part of ``stacked_params_mapping`` to the fused
    parameter with their ``shard_id``, the rest by name. Raises ``WeightLoadError`` on
    unknown or missing tensors (with ``experts``, the first 20 missing named); returns the
    names loaded. Ends with every layer's ``process_weights_after_loading``."""
    params = dict(model.named_parameters())
    seen: Set[str] = set()
    unknown: List[str] = []
    for name, tensor in weights:
        if name in skip_names or any(s in name for s in ignore_substrings):
            continue
        if not ((experts is not None and experts.load(params, name, tensor))
                or load_mapped(params, name, tensor, stacked_params_mapping)):
            unknown.append(name)
            continue
        seen.add(name)
    if unknown:
        raise WeightLoadError(
            f"checkpoint has {len(unknown)} tensor(s) the model does not know: "
            f"{', '.join(sorted(unknown))}"
        )
    if experts is None:
        missing = shown = missing_names(params, seen, stacked_params_mapping)
    else:
        missing = experts.missing(params, seen, stacked_params_mapping)
        shown = missing[:20]
    if missing:
        more = " ..." if len(shown) < len(missing) else ""
        raise WeightLoadError(
            f"checkpoint lacks {len(missing)} tensor(s) the model needs: {', '.join(shown)}{more}"
        )
    process_weights_after_loading(model)
    return seen


def load_mapped(params: Dict[str, nn.Parameter], name: str, tensor: torch.Tensor,
                mapping: StackedParamsMapping) -> bool:
    """Load checkpoint tensor ``name`` into its parameter (fused ones through
    ``mapping``, with their shard id); False when the model has no such parameter."""
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
        if shard_id is None:
            loader(param, tensor)
        else:
            loader(param, tensor, shard_id)
    except ValueError as e:
        raise WeightLoadError(f"{name}: {e}") from e
    return True


def missing_names(params: Dict[str, nn.Parameter], seen: Set[str],
                  mapping: StackedParamsMapping) -> List[str]:
    """Checkpoint names still needed, sorted: a fused parameter is satisfied by its
    pre-fused name or by all of its parts."""
    missing: List[str] = []
    for pname in params:
        parts = [pname.replace(p, c) for p, c, _ in mapping if p in pname]
        if pname in seen:
            continue
        if parts:
            missing.extend(n for n in parts if n not in seen)
        else:
            missing.append(pname)
    return sorted(missing)


def process_weights_after_loading(model: nn.Module) -> None:
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Random weights for ``--load-format dummy``: norms 1, everything else N(0, std).
    Deterministic per (seed, parameter order), generated on each parameter's device."""
    norm_params = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    for i, (_, param) in enumerate(model.named_parameters()):
        if id(param) in norm_params:
            param.data.fill_(1.0)
            continue
        gen = torch.Generator(device=param.device).manual_seed(seed * 100003 + i)
        dst = weight_view(param)  # a packed weight: random floats, quantized to its types
        values = (
            torch.randn(dst.shape, generator=gen, device=param.device, dtype=torch.float32) * std
        )
        copy_checked(dst, values)
    process_weights_after_loading(model)
