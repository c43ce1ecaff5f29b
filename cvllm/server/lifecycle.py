"""Run the HTTP server until SIGTERM / SIGINT, then drain before stopping.

Called once by the CLI on rank 0 (``cli.py``) around the app of ``build_app``. On the
first SIGTERM or SIGINT the engine stops taking requests (``begin_drain``: ``/health``
and new requests answer 503) while the ones in flight run to completion, for at most
``drain_timeout_s``; then the server closes (the app's cleanup hooks stop the engine)
and ``serve_until_signal`` returns, so the caller can stop the other ranks. A second
signal stops at once. The engine is duck-typed (``AsyncEngine``): ``begin_drain()`` and
``num_in_flight()``. This module never imports torch.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from typing import Any, Callable, Optional

from aiohttp import web

from cvllm.server.context import ServerSettings

logger = logging.getLogger("cvllm.server")

DEFAULT_DRAIN_TIMEOUT_S = 60.0


def serve_until_signal(app: web.Application, settings: ServerSettings, engine: Any, *,
                       drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
                       on_listening: Optional[Callable[[], None]] = None) -> None:
    """Blocking: listen on settings.host:port, serve, drain on a signal, clean up."""
    asyncio.run(_serve(app, settings, engine, drain_timeout_s, on_listening))


async def _serve(app: web.Application, settings: ServerSettings, engine: Any,
                 drain_timeout_s: float, on_listening: Optional[Callable[[], None]]) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    draining: list = []

    def on_signal(signum: int) -> None:
        if draining:  # a second signal: stop now
            logger.warning("second %s: stopping without waiting", signal.Signals(signum).name)
            stop.set()
            return
        draining.append(loop.create_task(_drain(engine, drain_timeout_s, stop, signum)))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, settings.host, settings.port).start()
        if on_listening is not None:
            on_listening()
        await stop.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await runner.cleanup()


async def _drain(engine: Any, timeout_s: float, stop: asyncio.Event, signum: int) -> None:
    engine.begin_drain()
    n = engine.num_in_flight()
    logger.info("%s: draining %d request(s) in flight (at most %.0f s), refusing new ones",
                signal.Signals(signum).name, n, timeout_s)
    deadline = time.monotonic() + timeout_s
    while engine.num_in_flight() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    left = engine.num_in_flight()
    if left:
        logger.warning("drain timed out with %d request(s) still in flight", left)
    else:
        logger.info("drained; stopping the server")
    stop.set()
