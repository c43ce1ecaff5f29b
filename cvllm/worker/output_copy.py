"""Rank 0's sampled tokens to the host: one device-to-host copy per step.

Owned by the ``ModelRunner`` on rank 0. ``OutputCopy.fetch`` packs what the engine needs
from a ``SamplerOutput`` into one tensor -- the sampled ids alone (int64) in the common
case, or ids, logprobs and top-k ids / logprobs side by side (float64, exact for ids below
2**53) when a row asked for logprobs -- and copies it, non-blocking, into a pinned host
buffer, then waits on an event recorded right after the copy. That event is the step's
only wait on the device: everything before it was launched without a host sync, so
the host can prepare work while the GPU runs. On the CPU it is a plain copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from cvllm.layers.sampler import SamplerOutput


@dataclass
class StepResult:
    """Rank 0's result of one step: one entry per sampling row, on the host."""

    token_ids: np.ndarray  # [S] int64
    logprobs: Optional[np.ndarray] = None  # [S] float32, when any row asked for them
    top_ids: Optional[np.ndarray] = None  # [S, k]
    top_logprobs: Optional[np.ndarray] = None  # [S, k]


class OutputCopy:
    def __init__(self, device: torch.device):
        self.device = device
        self._pinned = device.type == "cuda"
        self._host: Optional[torch.Tensor] = None  # flat pinned buffer, grown on demand
        self._event = torch.cuda.Event() if self._pinned else None
        self.num_copies = 0
        """Device-to-host copies made so far (tests check there is one per step)."""

    def fetch(self, out: SamplerOutput, with_logprobs: bool, num_top: int) -> StepResult:
        """``out``'s rows on the host; logprobs when ``with_logprobs``, plus ``num_top``
        top entries per row when the sampler made them."""
        S = int(out.sampled.shape[0])
        top = num_top if with_logprobs and num_top > 0 and out.top_logprob_ids is not None else 0
        if not with_logprobs:
            return StepResult(token_ids=self._to_host(out.sampled.reshape(S, 1))[:, 0].copy())
        cols = [out.sampled.reshape(S, 1), out.logprobs.reshape(S, 1)]
        if top:
            cols += [out.top_logprob_ids, out.top_logprob_values]
        packed = self._to_host(torch.cat([c.to(torch.float64) for c in cols], dim=1))  # [S, 2+2k]
        res = StepResult(token_ids=packed[:, 0].astype(np.int64),
                         logprobs=packed[:, 1].astype(np.float32))
        if top:
            res.top_ids = packed[:, 2:2 + top].astype(np.int64)
            res.top_logprobs = packed[:, 2 + top:].astype(np.float32)
        return res

    def _to_host(self, t: torch.Tensor) -> np.ndarray:
        """One copy of ``t`` (2-D, int64 or float64) to the host; the returned array is a
        view of the reused host buffer, valid until the next call."""
        self.num_copies += 1
        if not self._pinned:
            return t.cpu().numpy()
        nbytes = t.numel() * t.element_size()
        if self._host is None or self._host.numel() < nbytes:
            self._host = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8, pin_memory=True)
        host = self._host[:nbytes].view(t.dtype).view(t.shape)
        host.copy_(t.contiguous(), non_blocking=True)
        self._event.record()
        self._event.synchronize()
        return host.numpy()
