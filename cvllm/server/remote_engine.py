"""Rank 0's engine as the API process sees it: ``AsyncEngine``'s duck type over the
channel (``utils/channel.py``; the other end is ``runtime/api_host.py``).

Built once by ``server/api_process.py`` from the engine's HELLO; the handlers reach it
through ``ServerContext.engine`` exactly as they reach an in-process ``AsyncEngine``.
Requests go out as ADD frames and their outputs come back on one reader task, which
hands each to its request's ``asyncio.Queue``; health arrives as STATUS frames and is read
from here without a round trip, metrics are asked for at each scrape (an RPC). Tokenizing and chat templates run here, on
a copy of the engine's tokenizer (checked against it at start-up), so the engine process
spends nothing on them. Torch-free.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import signal
from typing import Any, Callable, Dict, List, Optional, Tuple

from cvllm.engine import wire
from cvllm.engine.api_messages import EngineStatus, Hello, RpcCall, RpcReply, Signal, Submit
from cvllm.engine.request_stream import RequestStreams
from cvllm.outputs import EngineMetrics
from cvllm.sampling_params import SamplingParams
from cvllm.utils import channel as ch

logger = logging.getLogger("cvllm.server")


class EngineDeadError(RuntimeError):
    """The engine process failed or the channel to it is gone."""


class EngineRequestError(ValueError):
    """The engine refused a request (a client error: the prompt, a constraint)."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


def _error(info: Dict[str, Any]) -> BaseException:
    message = str(info.get("message", "engine error"))
    if info.get("value_error"):
        return EngineRequestError(message, info.get("param"))
    return EngineDeadError(message)


