"""Progress bars for weight loading, shown only to a person watching a terminal."""

from __future__ import annotations

import os
import sys
from typing import Iterable, Iterator, Optional, TypeVar

T = TypeVar("T")


def progress_enabled() -> bool:
    """Bars only on an interactive stderr, and never when CVLLM_NO_PROGRESS=1; logs and CI
    output stay clean that way."""
    if os.environ.get("CVLLM_NO_PROGRESS", "") not in ("", "0"):
        return False
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def progress(items: Iterable[T], total: Optional[int], desc: str) -> Iterator[T]:
    """Wrap ``items`` in a tqdm bar when enabled, else pass them through."""
    if not progress_enabled():
        yield from items
        return
    from tqdm.auto import tqdm

    with tqdm(items, total=total, desc=desc, unit="tensor", leave=False) as bar:
        yield from bar
