"""OpenAI-compatible HTTP server (aiohttp) for cvllm; rank 0 only, never imports torch.

Public API: ``ServerSettings``, ``build_app(engine, settings)``, ``start_server``,
``run_server``, ``serve_forever``.
"""

from cvllm.server.app import build_app, run_server, serve_forever, start_server
from cvllm.server.context import ServerSettings

__all__ = ["ServerSettings", "build_app", "start_server", "run_server", "serve_forever"]
