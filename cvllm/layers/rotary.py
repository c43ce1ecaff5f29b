"""Rotary position embeddings and their scalings (default, linear, dynamic, llama3, yarn,
longrope).

Built once per model by ``get_rope`` (layers with equal settings share one instance) from
the config's rope settings, read by ``rope_parameters_from_config``. The cos/sin cache
``[max_position, rotary_dim]`` (cos half | sin half) is computed in float32 with the same
formulas as ``transformers.modeling_rope_utils``; it is a plain attribute rather than a
buffer so that casting the model to bf16 never rounds it (it follows the positions'
device on first use). Rotation happens in the activations' dtype with cos/sin cast to it,
as Hugging Face does. On CUDA the rotation is the Triton kernel ``kernels/rotary.py``,
in place on q and k (float32 math, rounded once); elsewhere the torch code below. The
Triton attention backend applies it instead, in the kernel that writes the K/V cache
(``rope_inputs``, ``layers/attention.py``).

``dynamic`` deviates from HF on purpose: HF recomputes the frequencies from the longest
sequence of each forward, which a paged cache cannot follow (cached keys would keep stale
rotations). When the served length (``max_model_len``) fits the original context we use
the unscaled frequencies, which is exactly what HF does for every such sequence; beyond it,
like vLLM, we fix them at the scaled length ``max_position_embeddings * factor``.

``longrope`` (Phi-3/3.5/4) deviates the same way. HF picks ``short_factor`` or
``long_factor`` per forward from the sequence length: long once ``max(position) + 1 >
original_max_position_embeddings``; when a sequence grows past that length, its generate()
drops the KV cache and re-prefills everything with the long factors. A paged cache cannot
re-rotate cached keys, so (like llama.cpp, which picks by its context size) we pick once per
engine from the served length: long factors for every position iff ``max_model_len >
original_max_position_embeddings``, short ones otherwise. This equals HF for every sequence
when ``max_model_len <= original`` and for every sequence longer than ``original`` otherwise;
shorter sequences then differ (HF would use the short factors). One attention factor scales
cos/sin either way (``attention_factor``, default ``sqrt(1 + ln(factor) / ln(original))``
with ``factor = max_position_embeddings / original`` when the config gives none).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import torch
from torch import nn

from cvllm.attention.metadata import RopeInputs


class RotaryEmbedding(nn.Module):
    """Plain rope; subclasses override ``_compute_inv_freq`` (and ``mscale``). A
    subclass takes this constructor's arguments positionally (``*shape``), then its
    scaling's by keyword."""

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool = True,
    ):
        super().__init__()
        if rotary_dim % 2 or rotary_dim > head_size:
            raise ValueError(f"rotary_dim {rotary_dim} must be even and <= head_size {head_size}")
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position_embeddings = max_position_embeddings
        self.base = float(base)
        self.is_neox_style = is_neox_style
        self.mscale = 1.0
        self.cos_sin_cache = self._compute_cos_sin_cache()  # [max_pos, rotary_dim] float32
        self._rows_memo: Optional[tuple] = None  # see _neox_rows

    def _base_inv_freq(self, base: float) -> torch.Tensor:
        exponent = (
            torch.arange(0, self.rotary_dim, 2, dtype=torch.int64).to(torch.float32)
            / self.rotary_dim
        )
        return 1.0 / (base**exponent)  # [rotary_dim / 2]

    def _compute_inv_freq(self) -> torch.Tensor:
        return self._base_inv_freq(self.base)

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        inv_freq = self._compute_inv_freq().to(torch.float32)  # [rotary_dim / 2]
        t = torch.arange(self.max_position_embeddings, dtype=torch.float32, device=inv_freq.device)
        freqs = t[:, None] * inv_freq[None, :]  # [max_pos, rotary_dim / 2]
        return torch.cat([freqs.cos() * self.mscale, freqs.sin() * self.mscale], dim=-1)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Rotate ``query`` / ``key`` (``[T, heads * head_size]`` or ``[T, heads, head_size]``)
        at ``positions [T]``; returns tensors of the input shapes: new ones on the CPU, the
        inputs themselves, rotated in place, on CUDA (callers pass fresh projections)."""
        if self.cos_sin_cache.device != positions.device:
            self.cos_sin_cache = self.cos_sin_cache.to(positions.device)
        if query.is_cuda:
            from cvllm.kernels.rotary import rotary_embedding

            return rotary_embedding(positions.reshape(-1), query, key, self.cos_sin_cache,
                                    self.head_size, self.is_neox_style)
        if self.is_neox_style and self.rotary_dim == self.head_size:
            return self._rotate_neox_full(positions, query, key)
        rotate = self.host_rotation(positions, query.dtype)
        return rotate(query), (rotate(key) if key is not None else None)

    def _rotate_neox_full(
        self, positions: torch.Tensor, query: torch.Tensor, key: Optional[torch.Tensor]
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The CPU rotate-half over whole heads in few ops: ``x * [cos|cos] +
        [x2|x1] * [-sin|sin]`` is bit-equal to ``_rotate`` (``a + -b == a - b``). q and k
        that are adjacent views of one fused projection are rotated as one tensor."""
        cos, sin = self._neox_rows(positions, query.dtype)  # [T, 1, head_size] each
        both = _adjacent(query, key) if key is not None else None
        if both is None:
            k_rot = None if key is None else _rotate_half(key, cos, sin, self.head_size)
            return _rotate_half(query, cos, sin, self.head_size), k_rot
        out = _rotate_half(both, cos, sin, self.head_size)  # [T, (Hq + Hk) * head_size]
        q_rot, k_rot = out.split([query.shape[1], key.shape[1]], dim=1)  # 2-D, as given
        return q_rot, k_rot

    def _neox_rows(self, positions: torch.Tensor, dtype: torch.dtype):
        """``([cos|cos], [-sin|sin])`` rows ``[T, 1, head_size]`` at ``positions`` in
        ``dtype``. Every layer of a step shares this module and asks for the same positions,
        so the last answer is kept, keyed by a copy of the positions (compared by value:
        one cheap op, safe against reused or refilled position tensors)."""
        pos = positions.reshape(-1)  # [T]
        memo = self._rows_memo
        if (memo is not None and memo[1] == dtype and memo[0].device == pos.device
                and torch.equal(memo[0], pos)):
            return memo[2], memo[3]
        cos, sin = self.cos_sin_cache.index_select(0, pos).to(dtype).chunk(2, dim=-1)
        cos2 = torch.cat([cos, cos], dim=-1).unsqueeze(1)  # [T, 1, head_size]
        sin2 = torch.cat([-sin, sin], dim=-1).unsqueeze(1)
        self._rows_memo = (pos.clone(), dtype, cos2, sin2)
        return cos2, sin2

    def host_rotation(self, positions: torch.Tensor, dtype: torch.dtype
                      ) -> Callable[[torch.Tensor], torch.Tensor]:
        """This rotation at ``positions [T]`` as one callable over ``[T, heads *
        head_size]`` rows of ``dtype`` (q's and k's heads alike, so both at once when
        adjacent), returning a new tensor: what ``forward`` computes on the CPU, with the
        position rows looked up once for a flat loop over the layers
        (``models/flat_decode.py``)."""
        if self.cos_sin_cache.device != positions.device:
            self.cos_sin_cache = self.cos_sin_cache.to(positions.device)
        if self.is_neox_style and self.rotary_dim == self.head_size:
            cos2, sin2 = self._neox_rows(positions, dtype)  # [T, 1, head_size] each
            return functools.partial(_rotate_half, cos=cos2, sin=sin2, head_size=self.head_size)
        cos_sin = self.cos_sin_cache.index_select(0, positions.reshape(-1))  # [T, rotary_dim]
        cos, sin = cos_sin.chunk(2, dim=-1)  # [T, rotary_dim / 2] each
        return functools.partial(self._rotate, cos=cos, sin=sin)

    def rope_inputs(self, positions: torch.Tensor) -> RopeInputs:
        """This rotation at ``positions``, for an attention backend that applies it with
        its K/V cache write (``layers/attention.py``)."""
        if self.cos_sin_cache.device != positions.device:
            self.cos_sin_cache = self.cos_sin_cache.to(positions.device)
        return RopeInputs(positions.reshape(-1), self.cos_sin_cache, self.head_size,
                          self.is_neox_style)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(shape[0], -1, self.head_size)  # [T, heads, head_size]
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        cos = cos.unsqueeze(1).to(x.dtype)  # [T, 1, rotary_dim / 2]
        sin = sin.unsqueeze(1).to(x.dtype)
        if self.is_neox_style:
            x1, x2 = rot.chunk(2, dim=-1)
        else:  # GPT-J: interleaved pairs (x0, x1), (x2, x3), ...
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        if self.is_neox_style:
            rot = torch.cat([o1, o2], dim=-1)
        else:
            rot = torch.stack([o1, o2], dim=-1).flatten(-2)  # [T, heads, rotary_dim]
        return torch.cat([rot, rest], dim=-1).reshape(shape)

    def extra_repr(self) -> str:
        return (
            f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, "
            f"max_position={self.max_position_embeddings}, base={self.base}, "
            f"neox={self.is_neox_style}"
        )


