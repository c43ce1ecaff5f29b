"""Token sampling from the last-position logits of a step.

Runs on rank 0 only (the other ranks never see logits past the LM head). The model runner
builds one ``SamplingTensors`` per step with ``SamplingTensors.from_lists`` from the step's
per-row values and rank 0's ``SamplingBatch`` (token histories, structured-output
bitmask), and calls ``Sampler`` with
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

from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import numpy as np
import torch

from cvllm.kernels.transfer import to_device

_GREEDY_EPS = 1e-5
_MASK64 = (1 << 64) - 1


def _device_row(table: int, row: Optional[int], doc: str) -> property:
    """A per-row value of ``SamplingTensors``: row ``row`` of its device table ``table``
    (``_device_values``; None: the whole table), copied to the device when first read."""
    def get(self) -> torch.Tensor:
        values = self._device_values()[table]
        return values if row is None else values[row]
    return property(get, doc=doc)


@dataclass
class SamplingTensors:
    """Per-row sampling values of one step, on the logits' device (rank 0). The per-row
    values (``temperature`` .. ``is_greedy``) go to the device on first use, in two
    pinned copies: a step whose rows are all greedy, with no penalty, reads none of
    them and copies nothing (batch-1 greedy decode: two copies and a kernel less a step)."""

    host_floats: np.ndarray
    """[6, S] float32: temperature (greedy rows hold 1.0: they never divide), top_p, min_p,
    presence, frequency and repetition penalties."""
    host_ints: np.ndarray
    """[2, S] int64: top_k (V where disabled), greedy (0 / 1)."""
    device: torch.device
    output_counts: Optional[torch.Tensor]
    """[S, V] int32 occurrences of each token in the output; None when no row penalizes."""
    prompt_mask: Optional[torch.Tensor]
    """[S, V] bool, token present in the prompt; None when no row has a repetition penalty."""
    seeds: List[Optional[int]]
    """Host-side per-row seeds (None: the sampler's global generator)."""
    output_index: List[int]
    """Host-side number of tokens each row generated before this step."""
    greedy: List[bool]
    """Host-side copy of ``is_greedy``."""
    # Host-side flags, so unused stages cost nothing and never need a device sync.
    all_greedy: bool
    any_greedy: bool
    do_top_k: bool
    do_top_p: bool
    do_min_p: bool
    do_repetition: bool
    do_freq_presence: bool
    max_top_k: int = 0
    """Largest top-k of the sampled rows, V where one has none: the columns the GPU
    sampler must rank (host-side, so choosing ``topk`` over a full sort needs no sync)."""
    mask_rows: Optional[torch.Tensor] = None
    """[R] int64 rows constrained by structured output; None when no row is."""
    allowed: Optional[torch.Tensor] = None
    """[R, V] bool, the tokens each constrained row may take (from the bitmask)."""

    _values: Optional[tuple] = field(default=None, repr=False, compare=False)

    def _device_values(self) -> tuple:
        if self._values is None:
            floats = to_device(self.host_floats, self.device)  # [6, S]
            ints = to_device(self.host_ints, self.device)  # [2, S]
            self._values = (floats, ints, ints[1].bool())
        return self._values

    temperature = _device_row(0, 0, "[S] float32; greedy rows hold 1.0 (they never divide)")
    top_p = _device_row(0, 1, "[S] float32")
    min_p = _device_row(0, 2, "[S] float32")
    presence_penalty = _device_row(0, 3, "[S] float32")
    frequency_penalty = _device_row(0, 4, "[S] float32")
    repetition_penalty = _device_row(0, 5, "[S] float32")
    top_k = _device_row(1, 0, "[S] int64; V where disabled")
    is_greedy = _device_row(2, None, "[S] bool")

    @property
    def num_rows(self) -> int:
        return len(self.seeds)

    @classmethod
    def from_lists(
        cls,
        temperature: Sequence[float],
        top_p: Sequence[float],
        top_k: Sequence[int],
        min_p: Sequence[float],
        presence_penalty: Sequence[float],
        frequency_penalty: Sequence[float],
        repetition_penalty: Sequence[float],
        seeds: Sequence[Optional[int]],
        output_index: Sequence[int],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device | str,
        mask_rows: Optional[np.ndarray] = None,
        bitmask: Optional[np.ndarray] = None,
    ) -> "SamplingTensors":
        columns = [temperature, top_p, top_k, min_p, presence_penalty, frequency_penalty,
                   repetition_penalty, seeds, output_index, prompt_token_ids, output_token_ids]
        num_rows = len(temperature)
        if any(len(c) != num_rows for c in columns):
            lengths = [len(c) for c in columns]
            raise ValueError(f"sampling lists disagree on the row count: {lengths}")
        greedy = [t < _GREEDY_EPS for t in temperature]
        # Disabled top-k becomes V so that the masking below is a no-op for that row.
        ks = [k if 0 < k < vocab_size else vocab_size for k in top_k]
        rep = [r != 1.0 for r in repetition_penalty]
        fp = [f != 0.0 or p != 0.0 for f, p in zip(frequency_penalty, presence_penalty)]
        # Greedy rows skip temperature/top-k/top-p/min-p; their values are neutralized.
        sampled = [not g for g in greedy]

        # The per-row values go to the device in two pinned copies (kernels/transfer.py),
        # when first read.
        floats = np.array([[1.0 if g else t for g, t in zip(greedy, temperature)],
                           top_p, min_p, presence_penalty, frequency_penalty,
                           repetition_penalty], dtype=np.float32).reshape(6, num_rows)
        ints = np.array([ks, greedy], dtype=np.int64).reshape(2, num_rows)
        # Only rows that penalize contribute ids: the others' histories are never read.
        out_ids = [o if (r or q) else () for o, r, q in zip(output_token_ids, rep, fp)]
        rows = allowed = None
        if bitmask is not None and mask_rows is not None and len(mask_rows):
            rows = to_device(np.asarray(mask_rows, dtype=np.int64), device)  # [R]
            allowed = unpack_bitmask(to_device(bitmask, device), vocab_size)  # [R, V]
        output_counts = prompt_mask = None
        if any(rep) or any(fp):
            output_counts = _token_counts(out_ids, vocab_size, device)  # [S, V]
        if any(rep):
            prompt_ids = [p if r else () for p, r in zip(prompt_token_ids, rep)]
            prompt_mask = _token_counts(prompt_ids, vocab_size, device) > 0  # [S, V]
        return cls(
            host_floats=floats,
            host_ints=ints,
            device=torch.device(device),
            output_counts=output_counts,
            prompt_mask=prompt_mask,
            seeds=list(seeds),
            output_index=[int(i) for i in output_index],
            greedy=greedy,
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            do_top_k=any(s and k < vocab_size for s, k in zip(sampled, ks)),
            do_top_p=any(s and p < 1.0 for s, p in zip(sampled, top_p)),
            do_min_p=any(s and m > 0.0 for s, m in zip(sampled, min_p)),
            do_repetition=any(rep),
            do_freq_presence=any(fp),
            max_top_k=max((k for s, k in zip(sampled, ks) if s), default=vocab_size),
            mask_rows=rows,
            allowed=allowed,
        )


_BIT_SHIFTS: dict = {}


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[R, W]`` int32 (bit j of word i allows token 32 i + j) -> ``[R, V]`` bool. A row
    that allows nothing (a grammar engine fault) allows everything instead, so sampling
    never meets a row of -inf; the engine's matcher then rejects the token and ends it."""
    key = bitmask.device
    shifts = _BIT_SHIFTS.get(key)
    if shifts is None:
        shifts = _BIT_SHIFTS[key] = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    R, W = bitmask.shape
    if W * 32 < vocab_size:
        raise ValueError(f"a bitmask of {W} words cannot cover {vocab_size} tokens")
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, W, 32]
    allowed = bits.reshape(R, W * 32)[:, :vocab_size].bool()  # [R, V]
    return allowed | ~allowed.any(dim=-1, keepdim=True)


def apply_bitmask(logits: torch.Tensor, t: "SamplingTensors") -> torch.Tensor:
    """Constrained rows' disallowed tokens to -inf; a new tensor when any row is masked."""
    if t.allowed is None:
        return logits
    logits = logits.clone()
    rows = logits.index_select(0, t.mask_rows)  # [R, V]
    logits.index_copy_(0, t.mask_rows, rows.masked_fill_(~t.allowed, float("-inf")))
    return logits


def _token_counts(rows: Sequence[Sequence[int]], vocab_size: int,
                  device: torch.device | str) -> torch.Tensor:
    """Occurrences of each token id per row, via one scatter_add on padded ids."""
    num_rows = len(rows)
    max_len = max((len(r) for r in rows), default=0)
    # Padding points at an extra column V that is dropped afterwards.
    padded = np.full((num_rows, max(max_len, 1)), vocab_size, dtype=np.int64)  # [S, L]
    for i, r in enumerate(rows):
        padded[i, : len(r)] = r
    ids = to_device(padded, device)  # [S, L]
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.int32, device=device)  # [S, V+1]
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.int32))
    return counts[:, :vocab_size]  # [S, V]


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
