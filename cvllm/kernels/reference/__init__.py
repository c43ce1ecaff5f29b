"""Plain-torch references of the Triton kernels (DESIGN rule 7), one module per kernel
family, named after the kernel module it checks: ``paged_attention``, ``rotary``,
``norms`` (RMSNorm and the all-reduce fused with it), ``linear`` (gated activations and
the batch-1 GEMV), ``fused_moe``, ``sampling``, and ``deltanet`` (the per-sequence
oracles of ``layers/gated_deltanet.py``). The GGUF formats' reference is
``kernels/quant/reference.py``.

Each function is the CPU path of its op or the oracle its Triton kernel is tested
against; same arguments, same results up to float rounding. No state, no device logic,
torch only (importable without Triton); written for obviousness, not speed.
"""
