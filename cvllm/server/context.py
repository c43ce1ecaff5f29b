"""Server settings and the per-application context the handlers share.

``ServerSettings`` is built once by the CLI (the composition root) on rank 0;
``ServerContext`` is built by ``build_app`` and stored on the aiohttp application, so each
handler reaches the engine through ``request.app[CONTEXT_KEY]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from aiohttp import web

from cvllm.server.errors import ApiError


@dataclass
class ServerSettings:
    host: str = "0.0.0.0"
    """Interface to listen on."""
    port: int = 2000
    """TCP port (candle-vllm's default); 0 picks a free one."""
    api_key: Optional[str] = None
    """When set, every route but /health and /metrics needs ``Authorization: Bearer <key>``."""
    served_model_name: Optional[str] = None
    """Model id shown in /v1/models and responses; defaults to ``engine.model_name``."""
    max_body_bytes: int = 32 * 1024 * 1024
    """Larger request bodies are answered 413 before being read into memory."""
    keepalive_timeout_s: float = 75.0
    """An idle connection (no request in progress, no byte of the next one) is closed
    after this long; above the 60 s idle timeout of common load balancers, so that they,
    not we, close a pooled connection (nginx's default is 75 s too)."""
    header_timeout_s: float = 30.0
    """From a request's first byte, its headers must be complete within this (slowloris);
    else 408 and the connection closes."""
    body_timeout_s: float = 60.0
    """A request's whole body must arrive within this once its headers are in; else 408
    and the connection closes."""
    max_connections: int = 1024
    """Most open client connections; beyond it a new one is answered 503 and closed."""
    tool_call_parser: Optional[str] = None
    """Tool-call parser of the model's format (``--enforce-parser``, or detected at
    start-up); None: none known, requests with tools get the plain ``json`` parser."""
    reasoning_parser: Optional[str] = None
    """Reasoning parser (``--reasoning-parser``, or detected); None: no reasoning split."""
    mcp_max_rounds: int = 8
    """Most rounds of MCP tool calls one chat request may run (``--mcp-max-rounds``)."""

    def __post_init__(self) -> None:
        if not 0 <= int(self.port) <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_body_bytes <= 0:
            raise ValueError(f"max_body_bytes must be positive, got {self.max_body_bytes}")
        for name in ("keepalive_timeout_s", "header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        if self.mcp_max_rounds < 0:
            raise ValueError(f"mcp_max_rounds must be >= 0, got {self.mcp_max_rounds}")
        if self.api_key == "":
            self.api_key = None  # an empty key would otherwise accept "Bearer " only


@dataclass
class ServerContext:
    engine: Any
    """Duck-typed ``AsyncEngine`` (see engine/async_engine.py); never imported here."""
    settings: ServerSettings
    mcp: Any = None
    """Duck-typed ``chat.mcp.McpManager`` whose tools chat requests are offered, or None.
    Built and started by the CLI on rank 0; the server only calls its tools."""

    @property
    def model_name(self) -> str:
        return self.settings.served_model_name or self.engine.model_name

    def check_model(self, name: Optional[str]) -> None:
        """A missing model field means the served model; any other name is a 404."""
        if name is None or name in (self.model_name, self.engine.model_name):
            return
        raise ApiError(404, f"The model '{name}' does not exist; this server serves "
                            f"'{self.model_name}'.", type="not_found_error", param="model",
                       code="model_not_found")

    def check_ready(self) -> None:
        if not self.engine.is_ready():
            raise ApiError(503, "The model is still loading; retry shortly.",
                           type="server_error", code="not_ready")
        if not self.engine.is_healthy():
            raise ApiError(503, "The engine is unhealthy.", type="server_error",
                           code="unhealthy")


CONTEXT_KEY = web.AppKey("cvllm_server_context", ServerContext)
