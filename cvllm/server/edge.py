"""The HTTP edge: a cap on open connections, idle / header / body timeouts, JSON errors.

Built on rank 0 around the aiohttp app of ``build_app``: ``EdgeSite`` replaces
``web.TCPSite`` (``start_server`` and the CLI's ``lifecycle`` use it) and builds one
``EdgeHandler`` (aiohttp's ``RequestHandler`` plus timers) per accepted socket;
``edge_middleware`` (installed by ``build_app`` under every runner) reads request bodies
against a deadline and refuses header bytes that are not UTF-8. The timers live on the
event loop's thread and die with their connection.

A connection moves through three phases:

- idle (just accepted, or between requests): closed after ``keepalive_timeout_s``;
- headers (the first byte of a request came, its headers are not complete): answered
  408 and closed ``header_timeout_s`` after that first byte (slowloris);
- in a request (the middleware ran): the body must arrive within ``body_timeout_s``
  (else 408 and close); after that the handler runs as long as generation takes.

aiohttp itself has only the keep-alive timer, which starts when a connection goes idle
and also runs while headers trickle in, so idle and header time cannot be told apart by
it; it is kept as a backstop at keep-alive + header time. Beyond ``max_connections`` open
connections a new one is answered a canned 503 (OpenAI's error JSON, ``Retry-After``) and
closed without being parsed: clients and SDKs retry a 503 with backoff and can tell the
reason, where a reset connection looks like a crashed server. Protocol-level errors that
never reach the app (malformed request lines or header names) get OpenAI's JSON shape too.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Dict, Optional

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from cvllm.server.context import ServerSettings
from cvllm.server.middleware import Handler, error_response
from cvllm.server.errors import ApiError, error_body

logger = logging.getLogger(__name__)

REFUSAL_LINGER_S = 1.0
"""How long a refused connection stays open to swallow its request, so that closing it
does not reset the connection before the client has read the 503."""
_CAP_WARNING_EVERY_S = 10.0


def _canned(status: int, reason: str, message: str, type: str, code: str,
            extra: str = "") -> bytes:
    """A complete HTTP/1.1 error response, written straight to a socket."""
    body = json.dumps(error_body(message, type, None, code), separators=(",", ":")).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n{extra}\r\n")
    return head.encode("ascii") + body


_HEADER_TIMEOUT = _canned(408, "Request Timeout", "The request headers did not arrive in "
                          "time.", "invalid_request_error", "header_timeout")
_SERVER_BUSY = _canned(503, "Service Unavailable", "The server has too many open "
                       "connections; retry shortly.", "server_error", "too_many_connections",
                       "Retry-After: 1\r\n")


def handler_args(settings: ServerSettings) -> Dict[str, Any]:
    """``RequestHandler`` options for ``web.Application(handler_args=...)``, so that every
    runner (also aiohttp's test server) closes idle connections after the keep-alive
    timeout. aiohttp's header limits (8190-byte lines, 128 fields) stay as they are."""
    return dict(keepalive_timeout=settings.keepalive_timeout_s)


class EdgeHandler(RequestHandler):
    """aiohttp's per-connection protocol with the idle and header timers of the edge."""

    __slots__ = ("_site", "_in_request", "_close_after", "_idle_timer", "_header_timer",
                 "_counted")

    def __init__(self, site: "EdgeSite", server: Any, **kwargs: Any):
        super().__init__(server, **kwargs)
        self._site = site
        self._in_request = False
        self._close_after = False
        self._idle_timer: Optional[asyncio.TimerHandle] = None
        self._header_timer: Optional[asyncio.TimerHandle] = None
        self._counted = True

    # ------------------------------------------------------------------ transport events
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm_idle()

    def data_received(self, data: bytes) -> None:
        if data and not self._in_request and self._header_timer is None:
            self._cancel_idle()
            self._header_timer = self._loop.call_later(self._site.settings.header_timeout_s,
                                                       self._on_header_timeout)
        super().data_received(data)

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        self._cancel_idle()
        self._cancel_header()
        if self._counted:
            self._counted = False
            self._site.open_connections -= 1
        super().connection_lost(exc)

    # ------------------------------------------------------------------ request events
    def request_started(self, task: Optional[asyncio.Task]) -> None:
        """Called by ``edge_middleware``: the headers are complete."""
        self._in_request = True
        self._cancel_header()
        self._cancel_idle()
        if task is not None:
            task.add_done_callback(self._request_finished)

    def close_after_response(self) -> None:
        """Close once the current response is written, without aiohttp's lingering read
        of an unread body (the client did not send it in time)."""
        self._close_after = True

    def _request_finished(self, _task: asyncio.Future) -> None:
        self._in_request = False
        if self._close_after:
            self.force_close()  # the transport writes out what it holds, then closes
        elif self.transport is not None:
            self._arm_idle()

    # ------------------------------------------------------------------ timers
    def _arm_idle(self) -> None:
        self._cancel_idle()
        self._idle_timer = self._loop.call_later(self._site.settings.keepalive_timeout_s,
                                                 self._on_idle_timeout)

    def _cancel_idle(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _cancel_header(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_idle_timeout(self) -> None:
        self._idle_timer = None
        if self._in_request or self.transport is None:
            return
        if self.transport.get_write_buffer_size():  # a slow reader is still reading
            self._arm_idle()
            return
        self.force_close()

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self._in_request or self.transport is None:
            return
        logger.debug("closing a connection whose request headers took over %.1f s",
                     self._site.settings.header_timeout_s)
        self.transport.write(_HEADER_TIMEOUT)
        self.force_close()

    # ------------------------------------------------------------------ errors
    def handle_error(self, request: Any, status: int = 500,
                     exc: Optional[BaseException] = None,
                     message: Optional[str] = None) -> web.StreamResponse:
        """Errors raised outside the app (the HTTP parser, a handler aiohttp had to stop):
        the same JSON shape as every other error, never aiohttp's text page."""
        if status >= 500:
            self.log_exception("error handling a request", exc_info=exc)
            message = "Internal server error; see the server log."
        else:  # malformed requests from clients (or port scanners) are not our error
            logger.debug("malformed request (%s): %r", status, message)
        if request.writer.output_size > 0:
            raise ConnectionError("a response was already started; cannot send an error")
        kind = "server_error" if status >= 500 else "invalid_request_error"
        response = error_response(status, error_body(message or "Malformed request.", kind))
        response.force_close()
        return response


class _Refusal(asyncio.Protocol):
    """A connection over the cap: answered 503 at once and closed, never parsed."""

    def __init__(self) -> None:
        self._timer: Optional[asyncio.TimerHandle] = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(_SERVER_BUSY)  # type: ignore[attr-defined]
        transport.write_eof()  # type: ignore[attr-defined]  # the client reads EOF at once
        self._timer = asyncio.get_running_loop().call_later(REFUSAL_LINGER_S,
                                                            transport.close)

    def data_received(self, data: bytes) -> None:
        pass  # the request is swallowed unread

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        if self._timer is not None:
            self._timer.cancel()


class EdgeSite(web.BaseSite):
    """``web.TCPSite`` with the edge's protocol factory (connection cap and timers)."""

    def __init__(self, runner: web.BaseRunner, settings: ServerSettings, *,
                 backlog: int = 128, reuse_address: Optional[bool] = None):
        super().__init__(runner, backlog=backlog)
        self.settings = settings
        self.open_connections = 0
        self._reuse_address = reuse_address
        self._last_cap_warning = 0.0

    @property
    def name(self) -> str:
        return f"http://{self.settings.host}:{self.settings.port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._make_protocol, self.settings.host, self.settings.port,
            backlog=self._backlog, reuse_address=self._reuse_address)

    def _make_protocol(self) -> asyncio.BaseProtocol:
        if self.open_connections >= self.settings.max_connections:
            now = time.monotonic()
            if now - self._last_cap_warning > _CAP_WARNING_EVERY_S:
                self._last_cap_warning = now
                logger.warning("%d connections open (--max-connections); answering new "
                               "ones 503", self.open_connections)
            return _Refusal()
        server = self._runner.server
        # What aiohttp's Server.__call__ does, with our class; aiohttp's own keep-alive
        # timer becomes a backstop behind the idle and header timers.
        kwargs = dict(server._kwargs)  # noqa: SLF001 -- the runner's handler options
        kwargs["keepalive_timeout"] = (self.settings.keepalive_timeout_s
                                       + self.settings.header_timeout_s)
        handler = EdgeHandler(self, server, loop=asyncio.get_running_loop(), **kwargs)
        self.open_connections += 1
        return handler


def _check_headers(request: web.Request) -> None:
    for name, value in request.raw_headers:
        try:
            value.decode("utf-8")
        except UnicodeDecodeError:
            shown = name.decode("ascii", "replace")  # the parser allows only tokens here
            raise ApiError(400, f"The value of the header '{shown}' is not valid UTF-8.",
                           code="invalid_header") from None


def edge_middleware(settings: ServerSettings):
    """Mark the request's start for the connection's timers, refuse non-UTF-8 header
    bytes, and read the body within ``body_timeout_s`` (a client that announces a body and
    never sends it gets a 408 and a closed connection)."""

    @web.middleware
    async def edge(request: web.Request, handler: Handler) -> web.StreamResponse:
        protocol = request.protocol
        if isinstance(protocol, EdgeHandler):
            protocol.request_started(asyncio.current_task())
        _check_headers(request)
        if request.body_exists:
            try:
                # read() keeps the bytes, so the handler's own read() returns them.
                await asyncio.wait_for(request.read(), settings.body_timeout_s)
            except asyncio.TimeoutError:
                if isinstance(protocol, EdgeHandler):
                    protocol.close_after_response()
                response = error_response(408, error_body(
                    f"The request body did not arrive within {settings.body_timeout_s:g} s.",
                    code="body_timeout"))
                response.force_close()
                return response
        return await handler(request)

    return edge