def _rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_size: int):
    """``x [T, heads * head_size]`` (or ``[T, heads, head_size]``) rotated by the
    ``[T, 1, head_size]`` rows of ``_neox_rows``; returns a new tensor of x's shape."""
    xh = x.reshape(x.shape[0], -1, head_size)  # [T, heads, head_size]
    swapped = xh.roll(head_size // 2, dims=-1)  # [x2 | x1]: one op instead of chunk + cat
    return (xh * cos + swapped * sin).reshape(x.shape)


def _adjacent(q: torch.Tensor, k: torch.Tensor) -> Optional[torch.Tensor]:
    """One ``[T, (Hq + Hk) * D]`` view over q and k when k's columns directly follow q's
    in memory (the split of a fused QKV projection); None otherwise."""
    if q.dim() != 2 or k.dim() != 2 or q.dtype != k.dtype or q.shape[0] != k.shape[0]:
        return None
    if q.stride(1) != 1 or k.stride(1) != 1 or q.stride(0) != k.stride(0):
        return None
    if k.data_ptr() != q.data_ptr() + q.shape[1] * q.element_size():
        return None
    if q.shape[1] + k.shape[1] > q.stride(0) and q.shape[0] > 1:
        return None  # rows would overlap
    return q.as_strided((q.shape[0], q.shape[1] + k.shape[1]), q.stride())


class LinearScalingRotaryEmbedding(RotaryEmbedding):
    def __init__(self, *shape, scaling_factor: float):
        self.scaling_factor = float(scaling_factor)
        super().__init__(*shape)

    def _compute_inv_freq(self) -> torch.Tensor:
        return self._base_inv_freq(self.base) / self.scaling_factor


class DynamicNTKScalingRotaryEmbedding(RotaryEmbedding):
    """NTK-aware base, fixed at the scaled length (see the module docstring)."""

    def __init__(
        self,
        *shape,
        scaling_factor: float,
        original_max_position: int,
    ):
        self.scaling_factor = float(scaling_factor)
        self.original_max_position = int(original_max_position)
        super().__init__(*shape)

    def _compute_inv_freq(self) -> torch.Tensor:
        f, dim = self.scaling_factor, self.rotary_dim
        if self.max_position_embeddings <= self.original_max_position:
            # Serving within the original context: HF never rescales there.
            return self._base_inv_freq(self.base)
        seq_len = self.original_max_position * f
        base = self.base * ((f * seq_len / self.original_max_position) - (f - 1)) ** (
            dim / (dim - 2)
        )
        return self._base_inv_freq(base)


class Llama3RotaryEmbedding(RotaryEmbedding):
    def __init__(
        self,
        *shape,
        scaling_factor: float,
        low_freq_factor: float,
        high_freq_factor: float,
        original_max_position: int,
    ):
        self.scaling_factor = float(scaling_factor)
        self.low_freq_factor = float(low_freq_factor)
        self.high_freq_factor = float(high_freq_factor)
        self.original_max_position = int(original_max_position)
        super().__init__(*shape)

    def _compute_inv_freq(self) -> torch.Tensor:
        inv_freq = self._base_inv_freq(self.base)
        factor, low, high = self.scaling_factor, self.low_freq_factor, self.high_freq_factor
        low_freq_wavelen = self.original_max_position / low
        high_freq_wavelen = self.original_max_position / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (self.original_max_position / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)


class YaRNScalingRotaryEmbedding(RotaryEmbedding):
    def __init__(
        self,
        *shape,
        scaling_factor: float,
        original_max_position: int,
        beta_fast: float = 32,
        beta_slow: float = 1,
        attention_factor: Optional[float] = None,
        mscale: Optional[float] = None,
        mscale_all_dim: Optional[float] = None,
        truncate: bool = True,
    ):
        self.scaling_factor = float(scaling_factor)
        self.original_max_position = int(original_max_position)
        self.beta_fast, self.beta_slow, self.truncate = beta_fast, beta_slow, truncate
        self._attention_factor = _yarn_attention_factor(
            self.scaling_factor, attention_factor, mscale, mscale_all_dim
        )
        super().__init__(*shape)

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        self.mscale = self._attention_factor
        return super()._compute_cos_sin_cache()

    def _compute_inv_freq(self) -> torch.Tensor:
        dim, base = self.rotary_dim, self.base

        def correction_dim(num_rotations: float) -> float:
            return (dim * math.log(self.original_max_position / (num_rotations * 2 * math.pi))) / (
                2 * math.log(base)
            )

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # avoid a zero-width ramp
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)  # [dim / 2]
        extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (self.scaling_factor * pos_freqs)
        extrapolation_factor = 1 - ramp
        return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


