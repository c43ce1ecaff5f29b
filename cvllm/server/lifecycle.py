"""Run the HTTP server until SIGTERM / SIGINT, then drain, on time, before stopping.

Called once by the CLI on rank 0 (``cli.py``) around the app of ``build_app``. On the
first SIGTERM or SIGINT the engine stops taking requests (``begin_drain``: ``/health``
and new requests answer 503) while the ones in flight run on, for at most
``shutdown_timeout_s`` (``--shutdown-timeout``). What is still running then is aborted
(``abort_all``): every stream gets a last chunk with ``finish_reason: "abort"`` and
``data: [DONE]``, a non-streamed request a 503 error body. Then the server closes (the
app's cleanup hooks stop the engine) and ``serve_until_signal`` returns, so the caller can
send SHUTDOWN to the other ranks. The process exits within ``shutdown_timeout_s +
EXIT_GRACE_S`` whatever hangs (``utils/exit_deadline.py``). A second signal aborts at once
and exits within ``SECOND_SIGNAL_EXIT_S``. The engine is duck-typed (``AsyncEngine``):
``begin_drain()``, ``abort_all()`` and ``num_in_flight()``. This module never imports torch.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from typing import Any, Callable, List, Optional

from aiohttp import web

from cvllm.server.context import ServerSettings
from cvllm.server.edge import EdgeSite
from cvllm.utils.exit_deadline import exit_by

logger = logging.getLogger("cvllm.server")

DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
"""``--shutdown-timeout``: how long requests in flight may run on after SIGTERM."""
EXIT_GRACE_S = 5.0
"""Every rank exits within the shutdown timeout plus this, aborted requests included."""
ABORT_FLUSH_S = 1.0
"""After ``abort_all``: how long the handlers get to send their last chunk."""
HTTP_CLOSE_S = 1.0
"""aiohttp's shutdown timeout: handlers still running when the server closes (after the
drain or the abort) get this long, then are cancelled."""
SECOND_SIGNAL_EXIT_S = 4.5
"""A second SIGTERM / SIGINT: the process is gone within this (the bound is 5 s)."""
_EXIT_MARGIN_S = 0.5  # the deadline fires this much before the promised bound


def serve_until_signal(app: web.Application, settings: ServerSettings, engine: Any, *,
                       shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
                       on_listening: Optional[Callable[[Any], None]] = None) -> None:
    """Blocking: listen on settings.host:port, serve, drain on a signal, clean up
    (``on_listening(runner)`` once the port is bound)."""
    asyncio.run(serve_app(app, settings, engine, shutdown_timeout_s, on_listening))


async def serve_app(app: web.Application, settings: ServerSettings, engine: Any,
                    timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
                    on_listening: Optional[Callable[[Any], None]] = None,
                    engine_gone: Optional[asyncio.Event] = None,
                    signal_source: Optional[Callable[[Callable[[int], None]], None]] = None
                    ) -> None:
    """``serve_until_signal`` inside a running loop (the API process's). ``on_listening``
    gets the runner once the port is bound; ``engine_gone`` set (the engine process
    stopped) ends the serving too, within ``EXIT_GRACE_S``: its requests have already
    failed. ``signal_source(handler)``: signals arrive through it (rank 0 passes on the
    ones it gets) instead of from this process's own signal handlers."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    watch = None if engine_gone is None else loop.create_task(_set_when(engine_gone, stop))
    on_signal = _signal_handler(engine, timeout_s, stop)
    if signal_source is not None:
        signal_source(on_signal)
    else:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=HTTP_CLOSE_S)
    await runner.setup()
    try:
        await EdgeSite(runner, settings).start()  # connection cap and timeouts
        if on_listening is not None:
            on_listening(runner)
        await stop.wait()
    finally:
        if watch is not None:
            watch.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT):
            if signal_source is None:
                loop.remove_signal_handler(sig)
                # From here on (server closing, engine stopping, SHUTDOWN to the ranks) a
                # signal only brings the exit closer.
                signal.signal(sig, _late_signal)
        await runner.cleanup()


def _signal_handler(engine: Any, timeout_s: float, stop: asyncio.Event) -> Callable[[int], None]:
    """The handler of SIGTERM / SIGINT, called on the loop: the first drains (at most
    ``timeout_s``), a second aborts everything and goes."""
    loop = asyncio.get_running_loop()
    tasks: List[asyncio.Task] = []

    def on_signal(signum: int) -> None:
        name = signal.Signals(signum).name
        if tasks:  # a second signal: abort everything and go
            logger.warning("second %s: aborting the requests in flight and exiting", name)
            exit_by(SECOND_SIGNAL_EXIT_S, f"second {name}")
            tasks[0].cancel()
            tasks.append(loop.create_task(_abort_and_stop(engine, stop, 0.5)))
            return
        exit_by(timeout_s + EXIT_GRACE_S - _EXIT_MARGIN_S, f"{name} {timeout_s:.0f} s ago")
        tasks.append(loop.create_task(_drain(engine, timeout_s, stop, name)))

    return on_signal


async def _set_when(event: asyncio.Event, stop: asyncio.Event) -> None:
    await event.wait()
    logger.error("the engine is gone; the server stops")
    exit_by(EXIT_GRACE_S, "the engine is gone")
    stop.set()


def _late_signal(signum: int, _frame: Any) -> None:
    exit_by(SECOND_SIGNAL_EXIT_S, f"{signal.Signals(signum).name} while stopping")


async def _drain(engine: Any, timeout_s: float, stop: asyncio.Event, name: str) -> None:
    engine.begin_drain()
    n = engine.num_in_flight()
    logger.info("%s: draining %d request(s) in flight (at most %.0f s), refusing new ones",
                name, n, timeout_s)
    if await _wait_idle(engine, timeout_s):
        logger.info("drained; stopping the server")
        stop.set()
        return
    logger.warning("drain timed out after %.0f s with %d request(s) still in flight: "
                   "aborting them", timeout_s, engine.num_in_flight())
    await _abort_and_stop(engine, stop, ABORT_FLUSH_S)


async def _abort_and_stop(engine: Any, stop: asyncio.Event, flush_s: float) -> None:
    """``abort_all``, give the handlers ``flush_s`` to send their last chunk, stop."""
    try:
        engine.abort_all()
        if not await _wait_idle(engine, flush_s):
            logger.warning("%d request(s) had not ended %.1f s after the abort",
                           engine.num_in_flight(), flush_s)
    finally:
        stop.set()


async def _wait_idle(engine: Any, timeout_s: float) -> bool:
    """True once no request is in flight; False if some still are after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while engine.num_in_flight():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.05)
    return True
