"""Kernels of quantized weight formats, one module per format family, each with its torch
reference (``reference.py``). ``ggml_types`` is the table every other module reads."""
