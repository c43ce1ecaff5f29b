"""Quantization configs and linear methods (the math a parallel linear delegates to)."""