class Phi3LongRoPEScaledRotaryEmbedding(RotaryEmbedding):
    """LongRoPE: per-frequency divisors (``short_factor`` or ``long_factor``, rotary_dim / 2
    each) and one attention factor on cos/sin. The list is chosen once from the served
    length (``max_position_embeddings`` here is the cache size): see the module docstring."""

    def __init__(
        self,
        *shape,
        short_factor,
        long_factor,
        original_max_position: int,
        scaling_factor: float,
        attention_factor: Optional[float] = None,
    ):
        _, rotary_dim, max_position_embeddings = shape[:3]
        for name, factors in (("short_factor", short_factor), ("long_factor", long_factor)):
            if factors is None or len(factors) != rotary_dim // 2:
                raise ValueError(
                    f"longrope {name} must list rotary_dim / 2 = {rotary_dim // 2} values, "
                    f"got {None if factors is None else len(factors)}"
                )
        self.original_max_position = int(original_max_position)
        self.use_long_factor = max_position_embeddings > self.original_max_position
        chosen = long_factor if self.use_long_factor else short_factor
        self.ext_factors = torch.tensor(chosen, dtype=torch.float32)  # [rotary_dim / 2]
        if attention_factor is None:
            f = float(scaling_factor)
            attention_factor = (
                math.sqrt(1 + math.log(f) / math.log(self.original_max_position)) if f > 1 else 1.0
            )
        self._attention_factor = float(attention_factor)
        super().__init__(*shape)

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        self.mscale = self._attention_factor
        return super()._compute_cos_sin_cache()

    def _compute_inv_freq(self) -> torch.Tensor:
        exponent = (
            torch.arange(0, self.rotary_dim, 2, dtype=torch.int64).to(torch.float32)
            / self.rotary_dim
        )
        # Same operation order as HF (factor times base power), for bit-equal frequencies.
        return 1.0 / (self.ext_factors * self.base**exponent)  # [rotary_dim / 2]


