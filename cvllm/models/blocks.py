"""The blocks every decoder family is made of: the gated MLP, the GQA attention block, the
decoder layer (whose norms are its residual layout), and the decoder stack.

Built by the model classes (``models/base.DecoderForCausalLM`` and the families on it),
one set per rank, holding this rank's shards; no block owns a cache: each forward gets
its layer's cache entry and the step's ``AttentionMetadata`` explicitly. A family
declares what differs (biases, q/k norms, softcaps, windows, norm placement, an MoE in
place of the MLP) and never copies a block; the CPU's flat decode loop
(``models/flat_decode.py``) binds the same blocks' pieces, and
``tests/models/test_flat_decode.py`` compares it with their forwards for every family.

Names: every part is registered under its checkpoint's (Hugging Face's) name, by which
its weights load and a GGUF file's quantization types are found (Phi's ``dense``,
Gemma's ``pre_feedforward_layernorm``); where that differs from the part's role, the
role is a plain attribute naming the same module (``add_module_as``), so that the shared
forwards read one name in every family.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from cvllm.attention.kv_cache import KVCache
from cvllm.attention.metadata import AttentionMetadata
from cvllm.config import ModelConfig
from cvllm.layers.activation import get_act_and_mul_fn
from cvllm.layers.attention import Attention
from cvllm.layers.embedding import VocabParallelEmbedding
from cvllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from cvllm.layers.rotary import RotaryEmbedding
from cvllm.quantization.base import QuantizationConfig


def add_module_as(parent: nn.Module, role: str, module: Optional[nn.Module],
                  name: Optional[str] = None) -> None:
    """Register ``module`` as ``parent.<name>`` (its checkpoint's name; default ``role``)
    and make it ``parent.<role>`` too: where the two differ, a plain attribute, not a
    second registration (parameters and module walks see it once, under ``name``)."""
    name = name or role
    if module is None or name == role:
        setattr(parent, role, module)
        return
    parent.add_module(name, module)
    object.__setattr__(parent, role, module)


class GatedMLP(nn.Module):
    """``down_proj(act(gate) * up)`` with ``gate_up_proj`` fused: the dense MLP of most
    families, and the shared experts of the MoE ones."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str,
                 dtype: torch.dtype, quant_config: Optional[QuantizationConfig], prefix: str,
                 bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=bias, params_dtype=dtype,
            quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=bias, params_dtype=dtype,
            quant_config=quant_config, prefix=f"{prefix}.down_proj")
        self.act_fn = get_act_and_mul_fn(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # down_proj applies the activation (in its batch-1 GEMV where it can).
        return self.down_proj(self.gate_up_proj(x), act_fn=self.act_fn)  # [T, hidden]


QKNorm = Callable[[int, Sequence[int]], nn.Module]
"""``(head_dim, global head ids of this rank) -> norm`` over each head of q (or k)."""


@dataclass(frozen=True)
class GQAOptions:
    """What a family's attention declares; the rest comes from the config."""

    qkv_bias: Optional[bool] = None
    """None: the config's ``attention_bias`` (as ``o_bias``)."""
    o_bias: Optional[bool] = None
    scale: Optional[float] = None
    """Softmax scale; None: ``head_dim ** -0.5``."""
    logits_soft_cap: Optional[float] = None
    qk_norm: Optional[QKNorm] = None
    """Built once for q and once for k, applied to each head before rope."""
    output_gate: bool = False
    """Qwen3-Next: each query head's q rows are followed by as many gate rows;
    ``out *= sigmoid(gate)`` before ``o_proj``."""
    o_proj_name: str = "o_proj"
    qk_norm_names: Tuple[str, str] = ("q_norm", "k_norm")


class GQAAttention(nn.Module):
    """Grouped-query attention: fused q/k/v projection, the family's per-head q/k maps,
    rope and attention (the backend's), output projection. Heads are this rank's
    (``QKVParallelLinear`` owns the split, uneven ones included)."""

    def __init__(self, config: ModelConfig, rotary_emb: Optional[RotaryEmbedding],
                 dtype: torch.dtype, quant_config: Optional[QuantizationConfig], prefix: str,
                 sliding_window: Optional[int] = None, options: GQAOptions = GQAOptions()):
        super().__init__()
        hidden = config.get("hidden_size")
        self.head_dim = D = config.head_dim
        bias = bool(config.get("attention_bias", False))
        qkv_bias = bias if options.qkv_bias is None else options.qkv_bias
        o_bias = bias if options.o_bias is None else options.o_bias
        self.output_gate = options.output_gate
        self.qkv_proj = QKVParallelLinear(
            hidden, D, config.num_heads, config.num_kv_heads, bias=qkv_bias, params_dtype=dtype,
            quant_config=quant_config, prefix=f"{prefix}.qkv_proj",
            q_rows_per_head=2 if self.output_gate else 1)
        qkv = self.qkv_proj
        self.num_heads, self.num_kv_heads = qkv.num_heads, qkv.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * D, self.num_kv_heads * D
        self.split_sizes = [self.q_size * (2 if self.output_gate else 1), self.kv_size,
                            self.kv_size]
        add_module_as(self, "o_proj", RowParallelLinear(
            config.num_heads * D, hidden, bias=o_bias, params_dtype=dtype,
            quant_config=quant_config, prefix=f"{prefix}.{options.o_proj_name}",
            input_blocks=qkv.o_proj_input_blocks, block_size=D,  # uneven head split: padded
        ), options.o_proj_name)
        make_norm = options.qk_norm
        q_name, k_name = options.qk_norm_names
        add_module_as(self, "q_norm", make_norm and make_norm(D, qkv.q_head_ids), q_name)
        add_module_as(self, "k_norm", make_norm and make_norm(D, qkv.kv_head_ids), k_name)
        self.rotary_emb = rotary_emb
        scale = D**-0.5 if options.scale is None else options.scale
        self.attn = Attention(self.num_heads, D, scale, self.num_kv_heads,
                              sliding_window=sliding_window,
                              logits_soft_cap=options.logits_soft_cap, prefix=f"{prefix}.attn",
                              backend=config.attention_backend)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, kv_cache: KVCache,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)  # [T, (H + 2*Hkv) * D] (gated: 2H)
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        gate = None
        if self.output_gate:
            q, gate = self._split_gate(q)  # [T, H*D], [T, H, D]
        if self.q_norm is not None:
            q, k = self.norm_heads(q, self.q_norm), self.norm_heads(k, self.k_norm)
        # The backend rotates q and k (in place) together with its K/V cache write.
        out = self.attn(q, k, v, kv_cache, attn_metadata, positions, self.rotary_emb)  # [T, H*D]
        if gate is not None:
            out = out * torch.sigmoid(gate.reshape(out.shape[0], -1))
        return self.o_proj(out)  # [T, hidden]

    def _split_gate(self, qg: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Per head D query rows then D gate rows: ``([T, H*D] query, [T, H, D] gate)``."""
        T = qg.shape[0]
        q, gate = qg.view(T, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        return q.contiguous().view(T, -1), gate

    def norm_heads(self, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """``norm`` over each head of ``x [T, heads * D]``; same shape out."""
        T = x.shape[0]
        return norm(x.reshape(T, -1, self.head_dim)).reshape(T, -1)

    def qk_maps(self) -> Tuple[Optional[Callable], Optional[Callable]]:
        """What ``forward`` does to q and to k (``[T, heads * D]``) before the rotation,
        for the flat decode loop: ``(None, None)`` for nothing."""
        if self.q_norm is None:
            return None, None
        return (lambda x: self.norm_heads(x, self.q_norm),
                lambda x: self.norm_heads(x, self.k_norm))


LayerNames = Tuple[Tuple[str, str], ...]
"""A decoder layer's ``(role, checkpoint name)`` pairs, in registration order (the
order of its parameters: dummy weights are drawn in it). The norms listed are the
layer's layout (see ``DecoderLayer``)."""
LLAMA_LAYER: LayerNames = (("attention", "self_attn"), ("mlp", "mlp"),
                           ("input_norm", "input_layernorm"),
                           ("mlp_norm", "post_attention_layernorm"))
