"""The OpenAI-compatible aiohttp application, and helpers to run it.

``build_app(engine, settings)`` is called once by the CLI on rank 0. The engine is
duck-typed (``AsyncEngine``, engine/async_engine.py) so this package never imports torch.
Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models[/{id}],
GET /health, GET /metrics (``metrics.py``: a registry of the application's own).

Any aiohttp runner works. ``start_server``/``run_server`` also pass
``handler_cancellation=True``, so a client that disconnects cancels its handler (and so
aborts its engine requests) at once rather than at the handlers' next disconnect poll,
and listen through ``edge.EdgeSite`` (connection cap, idle and header timeouts; see
``edge.py``). The body timeout and the UTF-8 check of headers are middleware, so they hold
under any runner.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import web

from cvllm.server import handlers
from cvllm.server.context import CONTEXT_KEY, ServerContext, ServerSettings
from cvllm.server.edge import EdgeSite, edge_middleware, handler_args
from cvllm.server.metrics import REGISTRY_KEY, build_registry, exposition
from cvllm.server.middleware import auth_middleware, error_middleware, json_dumps
from cvllm.server.models import model_card, model_list

__all__ = ["ServerSettings", "build_app", "start_server", "run_server", "serve_forever"]


def build_app(engine: Any, settings: ServerSettings, mcp: Any = None) -> web.Application:
    """The application; ``mcp`` is a started-or-starting ``McpManager`` (or None)."""
    middlewares = [error_middleware, edge_middleware(settings)]
    if settings.api_key:
        middlewares.append(auth_middleware(settings.api_key))
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=middlewares,
                          handler_args=handler_args(settings))
    app[CONTEXT_KEY] = ServerContext(engine, settings, mcp)
    app[REGISTRY_KEY] = build_registry(engine.metrics)
    app.router.add_post("/v1/chat/completions", handlers.chat_completions)
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_get("/v1/models", list_models)
    # Model ids such as "Qwen/Qwen3-8B" contain slashes.
    app.router.add_get("/v1/models/{model_id:.+}", get_model)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


_STARTED = int(time.time())


def _card(ctx: ServerContext) -> dict:
    return model_card(ctx.model_name, ctx.engine.max_model_len, _STARTED)


async def list_models(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT_KEY]
    return web.json_response(model_list([_card(ctx)]), dumps=json_dumps)


async def get_model(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT_KEY]
    ctx.check_model(request.match_info["model_id"])
    return web.json_response(_card(ctx), dumps=json_dumps)


async def health(request: web.Request) -> web.Response:
    """200 once the engine is ready and while it is healthy; 503 otherwise."""
    request.app[CONTEXT_KEY].check_ready()
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    # current_metrics: what the engine counted up to now, so a scrape taken after a
    # response has ended counts that response (in the API process: asked of rank 0);
    # the registry's collector then reads that snapshot (engine.metrics()).
    await request.app[CONTEXT_KEY].engine.current_metrics()
    body, content_type = exposition(request.app[REGISTRY_KEY], request.headers.get("Accept"))
    return web.Response(body=body, headers={"Content-Type": content_type})


async def start_server(app: web.Application, settings: ServerSettings) -> web.AppRunner:
    """Listen on settings.host:port in the running loop; the caller cleans up the runner.

    The bound address (useful with port 0) is ``runner.addresses[0]``.
    """
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = EdgeSite(runner, settings)
    await site.start()
    return runner


def run_server(engine: Any, settings: ServerSettings) -> None:
    """Serve until interrupted (blocking); for a CLI that owns no event loop of its own."""
    try:
        asyncio.run(serve_forever(engine, settings))
    except KeyboardInterrupt:
        pass


async def serve_forever(engine: Any, settings: ServerSettings) -> None:
    """Serve inside an existing event loop until cancelled."""
    runner = await start_server(build_app(engine, settings), settings)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()

