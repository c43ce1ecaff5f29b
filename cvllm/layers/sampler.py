"""Token sampling from the last-position logits of a step.

Runs on rank 0 only (the other ranks never see logits past the LM head). The model runner
builds one ``SamplingTensors`` per step with ``SamplingTensors.from_lists``
(``layers/sampling_tensors.py``) from the step's per-row values and rank 0's
``SamplingBatch`` (token histories, structured-output bitmask), and calls ``Sampler`` with
the logits ``[S, V]`` (S sampled rows, V vocab). Everything stays on the logits' device;
only ``SamplerOutput.sampled`` (and logprobs, when asked for) ever needs to go to the host.

Conventions:
- Order: repetition penalty (HF/CTRL: divide positive logits, multiply negative ones,
  over prompt+output tokens) -> frequency & presence penalties (OpenAI, output tokens
  only) -> structured-output bitmask (disallowed tokens to -inf) -> greedy rows take the
  argmax -> temperature -> top-k -> top-p -> min-p -> sample.
- Logprobs follow vLLM's default ("raw logprobs"): log_softmax of the model's logits,
  before penalties, temperature and truncation, so they describe the model, not the
  sampling recipe.
- Sampling is an exponential race, argmax(p / E) with E ~ Exp(1): one argmax per row, no
  multinomial and no host sync. A seeded row draws E from a generator seeded by
  (seed, output_index), so its token does not depend on the rest of the batch.
- On CUDA the same steps run in ``kernels/sampling.py`` (Triton): E comes from Philox
  keyed by the same (seed, output_index) mix, so seeded rows are reproducible there too,
  but draw other tokens than the torch generators would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from cvllm.kernels.transfer import to_device
from cvllm.layers.sampling_tensors import SamplingTensors

_MASK64 = (1 << 64) - 1


def apply_bitmask(logits: torch.Tensor, t: "SamplingTensors") -> torch.Tensor:
    """Constrained rows' disallowed tokens to -inf; a new tensor when any row is masked."""
    if t.allowed is None:
        return logits
    logits = logits.clone()
    rows = logits.index_select(0, t.mask_rows)  # [R, V]
    logits.index_copy_(0, t.mask_rows, rows.masked_fill_(~t.allowed, float("-inf")))
    return logits


@dataclass
class SamplerOutput:
    """What the sampler returns for one step; lives on the logits' device (rank 0)."""

    sampled: torch.Tensor  # [S] int64
    logprobs: Optional[torch.Tensor]  # [S] float32, raw-model logprob of the sampled token
    # (None when the caller said no row wants logprobs: ``Sampler.forward``'s ``logprobs``)
    top_logprob_ids: Optional[torch.Tensor] = None  # [S, k] int64 when num_logprobs > 0
    top_logprob_values: Optional[torch.Tensor] = None  # [S, k] float32 when num_logprobs > 0


