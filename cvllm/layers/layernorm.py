"""RMSNorm, computed in float32 like Hugging Face, with an optional fused residual add;
LayerNorm (with or without bias) for the families that use it (Phi, StableLM), and
``PerHeadLayerNorm`` (StableLM's q/k norms: one weight per attention head). ``ScaledNorm``
is the part the RMS norms share (Gemma's and ``gated_deltanet.RMSNormGated`` too).

Built by the model classes; the weight is replicated on every rank (``PerHeadLayerNorm``
holds only this rank's heads, which its weight loader picks). On CUDA the RMSNorms
run the Triton kernel ``kernels/rmsnorm.py`` (same roundings, add and norm in one pass);
elsewhere the torch code below. ``RMSNorm(x, residual, reduce=True)`` first sums a
row-parallel layer's partial ``x`` over the TP group (``distributed/comm.py``), fused with
the add and norm where the custom all-reduce runs.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from cvllm.distributed.comm import all_reduce_rms_norm, tensor_model_parallel_all_reduce
from cvllm.layers.utils import copy_checked, default_weight_loader
from cvllm.quantization.base import LinearMethodBase, frozen_param


def _use_triton(x: torch.Tensor, weight: torch.Tensor, residual: Optional[torch.Tensor]) -> bool:
    """The Triton RMSNorm serves CUDA tensors sharing the weight's dtype (what models
    pass); anything else keeps the torch path, whose dtype promotion it does not copy."""
    return (x.is_cuda and x.dtype == weight.dtype and x.shape[-1] <= 65536
            and (residual is None or residual.dtype == x.dtype))


def _rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's ``weight * (xf * rsqrt(mean(xf^2) + eps)).to(dtype)``, xf = float32 x.
    ``F.rms_norm`` computes the same ops in the same order in one call (a third of the
    time of five Python-level ops); the weight goes inside only when nothing would be
    rounded between the norm and the multiply (all float32)."""
    shape = (x.shape[-1],)
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, shape, weight, eps)
    return weight * F.rms_norm(x.float(), shape, None, eps).to(x.dtype)


class ScaledNorm(nn.Module):
    """What the RMS norms share: ``variance_epsilon`` and one replicated ``[hidden]``
    weight, made ``weight_fill`` (HF's initial value) and loaded whole."""

    weight_fill = 1.0

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, params_dtype: Optional[torch.dtype] = None
    ):
        super().__init__()
        self.variance_epsilon = eps
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = frozen_param(  # [hidden]
            torch.full((hidden_size,), self.weight_fill, dtype=dtype),
            weight_loader=default_weight_loader)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}"