NORM_ROLES = ("input_norm", "mlp_norm", "attn_out_norm", "mlp_out_norm")
"""In the order a layer's norms are built."""


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer, attention then MLP, each added to the residual stream.

    ``forward(positions, hidden_states, residual, kv_cache, attn_metadata) -> (delta,
    residual)``: the residual add is deferred into the next norm (``norm(delta,
    residual)`` adds, then normalizes), so the stack adds each output exactly once. With
    ``reduce_in_norm`` and more than one rank, ``o_proj`` / ``down_proj`` return partial
    sums that the RMSNorm after each sums over the TP group (one kernel with the add and
    the norm where comm can): ``delta`` is then this rank's partial sum.

    Parts by role: ``attention`` (any ``(positions, x, cache, metadata) -> x`` mixer),
    ``mlp``, ``input_norm``, and the norms that make the layout: ``mlp_norm`` (adds the
    attention output to the residual, feeds the MLP; without it, the parallel residual
    of Phi-2 / StableLM: ``x + (attn(ln(x)) + mlp(ln(x)))``), ``attn_out_norm`` /
    ``mlp_out_norm`` (Gemma 2/3, GLM-4: each sub-block's output normed again before its
    residual add)."""

    defer_reduce = False  # reduce_in_norm, and more than one rank

    def __init__(self, parts: Mapping[str, nn.Module], names: LayerNames = LLAMA_LAYER,
                 reduce_in_norm: bool = False):
        super().__init__()
        roles = [role for role, _ in names]
        parallel_out = "mlp_norm" not in parts and ("attn_out_norm" in parts
                                                    or "mlp_out_norm" in parts)
        if (sorted(roles) != sorted(parts) or parallel_out
                or not {"attention", "mlp", "input_norm"} <= set(parts)
                or not set(parts) <= {"attention", "mlp", *NORM_ROLES}):
            raise ValueError(f"a decoder layer cannot be made of {sorted(parts)} named {roles}")
        for role in NORM_ROLES[1:]:
            setattr(self, role, None)
        for role, name in names:
            add_module_as(self, role, parts[role], name)
        if reduce_in_norm and self.attention.o_proj.tp_size > 1:
            self.defer_reduce = True
            for linear in (self.attention.o_proj, self.mlp.down_proj):
                linear.reduce_results = False
                linear.push_partial = True  # its GEMV may push for the norm's reduction

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: Optional[torch.Tensor], kv_cache: KVCache,
                attn_metadata: AttentionMetadata) -> Tuple[torch.Tensor, torch.Tensor]:
        if residual is None:  # the embedding's output: already whole
            residual = hidden_states
            hidden_states = self.input_norm(hidden_states)
        else:
            hidden_states, residual = self.input_norm(hidden_states, residual,
                                                      reduce=self.defer_reduce)
        out = self.attention(positions, hidden_states, kv_cache, attn_metadata)  # [T, hidden]
        if self.mlp_norm is None:  # parallel residual: the MLP reads the same input norm
            return out + self.mlp(hidden_states), residual
        if self.attn_out_norm is not None:
            out = self.attn_out_norm(out)
        hidden_states, residual = self.mlp_norm(out, residual, reduce=self.defer_reduce)
        out = self.mlp(hidden_states)  # [T, hidden]
        if self.mlp_out_norm is not None:
            out = self.mlp_out_norm(out)
        return out, residual


class DecoderModel(nn.Module):
    """Token embedding (times ``embed_scale``), the decoder layers, the final norm.

    ``make_layer(i, prefix)`` builds layer ``i``; ``norm`` is registered as
    ``norm_name`` (Phi-2: ``final_layernorm``)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype,
                 quant_config: Optional[QuantizationConfig],
                 make_layer: Callable[[int, str], nn.Module], make_norm: Callable[[], nn.Module],
                 embed_scale: Optional[float] = None, norm_name: str = "norm",
                 prefix: str = "model"):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.get("hidden_size"), dtype,
            prefix=f"{prefix}.embed_tokens", quant_config=quant_config)
        self.embed_scale = embed_scale
        self.layers = nn.ModuleList(make_layer(i, f"{prefix}.layers.{i}")
                                    for i in range(config.num_layers))
        add_module_as(self, "norm", make_norm(), norm_name)
        self.reduce_last = bool(self.layers[-1].defer_reduce) if len(self.layers) else False
        """The last layer's MLP output is a partial sum the final norm reduces."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata, kv_caches: Sequence[KVCache]) -> torch.Tensor:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.layers)} layers")
        hidden_states = self.embed_tokens(input_ids)  # [T, hidden]
        if self.embed_scale is not None:
            hidden_states = hidden_states * self.embed_scale
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden_states, residual = layer(positions, hidden_states, residual, kv_cache,
                                            attn_metadata)
        hidden_states, _ = self.norm(hidden_states, residual, reduce=self.reduce_last)
        return hidden_states
