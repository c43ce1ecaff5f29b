"""A pure-decode step of a Llama-shaped decoder as one flat loop: the CPU's counterpart of
a decode CUDA graph.

Built once by the worker (``ModelRunner``) from a loaded model whose ``flat_decoder()``
offers one; called instead of the model's forward for CPU steps in which every sequence
decodes one token. Holds no state of its own: the weights, norms, rotation and attention
backend it calls belong to the model's modules, bound here once.

Why: a small model's decode step on the CPU is mostly per-op cost, not arithmetic. The
default model's 30 layers of 576 columns spend about 0.12 ms a layer in the int4 matmuls
and three times that in the module path around them: module calls, the linear -> quant
method -> backend dispatch, per-call checks, about 57 torch ops a layer. This loop calls
the same functions in the same order (each module's ``host_*`` callable: the linears'
``host_linear``, ``RMSNorm.host_fn``, ``RotaryEmbedding.host_rotation`` computed once a
step, the attention backend's ``forward``), so its outputs are bit-identical to the
module path (``tests/models/test_flat_decode.py``) at about two thirds of the time
(``docs/quantization.md``).

Eligible: ``LlamaModel`` stacks whose layers, MLP, norms and rotation run the Llama code
unchanged, with Llama's attention (Llama, Mistral, Qwen2 and others that only change
construction) or Qwen3's (q and k RMS-normed per head before the rotation), on one rank
(no tensor-parallel reduction inside a layer), with the torch reference attention
backend. Anything else keeps its forward (``build`` returns None).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch

from cvllm.attention.metadata import AttentionMetadata
from cvllm.layers.layernorm import RMSNorm
from cvllm.layers.rotary import RotaryEmbedding
from cvllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaModel
from cvllm.models.qwen3 import Qwen3Attention

Fn = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class _FlatLayer:
    """One decoder layer's callables and sizes."""

    input_norm: Fn
    post_norm: Fn
    qkv: Fn  # [T, hidden] -> [T, (H + 2 Hkv) * D]
    o: Fn  # [T, H * D] -> [T, hidden]
    gate_up: Fn  # [T, hidden] -> [T, 2I]
    act: Fn  # [T, 2I] -> [T, I]
    down: Fn  # [T, I] -> [T, hidden]
    attend: Callable  # the attention backend's forward
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    sliding_window: Optional[int]
    softcap: Optional[float]
    q_norm: Optional[Fn] = None  # Qwen3: per head, [T, H, D] -> [T, H, D]
    k_norm: Optional[Fn] = None


_ATTENTION_FORWARDS = (LlamaAttention.forward, Qwen3Attention.forward)
"""The attention forwards ``FlatDecoder._attention`` computes (``_bind`` reads which)."""


def _plain_layer(layer) -> bool:
    """Whether ``layer`` computes exactly what ``LlamaDecoderLayer`` does, on one rank."""
    if type(layer).forward is not LlamaDecoderLayer.forward or layer.defer_reduce:
        return False
    attn, mlp = layer.self_attn, layer.mlp  # what that forward calls
    if type(attn).forward not in _ATTENTION_FORWARDS or type(mlp).forward is not LlamaMLP.forward:
        return False
    if type(attn).forward is Qwen3Attention.forward and not all(
            type(n) is RMSNorm for n in (attn.q_norm, attn.k_norm)):
        return False
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    return (all(type(n) is RMSNorm for n in (layer.input_layernorm,
                                             layer.post_attention_layernorm))
            and all(lin.tp_size == 1 for lin in linears)
            and type(attn.rotary_emb).forward is RotaryEmbedding.forward
            and attn.attn.backend.name == "torch_ref")


