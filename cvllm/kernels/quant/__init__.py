"""Kernels of quantized weight formats, one module per concern of the GGML family, with
its torch reference (``reference.py``). ``ggml_types`` is the table every other module
reads; ``dispatch.backend_for`` picks a weight's backend (``backend.GgmlBackend``)."""