class RemoteEngine(RequestStreams):
    """``AsyncEngine``'s public methods, answered over the channel."""

    METRICS_TIMEOUT_S = 5.0
    """A scrape waits this long for rank 0's metrics, then shows the last ones."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 hello: Hello, tokenizer: Any):
        self._reader = reader
        self._writer = writer
        self.model_name: str = hello.model_name
        self.max_model_len: int = hello.max_model_len
        self._defaults: Dict[str, Any] = dict(hello.default_params)
        self.tokenizer = tokenizer
        self._on_signal: Optional[Callable[[int], None]] = None
        self._queues: Dict[str, asyncio.Queue] = {}
        self._calls: Dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._ready = False
        self._healthy = False
        self._error: Optional[str] = None
        self._draining = False
        self._closed = False
        self._metrics = EngineMetrics()
        self.closed_event = asyncio.Event()
        """Set when the channel is gone (the engine process stopped or failed)."""

    # ---------------------------------------------------------------- reader task
    async def run(self) -> None:
        """Read frames until the engine side closes the channel."""
        try:
            while True:
                frame = await ch.read_frame_async(self._reader)
                if frame is None:
                    break
                self._apply(*frame)
        except (OSError, ch.ChannelError, wire.WireError) as e:
            logger.error("the channel to the engine broke: %s", e)
        finally:
            self._close("the engine process closed the channel")

    def _apply(self, kind: int, payload: bytes) -> None:
        if kind == ch.OUTPUTS:
            queues = self._queues
            for item in ch.decode_json(kind, payload):
                out = wire.output_from_wire(item)
                q = queues.get(out.request_id)
                if q is not None:  # else the caller left; its ABORT is on the way
                    q.put_nowait(out)
        elif kind == ch.REQUEST_ERROR:
            info = ch.decode_json(kind, payload)
            q = self._queues.get(str(info.get("id")))
            if q is not None:
                q.put_nowait(_error(info))
        elif kind == ch.STATUS:
            st = EngineStatus.from_wire(ch.decode_json(kind, payload))
            self._ready, self._healthy, self._error = st.ready, st.healthy, st.error
        elif kind == ch.RPC_REPLY:
            reply = RpcReply.from_wire(ch.decode_json(kind, payload))
            fut = self._calls.pop(reply.call, None)
            if fut is not None and not fut.done():
                if reply.ok:
                    fut.set_result(reply.result)
                else:
                    fut.set_exception(_error(reply.error or {}))
        elif kind == ch.SIGNAL:
            name = Signal.from_wire(ch.decode_json(kind, payload)).name
            if self._on_signal is not None:
                self._on_signal(signal.Signals[name])
        else:
            raise ch.ChannelError(f"a {ch.KINDS[kind]} frame is not for the API process")

    def _close(self, reason: str) -> None:
        if self._closed:
            return
        self._closed = True
        err = EngineDeadError(self._error or reason)
        for q in self._queues.values():
            q.put_nowait(err)
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(err)
        self._calls.clear()
        self.closed_event.set()

    def _send(self, frame: bytes) -> None:
        if self._closed:
            raise EngineDeadError(self._error or "the engine process is gone")
        self._writer.write(frame)

    def on_signal(self, callback: Callable[[int], None]) -> None:
        """``callback(signum)`` for each signal rank 0 passes on (``serve_app``'s
        ``signal_source``: this process ignores the ones sent to it directly)."""
        self._on_signal = callback

    # ---------------------------------------------------------------- AsyncEngine's face
    def is_ready(self) -> bool:
        return self._ready and not self._closed

    def is_healthy(self) -> bool:
        return self._healthy and not self._closed and not self._draining

    def begin_drain(self) -> None:
        self._draining = True
        if not self._closed:
            self._send(ch.encode_frame(ch.DRAIN))

    def abort_all(self) -> None:
        self._draining = True
        if not self._closed:
            self._send(ch.encode_frame(ch.ABORT_ALL))

    def num_in_flight(self) -> int:
        return len(self._queues)

    def metrics(self) -> EngineMetrics:
        """The snapshot the last ``current_metrics`` fetched."""
        return self._metrics

    async def current_metrics(self) -> EngineMetrics:
        """The engine's metrics now (one round trip to rank 0); the last ones fetched if
        rank 0 is gone or slower than ``METRICS_TIMEOUT_S``."""
        if self._closed:
            return self._metrics
        try:
            got = await asyncio.wait_for(self._call("metrics", {}), self.METRICS_TIMEOUT_S)
        except (asyncio.TimeoutError, EngineDeadError):
            logger.warning("metrics from the engine did not come; showing the last ones")
            return self._metrics
        self._metrics = wire.metrics_from_wire(got)
        return self._metrics

    def default_params(self) -> Dict[str, Any]:
        return dict(self._defaults)

    def encode(self, text: str) -> List[int]:
        return self.tokenizer.encode(text)

    def render_chat_prompt(self, messages: List[Dict[str, Any]],
                           **template_kwargs: Any) -> Tuple[str, List[int]]:
        return self.tokenizer.render_chat_prompt(messages, **template_kwargs)

    async def check_structured(self, spec: Any) -> None:
        """Compiled on the engine side (where it is cached for the request that follows);
        a constraint it refuses raises ``EngineRequestError`` with its ``param``."""
        await self._call("check_structured", {"kind": spec.kind, "value": spec.value})

    async def _call(self, method: str, args: Dict[str, Any]) -> Any:
        call = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call] = fut
        try:
            self._send(ch.encode_json(ch.RPC, RpcCall(call, method, args).to_wire()))
            return await fut
        finally:
            self._calls.pop(call, None)

    # ``generate`` (RequestStreams, as ``AsyncEngine``'s) calls these once per request.
    def _open_stream(self, request_id: str) -> asyncio.Queue:
        if not self.is_healthy():
            raise EngineDeadError(self._error or "the engine is not serving")
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        return q

    def _submit(self, request_id: str, prompt_token_ids: List[int],
                params: SamplingParams) -> None:
        self._send(ch.encode_json(ch.ADD, Submit(request_id, prompt_token_ids,
                                                 params).to_wire()))

    def _close_stream(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        if not self._closed:
            self._send(ch.encode_frame(ch.ABORT, request_id.encode("utf-8", "surrogatepass")))
