"""Stdlib-only helpers shared by every layer."""