def _row_seed(seed: int, output_index: int) -> int:
    """Mix (seed, output_index) with splitmix64 so neighbouring steps get unrelated streams."""
    x = (seed * 0x9E3779B97F4A7C15 + output_index + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


def apply_penalties(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Repetition, then frequency and presence penalties; returns a new tensor [S, V]."""
    if t.do_repetition:
        assert t.output_counts is not None and t.prompt_mask is not None
        seen = t.prompt_mask | (t.output_counts > 0)  # [S, V]
        rp = t.repetition_penalty.unsqueeze(1)  # [S, 1]
        penalized = torch.where(logits > 0, logits / rp, logits * rp)
        logits = torch.where(seen, penalized, logits)
    if t.do_freq_presence:
        assert t.output_counts is not None
        counts = t.output_counts.to(logits.dtype)  # [S, V]
        logits = (logits - t.frequency_penalty.unsqueeze(1) * counts
                  - t.presence_penalty.unsqueeze(1) * (counts > 0).to(logits.dtype))
    return logits


def apply_top_k_top_p(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and top-p sets; [S, V] -> [S, V]."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)  # [S, V]
    vocab = logits.shape[-1]
    if t.do_top_k:
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)  # [1, V]
        sorted_logits = sorted_logits.masked_fill(ranks >= t.top_k.unsqueeze(1), float("-inf"))
    if t.do_top_p:
        probs = sorted_logits.softmax(dim=-1)  # [S, V], after top-k as in vLLM
        mass_before = probs.cumsum(dim=-1) - probs  # [S, V]
        # Keep a token while the mass before it is below top_p: the smallest set that
        # reaches top_p. Rows at top_p == 1 are exempt: rounding must not drop their tail.
        drop = (mass_before >= t.top_p.unsqueeze(1)) & (t.top_p < 1.0).unsqueeze(1)
        drop[:, 0] = False  # the top token always survives
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def _argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` (first index of the maximum, NaN counting as the maximum, as
    torch's): through numpy for float32 CPU rows, 6-15x faster than torch's CPU argmax
    over a 49k vocabulary (65 -> 4 us a row, measured on the 2-core VM)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return torch.from_numpy(np.argmax(logits.numpy(), axis=-1).astype(np.int64))
    return logits.argmax(dim=-1)


class Sampler(torch.nn.Module):
    """Turns logits into one token per row. Rank 0 only; owned by the ModelRunner."""

    def __init__(self, generator: Optional[torch.Generator] = None):
        super().__init__()
        self.generator = generator
        """Generator for rows without a seed; None uses torch's default for the device."""

    def forward(self, logits: torch.Tensor, t: SamplingTensors,
                num_logprobs: int = 0, logprobs: bool = True,
                stats: Optional[tuple] = None) -> SamplerOutput:
        """``logits`` [S, V] float32 is not modified in place. ``logprobs`` False: no row
        wants them, so none are computed (on the CPU that skips the normaliser, a pass
        over [S, V]: 0.4 ms a step for the default model's 49k vocabulary; on CUDA two
        launches) and none are returned. ``stats`` (CUDA): ``row_stats(logits)`` made
        already (a decode graph's last kernels); an all-greedy step then launches
        nothing, its ids are ``stats[1]``."""
        if logits.dim() != 2 or logits.shape[0] != t.num_rows:
            raise ValueError(f"logits {tuple(logits.shape)} do not match {t.num_rows} rows")
        raw = logits
        if logits.is_cuda:
            from cvllm.kernels.sampling import row_stats

            raw = logits.float()
            if stats is not None and any(s.shape != (t.num_rows,) for s in stats):
                raise ValueError(f"stats {[tuple(s.shape) for s in stats]} do not match "
                                 f"{t.num_rows} rows")
            # One pass gives the row max, greedy tokens and logprob normaliser (torch's
            # single-row argmax / logsumexp are slow at batch 1); sampling reuses them.
            stats = row_stats(raw) if stats is None else stats  # (max, argmax, lse), each [S]
            sampled = self._sample_on_gpu(raw, t, stats)
            if not logprobs and not num_logprobs:  # no gather and subtract to launch
                return SamplerOutput(sampled=sampled, logprobs=None)
            return self._logprobs(raw, sampled, num_logprobs, stats[2])
        logits = apply_bitmask(apply_penalties(logits, t), t)
        sampled = _argmax_rows(logits)  # [S]
        if not t.all_greedy:
            random = self._sample(logits, t)  # [S]
            sampled = torch.where(t.is_greedy, sampled, random) if t.any_greedy else random
        if not logprobs and not num_logprobs:
            return SamplerOutput(sampled=sampled, logprobs=None)
        return self._logprobs(raw, sampled, num_logprobs)

    def _sample_on_gpu(self, logits: torch.Tensor, t: SamplingTensors,
                       stats: Optional[tuple] = None) -> torch.Tensor:
        """``forward``'s steps in Triton kernels: no [S, V] probs or noise in memory, and
        one launch for every seeded row instead of one generator each. ``stats``:
        ``row_stats(logits)`` when the caller has it (recomputed after penalties)."""
        from cvllm.kernels import sampling as ks

        logits = logits.float()
        if t.do_repetition or t.do_freq_presence:
            logits = ks.apply_penalties(
                logits, t.output_counts, t.prompt_mask if t.do_repetition else None,
                t.repetition_penalty, t.frequency_penalty if t.do_freq_presence else None,
                t.presence_penalty)
            stats = None
        if t.allowed is not None:
            logits = apply_bitmask(logits, t)
            stats = None
        if stats is None:
            stats = ks.row_stats(logits)
        if t.all_greedy:
            return stats[1]
        width = (t.max_top_k or logits.shape[-1]) if (t.do_top_k or t.do_top_p) else None
        return ks.sample(logits, t.temperature, t.top_k, t.top_p, t.min_p, t.is_greedy,
                         self._row_keys(t, logits.device), truncate_width=width,
                         do_top_p=t.do_top_p, row_max_argmax=stats[:2])

    def _row_keys(self, t: SamplingTensors, device: torch.device) -> torch.Tensor:
        """[S] int64 Philox keys: seeded rows mix (seed, output_index) as the torch path
        does; the others are drawn on the device from the sampler's generator (no sync)."""
        seeded = [s is not None and not g for s, g in zip(t.seeds, t.greedy)]
        keys = None
        if not all(seeded):
            keys = torch.randint(0, (1 << 63) - 1, (t.num_rows,), dtype=torch.int64,
                                 device=device, generator=self.generator)
        if any(seeded):
            fixed = to_device(np.array([_row_seed(int(s), i) if f else 0 for s, i, f in
                                        zip(t.seeds, t.output_index, seeded)], dtype=np.int64),
                              device)  # [S]
            if keys is None:
                return fixed
            mask = to_device(np.array(seeded, dtype=np.bool_), device)  # [S]
            keys = torch.where(mask, fixed, keys)
        return keys

    def _sample(self, logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        logits = logits / t.temperature.unsqueeze(1)  # [S, V]
        if t.do_top_k or t.do_top_p:
            logits = apply_top_k_top_p(logits, t)
        probs = logits.softmax(dim=-1)  # [S, V]
        if t.do_min_p:
            floor = t.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [S, 1]
            probs = probs.masked_fill(probs < floor, 0.0)
        noise = self._exponential_noise(probs, t)  # [S, V]
        return (probs / noise).argmax(dim=-1)  # [S]

    def _exponential_noise(self, probs: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        """Exp(1) noise [S, V]: seeded rows from their own stream, the rest from the global one."""
        noise = torch.empty_like(probs)
        # Greedy rows never read their noise, so they get no generator of their own.
        seeded = [i for i, s in enumerate(t.seeds) if s is not None and not t.greedy[i]]
        if len(seeded) < t.num_rows:
            noise.exponential_(generator=self.generator)
        vocab = probs.shape[-1]
        for i in seeded:
            gen = torch.Generator(device=probs.device)
            gen.manual_seed(_row_seed(int(t.seeds[i]), t.output_index[i]))
            noise[i] = torch.empty(vocab, device=probs.device).exponential_(generator=gen)
        # An exact 0 would turn p / 0 into inf (or nan for a masked token).
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)

    @staticmethod
    def _logprobs(raw: torch.Tensor, sampled: torch.Tensor, num_logprobs: int,
                  lse: Optional[torch.Tensor] = None) -> SamplerOutput:
        # logsumexp + gather avoids materializing a full [S, V] log_softmax.
        if lse is None:
            lse = raw.logsumexp(dim=-1)  # [S]
        chosen = raw.gather(1, sampled.unsqueeze(1)).squeeze(1) - lse  # [S]
        out = SamplerOutput(sampled=sampled, logprobs=chosen)
        if num_logprobs > 0:
            k = min(num_logprobs, raw.shape[-1])
            values, ids = raw.topk(k, dim=-1)  # [S, k]
            out.top_logprob_ids = ids
            out.top_logprob_values = values - lse.unsqueeze(1)
        return out
