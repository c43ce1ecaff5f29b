"""Phi-3 / 3.5 / 4 decoder (Phi3ForCausalLM).

Architecturally Mistral's decoder (``llama.py``): RMSNorm, gated SiLU MLP, no biases,
``sliding_window`` when the config sets one. What differs is only in the checkpoint and
the rope, and both are handled below the model:

- the checkpoint stores q/k/v fused as ``qkv_proj`` and gate/up fused as ``gate_up_proj``
  (gate first), the names of the parallel layers here; their weight_loaders split a
  pre-fused tensor (no ``shard_id``) into this rank's q/k/v heads or gate/up halves;
- rope: ``longrope`` (short/long factor lists and an attention factor; which list is used
  is documented in ``layers/rotary.py``), ``partial_rotary_factor`` (Phi-4-mini), and the
  top-level ``original_max_position_embeddings`` Phi-3 configs carry, all read by
  ``rope_parameters_from_config``.

Built by the worker on every rank like every model class.
"""

from __future__ import annotations

from cvllm.models.llama import MistralForCausalLM


class Phi3ForCausalLM(MistralForCausalLM):
    """Mistral's decoder with Phi-3's checkpoint names (see the module docstring)."""
