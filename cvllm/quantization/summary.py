"""What a loaded model holds: tensors and bytes per stored type, and the device total.

Called once by the worker after loading, for the start-up log ("weights: Q4_K 224
tensors 3.9 GiB, Q6_K 33 tensors 0.8 GiB, bf16 65 tensors 0.0 GiB; 4.7 GiB on cuda:0").
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, Tuple

import torch

_DTYPE_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def weight_summary(model: torch.nn.Module) -> Tuple[Dict[str, Tuple[int, int]], int]:
    """``({type name: (tensors, bytes)}, total bytes)`` over the model's parameters and
    its quantization methods' weights (a tied method counted once)."""
    per_type: Dict[str, list] = defaultdict(lambda: [0, 0])
    total, seen = 0, set()
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
        layout = getattr(p, "packed", None)
        if layout is not None:  # a packed parameter (MoE experts): bytes per part type
            for i, (_, t) in enumerate(layout.parts):
                per_type[t.name][0] += 1
                per_type[t.name][1] += layout.part_bytes(i)
            continue
        name = _DTYPE_NAMES.get(p.dtype, str(p.dtype).replace("torch.", ""))
        per_type[name][0] += 1
        per_type[name][1] += p.numel() * p.element_size()
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is None or id(method) in seen:
            continue
        seen.add(id(method))
        for name, tensors, nbytes in method.weight_breakdown():
            per_type[name][0] += tensors
            per_type[name][1] += nbytes
            total += nbytes
    return {k: (v[0], v[1]) for k, v in per_type.items()}, total


def format_summary(per_type: Dict[str, Tuple[int, int]], total: int, device) -> str:
    parts = ", ".join(f"{name} {n} tensors {b / 2**30:.2f} GiB"
                      for name, (n, b) in sorted(per_type.items(), key=lambda kv: -kv[1][1]))
    return f"weights: {parts}; {total / 2**30:.2f} GiB on {device}"
