"""Rank 0's end of the channel to the API-server process (``docs/adr/serving-process.md``).

``cvllm serve`` (``cli.py``) builds the engine on rank 0, then ``serve_with_api_process``
starts the API program it is given (``python -m cvllm.server.api_process``: a process
boundary, not an import) with one end of a Unix socket pair and keeps the other here.
That process runs HTTP, the handlers, SSE, tokenizing and chat templates with a GIL of
its own; this one keeps the engine thread (scheduler, runner, detokenizers) and:

- a reader thread that applies what arrives: requests (``AsyncEngine.submit`` with this
  host as their sink), aborts, drain, abort-all, and RPCs: the metrics now (answered at
  once) and a constraint's compile check (on a small pool: a large schema holds up
  nothing else);
- a writer thread that sends what the engine thread hands it: each step's outputs as one
  OUTPUTS frame (the steps queued while it was busy in one frame, up to
  ``MAX_OUTPUTS_PER_FRAME`` outputs), request errors, RPC answers, and every
  ``STATUS_INTERVAL_S`` the engine's health when it changed;
- the main thread, which passes each SIGTERM / SIGINT on as a SIGNAL frame (the API
  process drains or aborts as one process did, and ignores signals sent to it directly)
  and waits for the API process to exit, with this process's own exit deadline armed.

The engine thread's part is one ``SimpleQueue.put`` a step. Owned by the main thread of
rank 0; nothing here runs on other ranks.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Sequence

from cvllm.engine import wire
from cvllm.engine.api_messages import EngineStatus, Hello, RpcCall, RpcReply, Signal, Submit
from cvllm.engine.async_engine import AsyncEngine, OutputSink
from cvllm.outputs import RequestOutput
from cvllm.sampling_params import StructuredOutputs
from cvllm.utils import channel as ch
from cvllm.utils.exit_deadline import exit_by, wait_budget

logger = logging.getLogger("cvllm.runtime")

STATUS_INTERVAL_S = 0.2
"""How often the writer looks for a change of the engine's health to send."""
MAX_OUTPUTS_PER_FRAME = 1024
"""A writer that fell behind sends its backlog in frames of at most this many outputs
(about 1.2 MB with 20 log-probabilities each: far under ``channel.MAX_FRAME``)."""
START_TIMEOUT_S = 120.0
"""The API process must be listening within this (it imports, loads the tokenizer and
binds the port)."""
EXIT_GRACE_S = 5.0
SECOND_SIGNAL_EXIT_S = 4.5
_LAUNCHER_PREFIXES = ("OMPI_", "PMIX_", "PMI_")
PROBE_TEXT = "Hello, world! 1234 <think>ünïcödé 日本語</think>\n\t  end"
"""Encoded on both sides at start-up: the API process's tokenizer must give these ids."""


class ApiProcessStartError(RuntimeError):
    """The API process could not start serving (the port is taken, its tokenizer copy
    disagrees): a start-up error the user can act on."""


class ApiProcessDiedError(RuntimeError):
    """The API process ended while serving without being asked to."""


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


class TokenizerStaysError(RuntimeError):
    """The engine's tokenizer cannot be handed to another process (saved and loaded back,
    it encodes differently, or cannot be): rank 0 serves in its own process."""


def export_tokenizer(tokenizer: Any, folder: str) -> Dict[str, Any]:
    """The tokenizer saved to ``folder`` as the API process loads it, loaded back once to
    check that it encodes the probe text as the original does (``TokenizerStaysError``
    if not), and the probe the API process checks again."""
    from transformers import PreTrainedTokenizerFast

    probe_ids = tokenizer.encode(PROBE_TEXT)
    try:
        tokenizer.hf.save_pretrained(folder)
        copy = PreTrainedTokenizerFast.from_pretrained(folder)
        same = list(copy.encode(PROBE_TEXT, add_special_tokens=True)) == probe_ids
    except Exception as e:  # a tokenizer that cannot be saved or loaded back
        raise TokenizerStaysError(f"the tokenizer cannot be saved and loaded back "
                                  f"({type(e).__name__}: {e})") from None
    if not same:
        raise TokenizerStaysError("a saved copy of the tokenizer encodes differently")
    return {"tokenizer_dir": folder, "chat_template": tokenizer.chat_template_source,
            "probe_text": PROBE_TEXT, "probe_ids": probe_ids}