class FlatDecoder:
    """``__call__(input_ids, positions, attn_metadata, kv_caches)``: the model's forward
    for a pure-decode CPU step (``[T, hidden]``, the last norm applied)."""

    def __init__(self, model: LlamaModel):
        self.embed = model.embed_tokens
        self.final_norm = model.norm.host_fn()
        self.rotary = model.layers[0].self_attn.rotary_emb
        self.layers: List[_FlatLayer] = [self._bind(layer) for layer in model.layers]

    @classmethod
    def build(cls, model: torch.nn.Module) -> Optional["FlatDecoder"]:
        """A flat decoder of ``model`` (a loaded ``LlamaModel`` on the CPU), or None where
        its code differs from the Llama layers this loop copies."""
        if type(model).forward is not LlamaModel.forward or not len(model.layers):
            return None
        if model.norm.weight.device.type != "cpu" or type(model.norm) is not RMSNorm:
            return None
        rotary = model.layers[0].self_attn.rotary_emb
        if not all(_plain_layer(layer) and layer.self_attn.rotary_emb is rotary
                   for layer in model.layers):
            return None
        return cls(model)

    @staticmethod
    def _bind(layer) -> _FlatLayer:
        attn, mlp = layer.self_attn, layer.mlp
        a = attn.attn
        qk_norms = type(attn).forward is Qwen3Attention.forward
        return _FlatLayer(
            input_norm=layer.input_layernorm.host_fn(),
            post_norm=layer.post_attention_layernorm.host_fn(),
            qkv=attn.qkv_proj.quant_method.host_linear(attn.qkv_proj),
            o=attn.o_proj.quant_method.host_linear(attn.o_proj),
            gate_up=mlp.gate_up_proj.quant_method.host_linear(mlp.gate_up_proj),
            act=mlp.act_fn.forward,  # a module without hooks: its forward, one call less
            down=mlp.down_proj.quant_method.host_linear(mlp.down_proj),
            attend=a.backend.forward,
            heads=a.num_heads, kv_heads=a.num_kv_heads, head_dim=a.head_size,
            scale=a.scale, sliding_window=a.sliding_window, softcap=a.logits_soft_cap,
            q_norm=attn.q_norm.host_fn() if qk_norms else None,
            k_norm=attn.k_norm.host_fn() if qk_norms else None,
        )

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 attn_metadata: AttentionMetadata, kv_caches: Sequence) -> torch.Tensor:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.layers)} layers")
        hidden = self.embed(input_ids)  # [T, hidden]
        rotate = self.rotary.host_rotation(positions, hidden.dtype)
        residual = None
        for lay, (k_cache, v_cache) in zip(self.layers, kv_caches):
            residual = hidden if residual is None else hidden + residual
            hidden = self._attention(lay, lay.input_norm(residual), rotate, k_cache, v_cache,
                                     attn_metadata)
            residual = hidden + residual
            hidden = lay.down(lay.act(lay.gate_up(lay.post_norm(residual))))  # [T, hidden]
        return self.final_norm(hidden + residual)  # [T, hidden]

    @staticmethod
    def _attention(lay: _FlatLayer, x: torch.Tensor, rotate: Fn, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The attention's forward (Llama's, or Qwen3's) of normed rows ``x [T, hidden]``."""
        qkv = lay.qkv(x)  # [T, (H + 2 Hkv) * D]
        T, D = qkv.shape[0], lay.head_dim
        qk_cols, q_cols = (lay.heads + lay.kv_heads) * D, lay.heads * D
        if lay.q_norm is None:
            qk = rotate(qkv[:, :qk_cols])  # [T, (H + Hkv) * D], q's heads then k's
            q, k = qk[:, :q_cols], qk[:, q_cols:]
        else:  # normed apart, so rotated apart, as Qwen3Attention does
            q = rotate(lay.q_norm(qkv[:, :q_cols].reshape(T, lay.heads, D)).reshape(T, -1))
            k = rotate(lay.k_norm(qkv[:, q_cols:qk_cols].reshape(T, lay.kv_heads, D))
                       .reshape(T, -1))
        q = q.reshape(T, lay.heads, D)  # [T, H, D]
        k = k.reshape(T, lay.kv_heads, D)  # [T, Hkv, D]
        v = qkv[:, qk_cols:].reshape(T, lay.kv_heads, D)  # [T, Hkv, D]
        out = lay.attend(q, k, v, k_cache, v_cache, meta.view(lay.sliding_window), lay.scale,
                         lay.sliding_window, lay.softcap)  # [T, H, D]
        return lay.o(out.reshape(T, lay.heads * D))  # [T, hidden]
