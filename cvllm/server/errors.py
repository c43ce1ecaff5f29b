"""``ApiError`` and OpenAI's error body shape: how every client mistake is answered.

Raised anywhere in the server (request parsing, param resolution, the edge) and turned
into ``{"error": {...}}`` with an HTTP status by the middleware and handlers.
"""

from __future__ import annotations

from typing import Optional


class ApiError(Exception):
    """An error answered to the client as ``{"error": {...}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error",
               param: Optional[str] = None, code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
