"""The budget for the float copies a quantized weight's backend may keep for batched calls.

Batch copies (``--cpu-dense-gb``): a backend may keep a float copy beside a weight's
blocks that multiplies batches faster (the CPU's bf16 copy for decode batches of a few
rows and up, where the CPU has AMX or AVX-512 BF16). The copies are granted in loading
order until the budget runs out; the rest of the weights multiply every batch from their
blocks. The budget is made by the GGUF config (``quantization/gguf.py``) when the model's
first layer asks for its method (one model per config: each rank builds its own engine
config); its methods (``quantization/gguf_methods.py``) spend it as their weights load.
"""

from __future__ import annotations

from typing import Optional


class BatchCopyBudget:
    """Bytes the backends may spend on float copies for batched calls, granted first come
    first served (one budget per rank)."""

    def __init__(self, nbytes: int):
        self.left = max(0, int(nbytes))
        self.granted = [0, 0]  # weights, bytes
        self.refused = [0, 0]

    def take(self, nbytes: int) -> bool:
        """Whether a copy of ``nbytes`` fits (and is then counted as kept)."""
        if nbytes <= 0:
            return False
        if nbytes > self.left:
            self.refused[0] += 1
            self.refused[1] += nbytes
            return False
        self.left -= nbytes
        self.granted[0] += 1
        self.granted[1] += nbytes
        return True

    def note(self) -> str:
        if not self.granted[0] and not self.refused[0]:
            return ""
        line = (f"batch copies: {self.granted[0]} weights kept a bf16 copy for decode "
                f"batches ({self.granted[1] / 2**20:.0f} MiB, counted above)")
        if self.refused[0]:
            line += (f"; {self.refused[0]} did not fit the budget "
                     f"({self.refused[1] / 2**20:.0f} MiB more; raise --cpu-dense-gb)")
        return line


def batch_copy_budget(setting_gib: Optional[float]) -> int:
    """``--cpu-dense-gb`` in bytes; None (auto): a quarter of the memory available now where
    the copies pay (``ggml_cpu.batch_copy_pays``: AMX or AVX-512 BF16), else none."""
    if setting_gib is not None:
        return int(setting_gib * 2**30)
    from cvllm.kernels.quant.ggml_cpu import batch_copy_pays

    if not batch_copy_pays():
        return 0
    import psutil

    return psutil.virtual_memory().available // 4