class RMSNorm(ScaledNorm):
    def __init__(
        self, hidden_size: int, eps: float = 1e-6, params_dtype: Optional[torch.dtype] = None
    ):
        super().__init__(hidden_size, eps, params_dtype)
        self.q8_wps = 0
        """4 or 8: a batch-1 output also carries its int8 form for the GGUF GEMV that
        reads it next (``pair_norm_outputs`` sets it; 0: never)."""
        self.pdl_site = "norm"
        """Which of ``kernels/pdl.SITES`` this norm's kernel is: ``qkv`` / ``mlp`` where
        ``pair_norm_outputs`` found the linear it feeds, else ``norm``."""

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, reduce: bool = False
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """``norm(x)``, or with ``residual``: ``(norm(x + residual), x + residual)``.
        The add is in the model dtype, as in HF's decoder layers. ``reduce``: ``x`` is
        this rank's partial sum of a row-parallel layer (``reduce_results=False``),
        summed over the TP group first; with a residual, in one kernel where
        ``comm.all_reduce_rms_norm`` takes it (that kernel writes the new residual into
        ``residual``; callers use the returned one either way)."""
        if reduce:
            if residual is not None:
                fused = all_reduce_rms_norm(x, residual, self.weight, self.variance_epsilon)
                if fused is not None:
                    return fused
            x = tensor_model_parallel_all_reduce(x)
        if _use_triton(x, self.weight, residual):
            from cvllm.kernels.rmsnorm import rms_norm

            return rms_norm(x, self.weight, self.variance_epsilon, residual,
                            q8_wps=self.q8_wps, site=self.pdl_site)
        if residual is not None:
            x = x + residual
            residual = x
        out = _rms_norm_cpu(x, self.weight, self.variance_epsilon)  # [..., hidden]
        return out if residual is None else (out, residual)

    def host_fn(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """``forward(x)`` off CUDA (no residual, no reduction) as one callable, for a
        flat loop over the layers (``models/flat_decode.py``)."""
        return functools.partial(_rms_norm_cpu, weight=self.weight, eps=self.variance_epsilon)


class LayerNorm(nn.Module):
    """``nn.LayerNorm`` over the last dim, computed in float32 and cast back, so bf16 runs
    round once, like RMSNorm here. ``bias=False`` for the bias-free variants."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        params_dtype: Optional[torch.dtype] = None,
        bias: bool = True,
    ):
        super().__init__()
        self.eps = eps
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = frozen_param(torch.ones(hidden_size, dtype=dtype),
                                   weight_loader=default_weight_loader)
        if bias:
            self.bias = frozen_param(torch.zeros(hidden_size, dtype=dtype),
                                     weight_loader=default_weight_loader)
        else:
            self.register_parameter("bias", None)

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, reduce: bool = False
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """``norm(x)``, or with ``residual``: ``(norm(x + residual), x + residual)`` (the
        RMSNorm contract, so the shared decoder layers take any norm); ``reduce``: ``x``
        is a partial sum, summed over the TP group first."""
        if reduce:
            x = tensor_model_parallel_all_reduce(x)
        if residual is not None:
            x = x + residual
            residual = x
        bias = None if self.bias is None else self.bias.float()
        out = F.layer_norm(x.float(), self.weight.shape, self.weight.float(), bias, self.eps)
        out = out.to(x.dtype)
        return out if residual is None else (out, residual)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Identity affine (weight 1, bias 0), e.g. after dummy random weights."""
        self.weight.fill_(1.0)
        if self.bias is not None:
            self.bias.zero_()

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, bias={self.bias is not None}"


class GemmaRMSNorm(ScaledNorm):
    """Gemma's RMSNorm: the weight is an offset, ``out = norm(x) * (1 + weight)``, all in
    float32 and cast back once, as HF's ``Gemma2RMSNorm`` / ``Gemma3RMSNorm`` do (plain
    RMSNorm casts before multiplying). Its own class, not an RMSNorm subclass, so code that
    special-cases RMSNorm (dummy init to 1, fused kernels) never treats it as one.
    Same ``forward(x, residual)`` contract as RMSNorm."""

    weight_fill = 0.0  # zero offset = identity scale, HF's initial value

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, reduce: bool = False
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """``norm(x)``, or with ``residual``: ``(norm(x + residual), x + residual)``, the
        add in the model dtype; ``reduce``: ``x`` is a partial sum, summed over the TP
        group first."""
        if reduce:
            x = tensor_model_parallel_all_reduce(x)
        if _use_triton(x, self.weight, residual):
            from cvllm.kernels.rmsnorm import rms_norm

            return rms_norm(x, self.weight, self.variance_epsilon, residual, offset=True)
        if residual is not None:
            x = x + residual
            residual = x
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        out = (xf * (1.0 + self.weight.float())).to(x.dtype)
        return out if residual is None else (out, residual)


class PerHeadLayerNorm(nn.Module):
    """A bias-free LayerNorm over head_dim with its own weight per head. ``head_ids``: the
    checkpoint heads (rows of its ``[total_heads, D]`` weight) this rank holds, in local
    order (``QKVParallelLinear``'s query heads or ``kv_head_ids``)."""

    def __init__(self, head_ids: Sequence[int], head_dim: int, eps: float, dtype):
        super().__init__()
        self.head_ids, self.eps = list(head_ids), eps
        self.weight = frozen_param(torch.ones(len(self.head_ids), head_dim, dtype=dtype),
                                   weight_loader=self.weight_loader)  # [H_local, D]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if loaded_weight.dim() != 2 or loaded_weight.shape[0] <= max(self.head_ids):
            raise ValueError(
                f"per-head norm needs [heads, head_dim] with heads > {max(self.head_ids)}, "
                f"got {list(loaded_weight.shape)}"
            )
        for local, head in enumerate(self.head_ids):
            copy_checked(param.data[local : local + 1], loaded_weight.narrow(0, head, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, H_local * D]`` -> same shape, each head normalised with its own weight."""
        T, (H, D) = x.shape[0], self.weight.shape
        xf = F.layer_norm(x.reshape(T, H, D).float(), (D,), eps=self.eps)  # [T, H, D]
        return (xf * self.weight.float()).to(x.dtype).reshape(T, H * D)


_NORM_CONSUMERS = (("input_layernorm", "self_attn.qkv_proj", "qkv"),
                   ("post_attention_layernorm", "mlp.gate_up_proj", "mlp"))
"""(norm, the linear its output feeds, its PDL site) in the decoder layers that name them
so."""


def pair_norm_outputs(model: nn.Module) -> int:
    """Tell each decoder layer's RMSNorm that feeds a linear whose batch-1 product reads
    its input in int8 (its quant method's ``rounded_input``: the GGUF GEMVs on CUDA) to
    write that form with its output (``RMSNorm.q8_wps``): the RMSNorm kernel rounds the
    row once instead of every program of the GEMV (the same bits). Safe where the names
    mislead: the GEMV takes the form only from the very tensor it multiplies, unmodified
    (``kernels/quant/q8form.attached_q8``). Returns how many norms were paired."""
    paired = 0
    for layer in model.modules():
        for norm_name, target, site in _NORM_CONSUMERS:
            norm = layer._modules.get(norm_name)
            if type(norm) is not RMSNorm:
                continue
            try:
                method = layer.get_submodule(target).quant_method
            except AttributeError:  # no such module, or one without a quant method
                continue
            norm.pdl_site = site
            wps = method.rounded_input() if isinstance(method, LinearMethodBase) else 0
            if wps:
                norm.q8_wps = wps
                paired += 1
    return paired
