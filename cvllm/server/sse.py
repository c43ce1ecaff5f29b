"""Server-sent events for streamed completions: ``data: {json}\\n\\n`` ... ``data: [DONE]``,
and the two things every answering path needs around them.

One ``SSEStream`` per streamed HTTP request, built by the handlers (``handlers`` for the
text path, ``chat_flow`` for the agent path) on rank 0's event loop. It only frames bytes;
what goes into each event is the shapes' business (``chat``, ``completions``).
``stream_error`` ends a stream that failed after its headers went out;
``cancel_on_disconnect`` cancels a handler whose client went away. Both live here, below
``handlers`` and ``chat_flow``, so the request walk (route -> handler -> chat flow ->
generation -> sse) only goes down.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import AsyncIterator

from aiohttp import web

from cvllm.server.errors import ApiError, error_body

# The handlers' logger, under which these lines were always logged (log filters match it).
logger = logging.getLogger("cvllm.server.handlers")

_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    # Reverse proxies (nginx) buffer responses by default, which would hold tokens back.
    "X-Accel-Buffering": "no",
}


def encode_event(payload: object) -> bytes:
    """One SSE event carrying ``payload`` as compact JSON (bytes: JSON already encoded)."""
    if isinstance(payload, bytes):
        return b"data: " + payload + b"\n\n"
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return b"data: " + data.encode("utf-8") + b"\n\n"


DONE_EVENT = b"data: [DONE]\n\n"


class SSEStream:
    """A prepared ``text/event-stream`` response; writes raise ConnectionResetError once
    the client has gone away."""

    def __init__(self, request: web.Request):
        self.request = request
        self.response = web.StreamResponse(status=200, headers=_HEADERS)

    async def prepare(self) -> None:
        await self.response.prepare(self.request)

    async def send(self, payload: object) -> None:
        await self.response.write(encode_event(payload))

    async def done(self) -> None:
        await self.response.write(DONE_EVENT)
        await self.response.write_eof()


async def stream_error(sse: SSEStream, request_id: str, exc: Exception) -> None:
    """End a stream that failed. A client that went away (``ConnectionResetError``) is only
    logged; any other error travels as an event, as the headers are gone already."""
    if isinstance(exc, ConnectionResetError):
        logger.info("client disconnected from %s; request aborted", request_id)
        return
    if isinstance(exc, ApiError):
        body = exc.body()
    elif isinstance(exc, ValueError):
        body = error_body(str(exc), param=getattr(exc, "param", None))
    else:
        logger.exception("error while streaming %s", request_id)
        body = error_body("Internal server error; see the server log.", "server_error")
    try:
        await sse.send(body)
        await sse.done()
    except ConnectionResetError:
        pass


DISCONNECT_POLL_S = 0.5


@contextlib.asynccontextmanager
async def cancel_on_disconnect(request: web.Request) -> AsyncIterator[None]:
    """Cancel the current (handler) task if the client's connection goes away.

    Without this a non-streamed request whose client gave up would run to the end (and a
    streamed one in a long prefill would only notice at its first write). aiohttp itself
    cancels the handler only when the runner was given ``handler_cancellation=True``,
    which ``web.run_app`` does not do by default.
    """
    handler = asyncio.current_task()

    async def watch() -> None:
        while True:
            await asyncio.sleep(DISCONNECT_POLL_S)
            transport = request.transport
            if transport is None or transport.is_closing():
                logger.info("client of %s %s disconnected", request.method, request.path)
                handler.cancel()
                return

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        # Synchronous, so the watcher can never cancel the handler after this block.
        watcher.cancel()
