"""Compute kernels: Triton kernels (one op family per module; paged attention a package
split by kind), ``reference/`` with the plain-torch version of each (the CPU path and the
kernels' test oracle), ``quant/`` for quantized weight formats. The ``CVLLM_*`` switches
that choose between kernel variants are ``utils/tuning.py``'s; docs/kernels.md lists
them."""
