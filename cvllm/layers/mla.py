"""Multi-head latent attention (MLA), the attention of DeepSeek V2/V3, over a compressed
paged cache.

Built by ``models/deepseek_v2.py``, one per decoder layer, on every rank; it holds no
cache. Each forward gets that layer's ``(kv_cache, None)`` from the worker (allocated from
``MLASpec``: ``kv_cache [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``) and
the step's ``AttentionMetadata``. Per token only the normalised latent ``c_kv`` and the
rotated rope key ``k_pe`` are cached; see ``attention/backends/torch_ref_mla.py`` (the
one ``attention/interface.MLABackend`` so far, held by every MLA layer) for the absorbed
attention that reads them.

Projections follow Hugging Face's ``DeepseekV2Attention`` / ``DeepseekV3Attention``:
``q_proj`` (no q LoRA, e.g. V2-Lite) or ``q_a_proj -> q_a_layernorm -> q_b_proj``,
``kv_a_proj_with_mqa`` (latent + rope key), ``kv_a_layernorm``, ``kv_b_proj`` (per head
``[k_nope | v]`` rows from the latent) and ``o_proj``. TP splits heads: ``q_b_proj`` /
``q_proj`` / ``kv_b_proj`` by output rows, ``o_proj`` by input; the latent projections
and the cache are replicated. After loading, ``process_weights_after_loading`` splits
this rank's ``kv_b_proj`` into ``W_UK [H, Dn, R]`` and ``W_UV [H, Dv, R]`` for the
absorbed form.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import torch
from torch import nn

from cvllm.attention.backends.torch_ref_mla import TorchRefMLABackend
from cvllm.attention.metadata import AttentionMetadata
from cvllm.layers.layernorm import RMSNorm
from cvllm.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from cvllm.layers.rotary import RotaryEmbedding
from cvllm.layers.utils import as_tensor, copy_checked, divide
from cvllm.quantization.base import QuantizationConfig

# transformers builds q_a_layernorm / kv_a_layernorm without passing rms_norm_eps, so they
# always use DeepseekV2RMSNorm's default; so does DeepSeek's own modeling code.
LORA_NORM_EPS = 1e-6


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_softmax_scale(qk_head_dim: int, rope_parameters: Mapping[str, Any]) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` when the rope
    is scaled and ``mscale_all_dim`` is set (transformers' ``yarn_apply_mscale``)."""
    scale = qk_head_dim**-0.5
    if (rope_parameters.get("rope_type") or "default") != "default":
        mscale_all_dim = rope_parameters.get("mscale_all_dim") or 0
        if mscale_all_dim:
            m = yarn_get_mscale(float(rope_parameters["factor"]), float(mscale_all_dim))
            scale = scale * m * m
    return scale


class KVBParallelLinear(ColumnParallelLinear):
    """``kv_b_proj``: ``[H * (Dn + Dv), R]``, split by heads. Besides HF's fused tensor it
    loads llama.cpp's split pair (``shard_id``): ``k_b`` ``[H, R, Dn]`` (transposed, as its
    converter writes ``attn_k_b``) and ``v_b`` ``[H, Dv, R]`` (``attn_v_b``)."""

    quantizable = False  # its loader splits and transposes llama.cpp's k_b / v_b

    def __init__(
        self,
        kv_lora_rank: int,
        num_heads: int,
        qk_nope_head_dim: int,
        v_head_dim: int,
        params_dtype,
        quant_config,
        prefix: str,
    ):
        self.total_num_heads, self.qk_nope_head_dim = num_heads, qk_nope_head_dim
        self.v_head_dim = v_head_dim
        super().__init__(
            kv_lora_rank,
            num_heads * (qk_nope_head_dim + v_head_dim),
            bias=False,
            params_dtype=params_dtype,
            quant_config=quant_config,
            prefix=prefix,
        )

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None
    ) -> None:
        if shard_id is None:
            super().weight_loader(param, loaded_weight)
            return
        dn, dv = self.qk_nope_head_dim, self.v_head_dim
        if shard_id not in ("k_b", "v_b"):
            raise ValueError(f"kv_b_proj shard_id must be 'k_b' or 'v_b', got {shard_id!r}")
        if loaded_weight.dim() != 3 or loaded_weight.shape[0] != self.total_num_heads:
            raise ValueError(f"shape mismatch: {shard_id} tensor {tuple(loaded_weight.shape)} "
                             f"needs {self.total_num_heads} heads in dim 0")
        heads = divide(self.total_num_heads, self.tp_size)
        # This rank's heads first, so a lazy tensor reads only them; then the layout.
        part = as_tensor(loaded_weight.narrow(0, self.tp_rank * heads, heads))
        if shard_id == "k_b":
            part, offset = part.transpose(1, 2), 0  # [H, Dn, R]
        else:
            offset = dn  # [H, Dv, R]
        dst = param.data.view(heads, dn + dv, -1).narrow(1, offset, part.shape[1])
        copy_checked(dst, part)


