"""GLM-4 decoder (Glm4ForCausalLM: GLM-4-0414, GLM-Z1).

Llama's decoder (``llama.py``) declaring, as in transformers' ``modeling_glm4.py``:
- partial rotary (``partial_rotary_factor``, 0.5 in the released models) in GPT-J style,
  rotating interleaved pairs (x0, x1), (x2, x3)... of the first rotary dims;
- q/k/v bias from ``attention_bias``, o_proj never biased;
- a fused ``gate_up_proj`` checkpoint tensor (gate rows first), loaded as is by the
  merged gate/up linear (Llama's mapping stays for q/k/v);
- two extra norms (the sandwich layout): ``post_self_attn_layernorm`` on the attention
  output and ``post_mlp_layernorm`` on the MLP output, each before its residual add;
  they need whole sums, so the row-parallel outputs are reduced in the linears.
Built by the worker on every rank like every model class.
"""

from __future__ import annotations

import torch

from cvllm.config import ModelConfig
from cvllm.models.blocks import LLAMA_LAYER, GQAOptions
from cvllm.models.llama import LlamaForCausalLM


class Glm4ForCausalLM(LlamaForCausalLM):
    layer_names = LLAMA_LAYER + (("attn_out_norm", "post_self_attn_layernorm"),
                                 ("mlp_out_norm", "post_mlp_layernorm"))
    rope_is_neox_style = False
    reduce_in_norm = False

    def attention_options(self, config: ModelConfig, dtype: torch.dtype) -> GQAOptions:
        return GQAOptions(o_bias=False)
