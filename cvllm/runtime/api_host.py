"""Rank 0's end of the channel to the API-server process (``docs/adr/serving-process.md``).

``cvllm serve`` (``cli.py``) builds the engine on rank 0, then ``serve_with_api_process``
(``runtime/api_launch.py``) starts the API program it is given (``python -m
cvllm.server.api_process``: a process boundary, not an import) with one end of a Unix
socket pair and gives the other to an ``ApiHost``. That process runs HTTP, the handlers,
SSE, tokenizing and chat templates with a GIL of its own; this one keeps the engine
thread (scheduler, runner, detokenizers) and:

- a reader thread that applies what arrives: requests (``AsyncEngine.submit`` with this
  host as their sink), aborts, drain, abort-all, and RPCs: the metrics now (answered at
  once) and a constraint's compile check (on a small pool: a large schema holds up
  nothing else);
- a writer thread that sends what the engine thread hands it: each step's outputs as one
  OUTPUTS frame (the steps queued while it was busy in one frame, up to
  ``MAX_OUTPUTS_PER_FRAME`` outputs), request errors, RPC answers, and every
  ``STATUS_INTERVAL_S`` the engine's health when it changed;
- the main thread (``runtime/api_launch.py``), which passes each SIGTERM / SIGINT on as
  a SIGNAL frame (``ApiHost.signal``) and waits for the API process to exit.

The engine thread's part is one ``SimpleQueue.put`` a step. Owned by the main thread of
rank 0; nothing here runs on other ranks.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, List, Optional

from cvllm.engine import wire
from cvllm.engine.api_messages import EngineStatus, Hello, RpcCall, RpcReply, Signal, Submit
from cvllm.engine.async_engine import AsyncEngine, OutputSink
from cvllm.outputs import RequestOutput
from cvllm.sampling_params import StructuredOutputs
from cvllm.utils import channel as ch

logger = logging.getLogger("cvllm.runtime")

STATUS_INTERVAL_S = 0.2
"""How often the writer looks for a change of the engine's health to send."""
MAX_OUTPUTS_PER_FRAME = 1024
"""A writer that fell behind sends its backlog in frames of at most this many outputs
(about 1.2 MB with 20 log-probabilities each: far under ``channel.MAX_FRAME``)."""