class MultiHeadLatentAttention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: Optional[int],
        kv_lora_rank: int,
        rotary_emb: RotaryEmbedding,
        scale: float,
        attention_bias: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        quant_config: Optional[QuantizationConfig] = None,
        prefix: str = "",
    ):
        super().__init__()
        self.total_num_heads = num_heads
        self.qk_nope_head_dim, self.qk_rope_head_dim = qk_nope_head_dim, qk_rope_head_dim
        self.v_head_dim, self.q_lora_rank, self.kv_lora_rank = v_head_dim, q_lora_rank, kv_lora_rank
        dt, qc = params_dtype, quant_config
        self._build_query(
            hidden_size,
            num_heads * (qk_nope_head_dim + qk_rope_head_dim),
            attention_bias,
            dt,
            qc,
            prefix,
        )
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            hidden_size,
            kv_lora_rank + qk_rope_head_dim,
            bias=attention_bias,
            params_dtype=dt,
            quant_config=qc,
            prefix=f"{prefix}.kv_a_proj_with_mqa",
        )
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, LORA_NORM_EPS, dt)
        self.kv_b_proj = KVBParallelLinear(
            kv_lora_rank, num_heads, qk_nope_head_dim, v_head_dim, dt, qc, f"{prefix}.kv_b_proj"
        )
        self.o_proj = RowParallelLinear(
            num_heads * v_head_dim,
            hidden_size,
            bias=attention_bias,
            params_dtype=dt,
            quant_config=qc,
            prefix=f"{prefix}.o_proj",
        )
        self.num_heads = self.kv_b_proj.output_size_per_partition // (qk_nope_head_dim + v_head_dim)
        self.rotary_emb = rotary_emb
        self.scale = float(scale)
        self.prefix = prefix
        self.backend = TorchRefMLABackend()
        # Filled by process_weights_after_loading from this rank's kv_b_proj.
        self.register_buffer("w_uk", torch.empty(0, dtype=dt), persistent=False)  # [H, Dn, R]
        self.register_buffer("w_uv", torch.empty(0, dtype=dt), persistent=False)  # [H, Dv, R]

    def _build_query(self, hidden: int, q_out: int, bias: bool, dt, qc, prefix: str) -> None:
        """``q_proj`` without q LoRA (V2-Lite), else ``q_a_proj -> q_a_layernorm -> q_b_proj``."""
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(
                hidden,
                q_out,
                bias=False,
                params_dtype=dt,
                quant_config=qc,
                prefix=f"{prefix}.q_proj",
            )
            return
        self.q_a_proj = ReplicatedLinear(
            hidden,
            self.q_lora_rank,
            bias=bias,
            params_dtype=dt,
            quant_config=qc,
            prefix=f"{prefix}.q_a_proj",
        )
        self.q_a_layernorm = RMSNorm(self.q_lora_rank, LORA_NORM_EPS, dt)
        self.q_b_proj = ColumnParallelLinear(
            self.q_lora_rank,
            q_out,
            bias=False,
            params_dtype=dt,
            quant_config=qc,
            prefix=f"{prefix}.q_b_proj",
        )

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        """Split ``kv_b_proj`` into ``W_UK`` / ``W_UV``. It is read back by applying the
        layer to the identity, so any linear method (quantized or not) gives its weight."""
        R = self.kv_lora_rank
        ref = self.kv_a_layernorm.weight
        eye = torch.eye(R, dtype=ref.dtype, device=ref.device)  # [R, R]
        w = self.kv_b_proj(eye).t()  # [H*(Dn+Dv), R]
        w = w.reshape(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, R)
        self.w_uk = w[:, : self.qk_nope_head_dim].contiguous()  # [H, Dn, R]
        self.w_uv = w[:, self.qk_nope_head_dim :].contiguous()  # [H, Dv, R]

    def _query(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.q_lora_rank is None:
            return self.q_proj(hidden_states)  # [T, H * (Dn + P)]
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """``hidden_states [T, hidden]`` -> ``[T, hidden]``; caches this step's latents."""
        if self.w_uk.numel() == 0:
            raise RuntimeError(f"{self.prefix}: process_weights_after_loading was not called")
        T, H, dn, P = (
            hidden_states.shape[0],
            self.num_heads,
            self.qk_nope_head_dim,
            self.qk_rope_head_dim,
        )
        q = self._query(hidden_states).view(T, H, dn + P)  # [T, H, Dn + P]
        q_nope, q_pe = q.split([dn, P], dim=-1)
        latent = self.kv_a_proj_with_mqa(hidden_states)  # [T, R + P]
        kv_c, k_pe = latent.split([self.kv_lora_rank, P], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c.contiguous())  # [T, R]
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe.unsqueeze(1))  # [T, H, P], [T, 1, P]
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)  # [T, H, R]
        o = self.backend.forward(
            q_latent, q_pe, kv_c, k_pe[:, 0], kv_cache[0], attn_metadata, self.scale
        )  # [T, H, R]
        o = torch.bmm(o.transpose(0, 1), self.w_uv.transpose(1, 2))  # [H, T, Dv]
        return self.o_proj(o.transpose(0, 1).reshape(T, H * self.v_head_dim))  # [T, hidden]

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, q_lora_rank={self.q_lora_rank}, "
            f"kv_lora_rank={self.kv_lora_rank}, qk_nope={self.qk_nope_head_dim}, "
            f"qk_rope={self.qk_rope_head_dim}, v_head_dim={self.v_head_dim}, "
            f"scale={self.scale:.4g}, backend={self.backend.name}"
        )
