"""A pure-decode step of a Llama-shaped decoder as one flat loop: the CPU's counterpart of
a decode CUDA graph.

Built once by the worker (``ModelRunner``: ``build_flat_decoder``) from a loaded model
that qualifies; called instead of the model's forward for CPU steps in which every
sequence decodes one token. Holds no state of its own: the weights, norms, rotation and
attention backend it calls belong to the model's blocks (``models/blocks.py``), bound
here once.

Why: a small model's decode step on the CPU is mostly per-op cost, not arithmetic. The
default model's 30 layers of 576 columns spend about 0.12 ms a layer in the int4 matmuls
and three times that in the module path around them: module calls, the linear -> quant
method -> backend dispatch, per-call checks, about 57 torch ops a layer. This loop calls
the same functions in the same order as the blocks' forwards (each block's ``host_*``
callable: the linears' ``host_linear`` (the down projection's with the gated activation,
as ``GatedMLP`` applies it), ``RMSNorm.host_fn``, ``RotaryEmbedding.host_rotation``
computed once a step, the attention block's own ``qk_maps``, the attention backend's
``forward``), so its outputs are bit-identical to the module path at about two thirds of
the time (``docs/quantization.md``); ``tests/models/test_flat_decode.py`` compares the two
at every decode step for every family that qualifies, and checks which do.

Eligible: a ``DecoderModel`` (no embedding scale) of ``DecoderLayer``s in the sequential
layout (``input_norm`` and ``mlp_norm`` only) whose parts are the shared blocks running
their own code: ``GQAAttention`` without an output gate (its q/k norms, if any, through
``qk_maps``), ``GatedMLP``, RMSNorms, the plain rotation; on one rank (no tensor-parallel reduction inside a layer),
with the torch reference attention backend. Today: Llama, Mistral, Phi-3, Qwen2, Qwen3.
Anything else keeps its forward (``build_flat_decoder`` returns None). A decision made
on the classes' code, so a subclass that overrides one of those methods is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch

from cvllm.attention.interface import AttentionParams
from cvllm.attention.kv_cache import KVCache
from cvllm.attention.metadata import AttentionMetadata
from cvllm.layers.attention import Attention
from cvllm.layers.layernorm import RMSNorm
from cvllm.layers.rotary import RotaryEmbedding
from cvllm.models.base import CausalLMBase
from cvllm.models.blocks import DecoderLayer, DecoderModel, GatedMLP, GQAAttention

Fn = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class _FlatLayer:
    """One decoder layer's callables and sizes."""

    input_norm: Fn
    post_norm: Fn
    qkv: Fn  # [T, hidden] -> [T, (H + 2 Hkv) * D]
    o: Fn  # [T, H * D] -> [T, hidden]
    gate_up: Fn  # [T, hidden] -> [T, 2I]
    act_down: Fn  # [T, 2I] -> [T, hidden]: the gated activation, then down_proj
    attend: Callable  # the attention backend's forward
    heads: int
    kv_heads: int
    head_dim: int
    sliding_window: Optional[int]
    params: AttentionParams  # the attention layer's: scale, window, softcap
    q_map: Optional[Fn] = None  # the attention's qk_maps: [T, heads * D] -> same
    k_map: Optional[Fn] = None


_ROTARY_METHODS = ("forward", "host_rotation", "_rotate_neox_full", "_neox_rows", "_rotate")
"""What ``RotaryEmbedding.forward`` runs on the CPU (a scaling subclass changes only the
cos / sin cache)."""


def build_flat_decoder(model: torch.nn.Module) -> Optional["FlatDecoder"]:
    """A flat decoder of ``model`` (loaded, on the CPU), or None where its code differs
    from what the loop reproduces (the module docstring)."""
    if not isinstance(model, CausalLMBase) or type(model).forward is not CausalLMBase.forward:
        return None
    stack = model.model
    if not isinstance(stack, DecoderModel) or type(stack).forward is not DecoderModel.forward:
        return None
    if not len(stack.layers) or stack.embed_scale is not None or type(stack.norm) is not RMSNorm:
        return None
    if stack.norm.weight.device.type != "cpu" or not all(map(_plain_layer, stack.layers)):
        return None
    rotary = stack.layers[0].attention.rotary_emb
    if not all(layer.attention.rotary_emb is rotary for layer in stack.layers):
        return None
    return FlatDecoder(stack)


