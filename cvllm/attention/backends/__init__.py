"""Attention backends; ``attention/backend.py`` picks one."""
