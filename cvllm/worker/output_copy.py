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
from typing import List, Optional

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


class PendingOutput:
    """A step's sampled ids (and logprobs) on their way to the host: ``wait()`` blocks
    on the copy's event -- the only host sync of a step on the device -- and unpacks."""

    def __init__(self, host: Optional[torch.Tensor], event, device_tensor: Optional[torch.Tensor],
                 S: int, with_logprobs: bool, top: int):
        self._host, self._event, self._dev = host, event, device_tensor
        self._S, self._with_logprobs, self._top = S, with_logprobs, top

    def wait(self) -> StepResult:
        if self._event is not None:
            self._event.synchronize()
            arr = self._host.numpy()
        else:
            arr = self._dev.cpu().numpy()
        if not self._with_logprobs:
            return StepResult(token_ids=arr[:, 0].copy())
        top = self._top
        res = StepResult(token_ids=arr[:, 0].astype(np.int64), logprobs=arr[:, 1].astype(np.float32))
        if top:
            res.top_ids = arr[:, 2:2 + top].astype(np.int64)
            res.top_logprobs = arr[:, 2 + top:].astype(np.float32)
        return res


class OutputCopy:
    """Two pinned host buffers used in turn, so the copy of step N+1 (overlapped loop)
    never overwrites step N's ids before they are read."""

    NUM_BUFFERS = 2

    def __init__(self, device: torch.device):
        self.device = device
        self._pinned = device.type == "cuda"
        self._hosts: List[Optional[torch.Tensor]] = [None] * self.NUM_BUFFERS
        self._events = [torch.cuda.Event() if self._pinned else None for _ in self._hosts]
        self._next = 0
        self.num_copies = 0
        """Device-to-host copies made so far (tests check there is one per step)."""

    def fetch(self, out: SamplerOutput, with_logprobs: bool, num_top: int) -> StepResult:
        """``start`` then ``wait``: the step's rows on the host."""
        return self.start(out, with_logprobs, num_top).wait()

    def start(self, out: SamplerOutput, with_logprobs: bool, num_top: int) -> PendingOutput:
        """Launch the one copy of ``out``'s rows (logprobs when ``with_logprobs``, plus
        ``num_top`` top entries per row when the sampler made them); no host sync."""
        S = int(out.sampled.shape[0])
        top = num_top if with_logprobs and num_top > 0 and out.top_logprob_ids is not None else 0
        if not with_logprobs:
            packed = out.sampled.reshape(S, 1)  # [S, 1] int64
        else:
            cols = [out.sampled.reshape(S, 1), out.logprobs.reshape(S, 1)]
            if top:
                cols += [out.top_logprob_ids, out.top_logprob_values]
            packed = torch.cat([c.to(torch.float64) for c in cols], dim=1)  # [S, 2+2k]
        self.num_copies += 1
        if not self._pinned:
            return PendingOutput(None, None, packed, S, with_logprobs, top)
        i, self._next = self._next, (self._next + 1) % self.NUM_BUFFERS
        nbytes = packed.numel() * packed.element_size()
        if self._hosts[i] is None or self._hosts[i].numel() < nbytes:
            self._events[i].synchronize()  # a copy into the old buffer may still run
            self._hosts[i] = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8, pin_memory=True)
        host = self._hosts[i][:nbytes].view(packed.dtype).view(packed.shape)
        host.copy_(packed.contiguous(), non_blocking=True)
        self._events[i].record()
        return PendingOutput(host, self._events[i], None, S, with_logprobs, top)