class ApiHost(OutputSink):
    """The engine side of one API-process channel: an ``OutputSink`` for its requests."""

    def __init__(self, engine: AsyncEngine, sock: socket.socket, hello: Hello):
        self.engine = engine
        self._sock = sock
        self._hello = hello
        self._reader = ch.FrameReader(sock)
        self._writer = ch.FrameWriter(sock)
        self._out: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._compiles = ThreadPoolExecutor(max_workers=4, thread_name_prefix="cvllm-api-rpc")
        self.listening = threading.Event()
        """Set when the API process has bound its port, reported a fatal error, or left."""
        self.fatal: Optional[str] = None
        self.address: Optional[str] = None
        self.closed = threading.Event()
        """Set when the channel is gone (the API process exited or broke it)."""
        self._threads: List[threading.Thread] = []

    # ---------------------------------------------------------------- OutputSink
    def deliver(self, outputs: List[RequestOutput]) -> None:
        self._out.put(outputs)

    def fail(self, request_id: str, err: BaseException) -> None:
        self._out.put(ch.encode_json(ch.REQUEST_ERROR, {"id": request_id,
                                                        **ch.error_info(err)}))

    def signal(self, name: str) -> None:
        """Pass a signal rank 0 received on to the API process."""
        self._out.put(ch.encode_json(ch.SIGNAL, Signal(name).to_wire()))

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._writer.send_json(ch.HELLO, self._hello.to_wire())
        for target, name in ((self._read_loop, "cvllm-api-reader"),
                             (self._write_loop, "cvllm-api-writer")):
            self._threads.append(threading.Thread(target=target, name=name, daemon=True))
            self._threads[-1].start()

    def close(self, timeout: float = 2.0) -> None:
        """End the channel and wait (at most ``timeout``) for the reader and writer
        threads: a daemon thread that ends while the interpreter finalizes and drops the
        last reference to the engine frees its tensors there, and torch, releasing the
        GIL mid-free, aborts the exit (SIGABRT: measured, a core's backtrace)."""
        self._out.put(None)
        self._break()
        self._compiles.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + timeout
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))

    def _break(self) -> None:
        """End the channel both ways: the API process sees it close and stops."""
        self.closed.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    # ---------------------------------------------------------------- writer thread
    def _write_loop(self) -> None:
        last_status: Optional[EngineStatus] = None
        next_status = 0.0
        try:
            while True:
                wait = max(0.0, next_status - time.monotonic())
                try:
                    item = self._out.get(timeout=wait) if wait else self._out.get_nowait()
                except queue.Empty:
                    item = ()
                if item is None:
                    return
                if item != ():
                    self._send_items(item)
                if time.monotonic() >= next_status:
                    last_status = self._send_status(last_status)
                    next_status = time.monotonic() + STATUS_INTERVAL_S
        except OSError as e:  # the API process is gone; the reader sees it too
            if not self.closed.is_set():
                logger.warning("the channel to the API process closed: %s", e)
        except BaseException:  # a bug here must not leave the API side waiting forever
            logger.exception("the API channel's writer failed; closing the channel")
        finally:
            self._break()

    def _send_items(self, first: Any) -> None:
        """``first`` and whatever else is queued: the outputs of the queued steps in as
        few frames as ``MAX_OUTPUTS_PER_FRAME`` allows, other frames as they are, in
        order."""
        outputs: List[list] = []
        item = first
        while True:
            if isinstance(item, bytes):
                self._flush(outputs)
                self._writer.send(item)
            elif item is None:
                self._out.put(None)  # close: after what came before it
                break
            else:
                outputs.extend(wire.output_to_wire(o) for o in item)
                if len(outputs) >= MAX_OUTPUTS_PER_FRAME:
                    self._flush(outputs)
            try:
                item = self._out.get_nowait()
            except queue.Empty:
                break
        self._flush(outputs)

    def _flush(self, outputs: List[list]) -> None:
        if outputs:
            self._writer.send(ch.encode_json(ch.OUTPUTS, outputs))
            outputs.clear()

    def _send_status(self, last: Optional[EngineStatus]) -> EngineStatus:
        """STATUS when the engine's health changed since ``last``."""
        eng = self.engine
        now = EngineStatus(eng.is_ready(), eng.is_healthy(), eng.failure())
        if now != last:
            self._writer.send_json(ch.STATUS, now.to_wire())
        return now

    # ---------------------------------------------------------------- reader thread
    def _read_loop(self) -> None:
        try:
            while True:
                frame = self._reader.read()
                if frame is None:
                    break
                self._apply(*frame)
        except Exception as e:  # a broken or misbehaving peer: the channel ends here
            if not self.closed.is_set():
                logger.error("the channel to the API process broke: %s", e)
        finally:
            self._break()
            self.listening.set()
            self._abort_own()

    def _apply(self, kind: int, payload: bytes) -> None:
        if kind == ch.ADD:
            self._add(ch.decode_json(kind, payload))
        elif kind == ch.ABORT:
            self.engine.abort_submitted(wire.request_id(payload.decode("utf-8", "surrogatepass")))
        elif kind == ch.DRAIN:
            self.engine.begin_drain()
        elif kind == ch.ABORT_ALL:
            self.engine.abort_all()
        elif kind == ch.RPC:
            self._call(RpcCall.from_wire(ch.decode_json(kind, payload)))
        elif kind == ch.LISTENING:
            self.address = wire.want(ch.decode_json(kind, payload).get("address"), str, "address")
            self.listening.set()
        elif kind == ch.FATAL:
            self.fatal = str(ch.decode_json(kind, payload).get("message"))
            self.listening.set()
        else:
            raise ch.ChannelError(f"a {ch.KINDS[kind]} frame is not for the engine side")

    def _add(self, msg: Any) -> None:
        rid = Submit.id_of(msg)
        if rid is None:
            raise ch.ChannelError("an ADD frame without a usable request id")
        try:
            sub = Submit.from_wire(msg)
            self.engine.submit(sub.request_id, sub.prompt_token_ids, sub.params, self)
        except Exception as e:  # refused: the caller gets it as the request's error
            self.fail(rid, e)

    def _call(self, call: RpcCall) -> None:
        if call.method == "metrics":  # a snapshot's encoding: no need to queue it
            self._reply(call, lambda: wire.metrics_to_wire(self.engine.metrics()))
        else:
            spec = StructuredOutputs(kind=call.args.get("kind"), value=call.args.get("value"))

            def compile_it() -> None:  # cached there for the request that follows
                self.engine.engine.grammar.compile(spec)

            self._compiles.submit(self._reply, call, compile_it)

    def _reply(self, call: RpcCall, fn) -> None:
        try:
            reply = RpcReply(call.call, True, fn())
        except Exception as e:
            reply = RpcReply(call.call, False, error=ch.error_info(e))
        self._out.put(ch.encode_json(ch.RPC_REPLY, reply.to_wire()))

    def _abort_own(self) -> None:
        """The API process is gone: nobody waits for its requests; free their blocks."""
        own = self.engine.submitted_by(self)
        for rid in own:
            self.engine.abort_submitted(rid)
        if own:
            logger.warning("the API process left %d request(s) in flight: aborted", len(own))
