"""Compute kernels: Triton kernels (one op family per file) and ``reference.py`` with the
plain-torch version of each, used on the CPU and as the kernels' test oracle."""
