"""Transcriptions of ``layers/sampler.py`` (its torch path is the semantic reference),
in the calling conventions of ``kernels/sampling.py``."""

from __future__ import annotations

from typing import Optional

import torch


def apply_penalties_ref(
    logits: torch.Tensor,  # [S, V] float32
    output_counts: torch.Tensor,  # [S, V] int: occurrences in the output
    prompt_mask: Optional[torch.Tensor],  # [S, V] bool: token in the prompt
    repetition_penalty: Optional[torch.Tensor],  # [S]
    frequency_penalty: Optional[torch.Tensor],  # [S]
    presence_penalty: Optional[torch.Tensor],  # [S]
) -> torch.Tensor:
    """Repetition (over prompt and output tokens: divide positive logits, multiply
    negative ones), then ``- frequency * count - presence * (count > 0)``; a new tensor."""
    if prompt_mask is not None and repetition_penalty is not None:
        seen = prompt_mask | (output_counts > 0)  # [S, V]
        rp = repetition_penalty.unsqueeze(1)  # [S, 1]
        logits = torch.where(seen, torch.where(logits > 0, logits / rp, logits * rp), logits)
    if frequency_penalty is not None and presence_penalty is not None:
        counts = output_counts.to(logits.dtype)  # [S, V]
        logits = (logits - frequency_penalty.unsqueeze(1) * counts
                  - presence_penalty.unsqueeze(1) * (counts > 0).to(logits.dtype))
    return logits.clone()


def sample_ref(
    logits: torch.Tensor,  # [S, V] float32, penalized
    temperature: torch.Tensor,  # [S] float32
    top_k: torch.Tensor,  # [S] int64; V = off
    top_p: torch.Tensor,  # [S] float32; 1 = off
    min_p: torch.Tensor,  # [S] float32; 0 = off
    is_greedy: torch.Tensor,  # [S] bool
    noise: torch.Tensor,  # [S, V] float32 Exp(1) draws
) -> torch.Tensor:
    """``[S]`` int64: greedy rows the argmax; the others ``argmax(probs / noise)`` after
    temperature -> top-k (by rank) -> top-p (smallest prefix whose mass reaches top_p,
    after top-k, the top token always kept, rows at 1 exempt) -> min-p (below
    ``min_p * max prob`` -> 0). Every stage runs; an off value makes it a no-op."""
    greedy = logits.argmax(dim=-1)  # [S]
    scaled = logits / temperature.unsqueeze(1)  # [S, V]
    sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True)  # [S, V]
    ranks = torch.arange(scaled.shape[-1], device=logits.device).unsqueeze(0)  # [1, V]
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # [S, V]
    drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    scaled = torch.empty_like(scaled).scatter_(-1, sorted_idx, sorted_logits)
    probs = scaled.softmax(dim=-1)  # [S, V]
    floor = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [S, 1]
    probs = probs.masked_fill(probs < floor, 0.0)
    race = (probs / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)  # [S]
    return torch.where(is_greedy, greedy, race)
