"""Paged attention in Triton, one module per kind: the K/V cache write (``kv_write``),
decode (``decode``: one query a sequence, split along the keys) and variable-length
(chunked) prefill (``prefill``); ``common`` holds the cache layout, the device helpers
decode and prefill share and their tile plans, ``checks`` the host-side input checks.

Called by ``attention/backends/triton_backend.py`` once per layer per step (through the
names below) and ``kernels/rotary.rotary_write_kv`` (the write fused with the rotary
embedding); the torch oracles, in the same calling conventions, are in
``kernels/reference/paged_attention.py`` (tests: tests/kernels/test_paged_attention.py and
test_paged_attention_fp8.py, also run on the CPU under ``TRITON_INTERPRET=1``). Caches are
owned by the worker; nothing here keeps state but the decode's split counters.
"""

from cvllm.kernels.paged_attention.decode import (  # noqa: F401
    decode_attention, merge_attention_partials, plan_decode_splits,
)
from cvllm.kernels.paged_attention.kv_write import write_kv  # noqa: F401
from cvllm.kernels.paged_attention.prefill import prefill_attention  # noqa: F401
