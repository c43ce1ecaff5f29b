"""The attention backend interface: what every backend declares and the one ``forward``
each implements.

Implemented by ``backends/torch_ref.py`` (CPU, and the reference) and
``backends/triton_backend.py`` (CUDA); MLA (``layers/mla.py``) has its own declared
variant, ``MLABackend``, implemented by ``backends/torch_ref_mla.py``. Backends are
stateless singletons: ``attention/backend.py`` hands one, by the name in
``ModelConfig.attention_backend``, to each ``layers.attention.Attention`` at
construction; the layer calls ``forward`` once per step, with that layer's ``KVCache``
(owned by the worker), the step's ``AttentionMetadata`` view of its KV cache group
(built by the worker) and its ``AttentionParams`` (built once by the layer).

Callers never probe a backend: they read its ``capabilities`` (a frozen dataclass, fixed
per class), where a feature is used at start-up (``require``), or once at construction
(the layer caches the flags its per-step path branches on). Features no backend has yet
are declared too, answered False, so the next ones are added behind this interface:
speculative verification (``multi_token_decode``: decode sequences with more than one
query token, ``AttentionMetadata.decode_query_len``) and encoder attention for images
(``non_causal``: ``AttentionParams.causal`` False).
"""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass
from typing import ClassVar, List, Optional

import torch

from cvllm.attention.kv_cache import KVCache
from cvllm.attention.metadata import AttentionMetadata, RopeInputs


@dataclass(frozen=True)
class AttentionCapabilities:
    """What a backend can do beyond causal paged attention of one query token per decode
    sequence. Every field defaults to False: a backend declares what it has."""

    fused_rope: bool = False
    """``forward(..., rope=)`` rotates q and k (in place) with the K/V write; the layer
    then hands it the rotation instead of rotating itself."""
    takes_out: bool = False
    """``forward(..., out=)`` writes into a given contiguous ``[T, H, D]`` tensor."""
    fp8_cache: bool = False
    """Reads and writes FP8 e4m3 caches with the ``KVCache``'s per-tensor scales."""
    cuda_graphs: bool = False
    """A forward captured in a CUDA graph is right for every step of its padded size: it
    reads only the metadata's device tensors and host ints, never its host arrays
    (``worker/cuda_graph.py``)."""
    split_graphs: bool = False
    """Runs eagerly between the captured pieces of a mixed-step graph, on static input
    buffers, writing its output into a static ``out`` (``worker/mixed_graph.py``)."""
    multi_token_decode: bool = False
    """Decode sequences of ``AttentionMetadata.decode_query_len`` > 1 tokens each
    (speculative verification). No backend has it yet."""
    non_causal: bool = False
    """Layers with ``AttentionParams.causal`` False (encoder attention)."""

    def missing(self, *features: str) -> List[str]:
        """Those of ``features`` (field names) this backend lacks; ValueError for a name
        that is no capability."""
        have = dataclasses.asdict(self)
        unknown = [f for f in features if f not in have]
        if unknown:
            raise ValueError(f"no attention capability {unknown}; known: {sorted(have)}")
        return [f for f in features if not have[f]]


@dataclass(frozen=True)
class AttentionParams:
    """One attention layer's fixed parameters, built once by the layer and handed to
    every ``forward``; normalised here (a window or softcap of 0 is None) so the
    backends never convert them per call."""

    scale: float
    """Softmax scale of the scores (``head_dim ** -0.5`` in most families)."""
    sliding_window: Optional[int] = None
    """Keys a query sees: the last ``sliding_window`` positions up to its own; None: all."""
    softcap: Optional[float] = None
    """Scores pass through ``softcap * tanh(s / softcap)`` before the softmax (Gemma 2)."""
    causal: bool = True
    """False: encoder attention, where every query of a sequence sees every key of this
    step's tokens of that sequence and no cache is read or written (``non_causal``)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "scale", float(self.scale))
        object.__setattr__(self, "sliding_window",
                           int(self.sliding_window) if self.sliding_window else None)
        object.__setattr__(self, "softcap", float(self.softcap) if self.softcap else None)
        if not self.causal and self.sliding_window is not None:
            raise ValueError("a sliding window needs causal attention")


class AttentionBackend(abc.ABC):
    """Paged attention over a layer's ``KVCache``. Stateless: implementations may bind
    module functions as static methods (no per-call ``self``)."""

    name: ClassVar[str]
    """What ``--attention-backend`` calls it."""
    capabilities: ClassVar[AttentionCapabilities]

    @abc.abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: Optional[KVCache],
        meta: AttentionMetadata,
        params: AttentionParams,
        rope: Optional[RopeInputs] = None,
        out: Optional[torch.Tensor] = None,  # [T, H, D], like q
    ) -> torch.Tensor:
        """Write the ``meta.num_tokens`` real tokens' K/V at ``meta.slot_mapping`` (FP8:
        quantized with the cache's scales, calibrated at its first real write), then
        attend every sequence's queries over its cached context with ``params``. Returns
        ``[T, H, D]`` (``out`` when given), padding rows (past ``num_tokens``) zero.
        ``rope`` only where ``capabilities.fused_rope``, ``out`` only where
        ``takes_out``: ``layers.attention.Attention`` checks both."""

    def require(self, *features: str) -> None:
        """Raise ``NotImplementedError`` naming this backend and the ``features``
        (``AttentionCapabilities`` fields) it lacks. For start-up and construction
        checks, never per step."""
        missing = self.capabilities.missing(*features)
        if missing:
            raise NotImplementedError(
                f"attention backend {self.name} does not implement {', '.join(missing)}")

    def check_layer(self, params: AttentionParams) -> None:
        """Refuse, at construction, a layer this backend cannot run."""
        if not params.causal:
            self.require("non_causal")


class MLABackend(abc.ABC):
    """The declared variant for multi-head latent attention (``layers/mla.py``): one
    latent cache per layer ``[N, bs, R + P]`` (``attention/specs.MLASpec``) read in the
    absorbed form (see ``backends/torch_ref_mla.py``). Stateless."""

    name: ClassVar[str]
    capabilities: ClassVar[AttentionCapabilities]

    @abc.abstractmethod
    def forward(self, q_latent: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor,
                k_pe: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """``q_latent [T, H, R]`` (q_nope absorbed through W_UK), ``q_pe [T, H, P]`` and
        ``k_pe [T, P]`` (rotated), ``kv_c [T, R]`` (the normalised latent), ``kv_cache
        [N, bs, R + P]``: write this step's latents, then attend causally; the latent
        output ``[T, H, R]``, padding rows zero."""