def _plain_layer(layer) -> bool:
    """Whether ``layer`` is a ``DecoderLayer`` of plain blocks on one rank (the module
    docstring), whose forward the loop reproduces."""
    if type(layer).forward is not DecoderLayer.forward or layer.defer_reduce:
        return False
    if layer.attn_out_norm is not None or layer.mlp_out_norm is not None:
        return False
    attn, mlp = layer.attention, layer.mlp  # what that forward calls
    if not isinstance(attn, GQAAttention) or type(attn).forward is not GQAAttention.forward:
        return False
    if attn.output_gate or type(attn.attn) is not Attention:
        return False
    if not isinstance(mlp, GatedMLP) or type(mlp).forward is not GatedMLP.forward:
        return False
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    rot = type(attn.rotary_emb)
    return (all(type(n) is RMSNorm for n in (layer.input_norm, layer.mlp_norm))
            and all(lin.tp_size == 1 for lin in linears)
            and all(getattr(rot, m) is getattr(RotaryEmbedding, m) for m in _ROTARY_METHODS)
            and attn.attn.backend.name == "torch_ref")


class FlatDecoder:
    """``__call__(input_ids, positions, attn_metadata, kv_caches)``: the model's forward
    for a pure-decode CPU step (``[T, hidden]``, the last norm applied). Built by
    ``build_flat_decoder``, which checks that ``model`` qualifies."""

    def __init__(self, model: DecoderModel):
        self.embed = model.embed_tokens
        self.final_norm = model.norm.host_fn()
        self.rotary = model.layers[0].attention.rotary_emb
        self.layers: List[_FlatLayer] = [self._bind(layer) for layer in model.layers]

    @staticmethod
    def _bind(layer: DecoderLayer) -> _FlatLayer:
        attn, mlp = layer.attention, layer.mlp
        a = attn.attn
        q_map, k_map = attn.qk_maps()
        return _FlatLayer(
            input_norm=layer.input_norm.host_fn(),
            post_norm=layer.mlp_norm.host_fn(),
            qkv=attn.qkv_proj.quant_method.host_linear(attn.qkv_proj),
            o=attn.o_proj.quant_method.host_linear(attn.o_proj),
            gate_up=mlp.gate_up_proj.quant_method.host_linear(mlp.gate_up_proj),
            act_down=mlp.down_proj.quant_method.host_linear(mlp.down_proj, act_fn=mlp.act_fn),
            attend=a.backend.forward,
            heads=a.num_heads, kv_heads=a.num_kv_heads, head_dim=a.head_size,
            sliding_window=a.sliding_window, params=a.params,
            q_map=q_map, k_map=k_map,
        )

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 attn_metadata: AttentionMetadata, kv_caches: Sequence) -> torch.Tensor:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.layers)} layers")
        hidden = self.embed(input_ids)  # [T, hidden]
        rotate = self.rotary.host_rotation(positions, hidden.dtype)
        residual = None
        for lay, kv_cache in zip(self.layers, kv_caches):
            residual = hidden if residual is None else hidden + residual
            hidden = self._attention(lay, lay.input_norm(residual), rotate, kv_cache,
                                     attn_metadata)
            residual = hidden + residual
            hidden = lay.act_down(lay.gate_up(lay.post_norm(residual)))  # [T, hidden]
        return self.final_norm(hidden + residual)  # [T, hidden]

    @staticmethod
    def _attention(lay: _FlatLayer, x: torch.Tensor, rotate: Fn, kv_cache: KVCache,
                   meta: AttentionMetadata) -> torch.Tensor:
        """``GQAAttention.forward`` of normed rows ``x [T, hidden]``."""
        qkv = lay.qkv(x)  # [T, (H + 2 Hkv) * D]
        T, D = qkv.shape[0], lay.head_dim
        qk_cols, q_cols = (lay.heads + lay.kv_heads) * D, lay.heads * D
        if lay.q_map is None:
            qk = rotate(qkv[:, :qk_cols])  # [T, (H + Hkv) * D], q's heads then k's
            q, k = qk[:, :q_cols], qk[:, q_cols:]
        else:  # mapped apart (Qwen3: normed per head), so rotated apart, as forward does
            q = rotate(lay.q_map(qkv[:, :q_cols]))  # [T, H * D]
            k = rotate(lay.k_map(qkv[:, q_cols:qk_cols]))  # [T, Hkv * D]
        q = q.reshape(T, lay.heads, D)  # [T, H, D]
        k = k.reshape(T, lay.kv_heads, D)  # [T, Hkv, D]
        v = qkv[:, qk_cols:].reshape(T, lay.kv_heads, D)  # [T, Hkv, D]
        out = lay.attend(q, k, v, kv_cache, meta.view(lay.sliding_window),
                         lay.params)  # [T, H, D]
        return lay.o(out.reshape(T, lay.heads * D))  # [T, hidden]
