"""Logging set-up for every rank: one ``cvllm`` logger, optional per-rank log file.

Called once by ``cli.py`` (the composition root); library modules only do
``logging.getLogger("cvllm.<module>")``.
"""

from __future__ import annotations

import logging
import sys
from typing import Optional, Union

_FORMAT = "%(asctime)s %(levelname)s [rank %(rank)s] %(name)s: %(message)s"


class _RankFilter(logging.Filter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


def init_logging(rank: Union[int, str] = 0, log_file: Optional[str] = None,
                 level: str = "INFO") -> logging.Logger:
    """Send ``cvllm`` logs to stderr and, with ``--log``, to ``log_file`` (rank 0) or
    ``rank_log_path(log_file, rank)`` (other ranks) so every rank keeps its own file.
    ``rank`` may be a label instead (``"api"``: the API-server process)."""
    logger = logging.getLogger("cvllm")
    logger.setLevel(level.upper())
    for h in list(logger.handlers):
        logger.removeHandler(h)
    handlers = [logging.StreamHandler(sys.stderr)]
    if log_file:
        path = rank_log_path(log_file, rank)
        handlers.append(logging.FileHandler(path, encoding="utf-8"))
    for h in handlers:
        h.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        h.addFilter(_RankFilter(rank))
        logger.addHandler(h)
    logger.propagate = False
    return logger


def rank_log_path(log_file: str, rank: Union[int, str]) -> str:
    """``serve.log`` -> ``serve.rank1.log`` for rank 1 (``serve`` -> ``serve.rank1``),
    ``serve.api.log`` for the label ``"api"``; rank 0 keeps the name as given."""
    if rank == 0:
        return log_file
    tag = rank if isinstance(rank, str) else f"rank{rank}"
    head, sep, ext = log_file.rpartition(".")
    if sep and head and "/" not in ext:
        return f"{head}.{tag}.{ext}"
    return f"{log_file}.{tag}"
