"""Where cvllm keeps files it derives or downloads: the default model and converted
tokenizers.

The root is the platform's user cache folder for ``cvllm`` (``~/.cache/cvllm`` on Linux),
or ``$CVLLM_CACHE_DIR`` when set. Every rank computes the same paths; writers make files
under a unique temporary name and ``os.replace`` them into place, so ranks racing on one
machine never see half-written files.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "CVLLM_CACHE_DIR"


def cache_root() -> Path:
    """The cvllm cache folder (not created here)."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("cvllm"))


def models_cache_dir() -> Path:
    """Folder holding downloaded model files (the default model's GGUF)."""
    return cache_root() / "models"


def tokenizers_cache_dir() -> Path:
    """Folder holding tokenizers converted from GGUF metadata, one sub-folder per file."""
    return cache_root() / "tokenizers"