def make_hello(async_engine: AsyncEngine, settings: Dict[str, Any], mcp: Dict[str, Any],
               shutdown_timeout_s: float) -> Hello:
    """The HELLO of this engine, its tokenizer exported to a temporary folder (removed
    by ``serve_with_api_process`` once the API process listens, having read it); raises
    ``TokenizerStaysError``."""
    folder = tempfile.mkdtemp(prefix="cvllm-api-")
    try:
        tok = export_tokenizer(async_engine.engine.tokenizer, folder)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return Hello(model_name=async_engine.model_name, max_model_len=async_engine.max_model_len,
                 default_params=async_engine.default_params(), settings=settings,
                 shutdown_timeout_s=shutdown_timeout_s, mcp=mcp, **tok)


def serve_with_api_process(async_engine: AsyncEngine, hello: Hello, command: Sequence[str],
                           log_args: Sequence[str] = ()) -> None:
    """Blocking, on rank 0's main thread: start the API process (``command`` + ``--fd N``
    + ``log_args``) with ``hello`` (``make_hello``) and serve through it until it exits
    (after a drain on SIGTERM, as ``server/lifecycle.py`` runs it there). Raises
    ``ApiProcessStartError`` if it cannot start, ``ApiProcessDiedError`` if it ends unasked."""
    ours, theirs = socket.socketpair()
    proc: Optional[subprocess.Popen] = None
    host: Optional[ApiHost] = None
    listening = False
    try:
        host = ApiHost(async_engine, ours, hello)
        proc = spawn(command, theirs, log_args)
        theirs.close()
        host.start()
        async_engine.start()
        wait_listening(host, proc)
        listening = True
        # read by the API process before it listens: gone now, so that a server killed
        # with SIGKILL later leaves no copy of the tokenizer in the temporary folder
        shutil.rmtree(hello.tokenizer_dir, ignore_errors=True)
        logger.info("serving %s on http://%s/v1 (API process %d)", async_engine.model_name,
                    host.address, proc.pid)
        _forward_signals_until_exit(proc, host, hello.shutdown_timeout_s)
    finally:
        # The engine's daemon thread must be out of torch before the interpreter tears
        # down (a thread still inside it then can abort the exit: SIGABRT, not the
        # error's 2). After a signal the wait ends 2 s before the exit deadline; without
        # one (the API process left by itself, a failed start) it is bounded on its own.
        async_engine.shutdown(timeout=wait_budget() if listening else 10.0)
        if proc is not None and proc.poll() is None:
            proc.kill()
        if host is not None:
            host.close()
        for end in (ours, theirs):
            end.close()
        shutil.rmtree(hello.tokenizer_dir, ignore_errors=True)


def spawn(command: Sequence[str], sock: socket.socket,
          log_args: Sequence[str] = ()) -> subprocess.Popen:
    """The API process, in a session of its own (a terminal's Ctrl-C reaches rank 0 only,
    which passes it on once). Not a rank: it leaves the MPI launcher's variables behind
    (tools that find ranks by them, and MPI itself, would take it for rank 0)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES)}
    env["CVLLM_API_PROCESS"] = "1"
    return subprocess.Popen([*command, "--fd", str(sock.fileno()), *log_args],
                            pass_fds=(sock.fileno(),), start_new_session=True, env=env)


def wait_listening(host: ApiHost, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not host.listening.wait(0.2):
        if proc.poll() is not None:
            raise ApiProcessStartError(f"the API process exited with {proc.returncode} "
                                       "at start-up")
        if time.monotonic() > deadline:
            raise ApiProcessStartError(f"the API process was not listening within "
                                       f"{START_TIMEOUT_S:.0f} s")
    if host.fatal is not None or host.address is None:
        raise ApiProcessStartError(host.fatal or "the API process closed the channel at "
                                   "start-up")


def _forward_signals_until_exit(proc: subprocess.Popen, host: ApiHost,
                                shutdown_timeout_s: float) -> None:
    received: List[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        received.append(signum)
        name = signal.Signals(signum).name
        if len(received) == 1:
            exit_by(shutdown_timeout_s + EXIT_GRACE_S - 0.25,
                    f"{name} {shutdown_timeout_s:.0f} s ago")
        else:
            exit_by(SECOND_SIGNAL_EXIT_S, f"second {name}")
        host.signal(name)

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, on_signal)
    try:
        while proc.poll() is None:
            if host.closed.wait(0.2) and proc.poll() is None:
                try:
                    proc.wait(2.0)  # it exits once its channel is gone
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5.0)
        if proc.returncode and not received:
            raise ApiProcessDiedError(f"the API process exited with {proc.returncode}")
    finally:
        # From here on (the engine stopping, SHUTDOWN to the ranks) a signal only brings
        # the exit closer.
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, _late_signal)


def _late_signal(signum: int, _frame: Any) -> None:
    exit_by(SECOND_SIGNAL_EXIT_S, f"{signal.Signals(signum).name} while stopping")
