"""Paged attention: per-step metadata, KV cache spec/allocation, and the backends."""