def _yarn_attention_factor(factor: float, attention_factor, mscale, mscale_all_dim) -> float:
    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is not None:
        return float(attention_factor)
    if mscale and mscale_all_dim:
        return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
    return get_mscale(factor)


def rope_parameters_from_config(cfg: Mapping[str, Any]) -> Dict[str, Any]:
    """One flat dict ``{rope_type, rope_theta, partial_rotary_factor, ...scaling keys}`` from
    either config.json format: transformers 5 ``rope_parameters`` or the older
    ``rope_theta`` + ``rope_scaling`` (with ``type`` or ``rope_type``)."""
    params: Dict[str, Any] = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    for key, value in scaling.items():
        params.setdefault(key, value)
    if "rope_type" not in params:
        params["rope_type"] = params.get("type", "default")
    params.pop("type", None)
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    params.setdefault("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if params["rope_type"] == "su":  # Phi-3's early name for longrope
        params["rope_type"] = "longrope"
    if params["rope_type"] in ("llama3", "yarn", "longrope") and cfg.get(
        "original_max_position_embeddings"
    ):
        # As in HF: a top-level value (Phi-3 keeps it there) wins over the rope dict's.
        params["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    return params


_ROPE_CACHE: Dict[Tuple, RotaryEmbedding] = {}


def get_rope(
    head_size: int,
    max_position: int,
    rope_parameters: Mapping[str, Any],
    max_position_embeddings: int,
    is_neox_style: bool = True,
) -> RotaryEmbedding:
    """The rotary embedding for ``rope_parameters`` (from ``rope_parameters_from_config``).
    ``max_position`` sizes the cache (the served max_model_len);
    ``max_position_embeddings`` is the config's, the reference length of dynamic NTK and
    the fallback ``original_max_position_embeddings``."""
    key = (
        head_size,
        max_position,
        max_position_embeddings,
        is_neox_style,
        _freeze(rope_parameters),
    )
    if key not in _ROPE_CACHE:
        _ROPE_CACHE[key] = _build_rope(
            head_size, max_position, dict(rope_parameters), max_position_embeddings, is_neox_style
        )
    return _ROPE_CACHE[key]


def _build_rope(
    head_size: int,
    max_position: int,
    p: Dict[str, Any],
    max_position_embeddings: int,
    is_neox_style: bool,
) -> RotaryEmbedding:
    rope_type = p.get("rope_type") or "default"
    rotary_dim = int(head_size * float(p.get("partial_rotary_factor") or 1.0))
    args = (head_size, rotary_dim, max_position, float(p.get("rope_theta", 10000.0)), is_neox_style)
    original = int(p.get("original_max_position_embeddings") or max_position_embeddings)
    if rope_type == "default":
        return RotaryEmbedding(*args)
    if rope_type == "linear":
        return LinearScalingRotaryEmbedding(*args, scaling_factor=p["factor"])
    if rope_type == "dynamic":
        return DynamicNTKScalingRotaryEmbedding(
            *args, scaling_factor=p["factor"], original_max_position=max_position_embeddings
        )
    if rope_type == "llama3":
        return Llama3RotaryEmbedding(
            *args,
            scaling_factor=p["factor"],
            low_freq_factor=p["low_freq_factor"],
            high_freq_factor=p["high_freq_factor"],
            original_max_position=original,
        )
    if rope_type == "yarn":
        factor = p.get("factor") or max_position_embeddings / original
        return YaRNScalingRotaryEmbedding(
            *args,
            scaling_factor=factor,
            original_max_position=original,
            beta_fast=p.get("beta_fast") or 32,
            beta_slow=p.get("beta_slow") or 1,
            attention_factor=p.get("attention_factor"),
            mscale=p.get("mscale"),
            mscale_all_dim=p.get("mscale_all_dim"),
            truncate=p.get("truncate", True),
        )
    if rope_type == "longrope":
        return Phi3LongRoPEScaledRotaryEmbedding(
            *args,
            short_factor=p.get("short_factor"),
            long_factor=p.get("long_factor"),
            original_max_position=original,
            scaling_factor=p.get("factor") or max_position_embeddings / original,
            attention_factor=p.get("attention_factor"),
        )
    raise ValueError(
        f"unsupported rope_type {rope_type!r}; "
        "supported: default, linear, dynamic, llama3, yarn, longrope"
    )


def _freeze(d: Mapping[str, Any]) -> Tuple:
    return tuple(
        sorted(
            (k, _freeze(v) if isinstance(v, Mapping) else (tuple(v) if isinstance(v, list) else v))
            for k, v in d.items()
        )
    )
