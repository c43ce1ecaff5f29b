"""Errors raised by ``cvllm.loader``.

``ModelLoadError`` is the one exception type the loader raises for anything wrong with a
model on disk or on the Hub: a missing or truncated file, a bad header, an unsupported
architecture or tensor type, a failed download. The CLI prints its message as is, so the
message names the file and says what is wrong and, where possible, what to do about it.
"""

from __future__ import annotations


class ModelLoadError(Exception):
    """A model could not be found, downloaded, read or understood; the message says why."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message
