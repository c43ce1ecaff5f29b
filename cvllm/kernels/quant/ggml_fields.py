"""Bit fields of GGML blocks in plain torch: the helpers the reference dequantizer
(``reference.py``) and the CPU backend's integer forms (``ggml_cpu.py``) both read blocks
with, so both decode a block the same way. Vectorized over all blocks, no state; runs on
whatever device the bytes live on.

Block layouts follow ggml's ``block_*`` structs (ggml-common.h). Shapes: ``M`` blocks,
``S`` bytes per block.
"""

from __future__ import annotations

import functools
from typing import Tuple

import torch

# The 16 non-uniform levels of IQ4_NL / IQ4_XS (ggml's kvalues_iq4nl).
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def fields(b: torch.Tensor, width: int) -> torch.Tensor:
    """Split each byte of ``b [.., n]`` into its ``8 // width`` bit fields, lowest first:
    ``[.., 8 // width, n]`` uint8. ggml packs a block's elements field-major (all low
    nibbles, then all high nibbles), so the new axis sits before the byte axis."""
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=b.device)
    return (b.unsqueeze(-2) >> shifts.view(-1, 1)) & ((1 << width) - 1)  # [.., F, n]


def dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous at an aligned offset, so a dtype view of it is legal whatever slice
    of a larger buffer it came from."""
    if t.is_contiguous() and t.storage_offset() % 8 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The little-endian f16 at byte ``offset`` of each block of ``blocks [M, S]``, as
    float32 ``[M, 1]`` (ggml widens every f16 scale before multiplying)."""
    return dense(blocks[:, offset:offset + 2]).view(torch.float16).float()  # [M, 1]


def signed(b: torch.Tensor) -> torch.Tensor:
    """Reinterpret uint8 bytes as int8 (same element size: legal on any strides)."""
    return b.view(torch.int8)


@functools.lru_cache(maxsize=None)
def iq4_levels(device: torch.device) -> torch.Tensor:
    """IQ4 levels as float32 ``[16]`` on ``device``; cached so a CUDA call copies it once."""
    return torch.tensor(IQ4_LEVELS, dtype=torch.float32, device=device)


def q5_low_high(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """5-bit values ``[M, 32]`` of a Q5_0 / Q5_1 block: nibbles ``low [M, 16]`` plus bit j
    of the little-endian u32 ``high [M, 4]`` as bit 4 of element j."""
    ql = fields(low, 4).reshape(-1, 32)  # [M, 32]
    qh = fields(high, 1).transpose(-1, -2).reshape(-1, 32)  # [M, 32], byte-major bits
    return ql | (qh << 4)


def q3_k_scales(sc: torch.Tensor) -> torch.Tensor:
    """Sixteen 6-bit scales of a Q3_K block from its 12 bytes ``sc [M, 12]``: low nibbles
    from bytes 0..7 (scales 0..7 low, 8..15 high), 2 high bits from bytes 8..11 (scale s at
    byte 8 + s % 4, bits 2 * (s // 4)); stored biased by 32. int ``[M, 16]``."""
    low = fields(sc[:, 0:8], 4).reshape(-1, 16)  # [M, 16]
    high = fields(sc[:, 8:12], 2).reshape(-1, 16)  # [M, 16]
    return (low | (high << 4)).to(torch.int32) - 32


def k_scale_min(sc: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Eight 6-bit (scale, min) pairs of a Q4_K / Q5_K block from ``sc [M, 12]``
    (ggml's get_scale_min_k4): pairs 0..3 in the low 6 bits of bytes 0..3 / 4..7, pairs
    4..7 from the nibbles of bytes 8..11 plus the top 2 bits of bytes 0..3 / 4..7.
    Two float32 ``[M, 8, 1]``."""
    a, b, c = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]  # [M, 4] each
    scale = torch.cat([a & 63, (c & 0xF) | ((a >> 6) << 4)], dim=-1)  # [M, 8]
    mins = torch.cat([b & 63, (c >> 4) | ((b >> 6) << 4)], dim=-1)  # [M, 8]
    return scale.float().unsqueeze(-1), mins.float().unsqueeze(-1)
