"""The asyncio face of the engine: one engine thread, one output queue per request.

Built by ``cli.py`` on rank 0 around an ``LLMEngine``; the aiohttp server holds it and
calls only its public methods. The engine thread is the only thread that touches the
``LLMEngine`` (scheduler, runner, detokenizers); handlers talk to it through a command
queue and receive ``RequestOutput`` objects on per-request ``asyncio.Queue`` s.

Requests can also come from another process (the API server, ``runtime/api_host.py``):
``submit`` registers one with a ``sink`` instead of a queue, and each step's outputs of
such requests reach that sink in one call (``deliver``) from the engine thread.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import traceback
from typing import Any, Dict, List, Optional, Tuple

from cvllm.engine.llm_engine import LLMEngine
from cvllm.engine.request_stream import RequestStreams
from cvllm.outputs import EngineMetrics, RequestOutput
from cvllm.sampling_params import SamplingParams

logger = logging.getLogger("cvllm.engine")

_WARMUP_ID = "__cvllm_warmup__"


def _aborted(request_id: str) -> RequestOutput:
    """The last output of a request that ``abort_all`` ended (no new text)."""
    return RequestOutput(request_id, "", [], 0, 0, finished=True, finish_reason="abort")


def _put_all(items: List[Tuple[asyncio.Queue, RequestOutput]]) -> None:
    """Event-loop side of ``_deliver_step``."""
    for q, out in items:
        q.put_nowait(out)


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""


class OutputSink:
    """Where the outputs of requests submitted from another process go (``submit``).
    Both methods are called on the engine thread and must not block on the peer."""

    def deliver(self, outputs: List[RequestOutput]) -> None:
        """One step's outputs of this sink's requests (finished ones included)."""
        raise NotImplementedError

    def fail(self, request_id: str, err: BaseException) -> None:
        """The request ends with an error instead of an output."""
        raise NotImplementedError


class AsyncEngine(RequestStreams):
    def __init__(self, engine: LLMEngine, model_name: str, default_params: Dict[str, Any]):
        self.engine = engine
        self.model_name = model_name
        self.max_model_len = engine.config.model.max_model_len
        self._defaults = dict(default_params)
        self._commands: "queue.Queue[Tuple[str, Any]]" = queue.Queue()
        self._queues: Dict[str, Tuple[Any, Optional[asyncio.Queue]]] = {}
        """Request id -> (its event loop, its queue), or (an ``OutputSink``, None)."""
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._draining = threading.Event()
        self._aborting_all = False  # engine thread only: abort_all ran
        self._error: Optional[BaseException] = None
        self._metrics = engine.metrics()
        self._thread: Optional[threading.Thread] = None

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the engine thread; it runs one warm-up step, then ``/health`` turns 200."""
        self._thread = threading.Thread(target=self._run, name="cvllm-engine", daemon=True)
        self._thread.start()
        bos = self.engine.config.model.bos_token_id
        warm = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        self._commands.put(("add", (_WARMUP_ID, [bos if bos is not None else 0], warm)))

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("the engine thread is still in a step %.1f s after the stop",
                               timeout)

    def is_ready(self) -> bool:
        return self._ready.is_set()

    def is_healthy(self) -> bool:
        """False once the engine failed (its thread died, or ``fail`` was called: e.g. a
        worker rank is gone) and while draining; ``/health`` then answers 503."""
        return (self._error is None and not self._draining.is_set()
                and self._thread is not None and self._thread.is_alive())

    def failure(self) -> Optional[str]:
        """Why the engine failed (None while it has not)."""
        err = self._error
        return None if err is None else str(err)

    def fail(self, reason: str) -> None:
        """Mark the engine dead from outside its thread (rank 0's health monitor saw a
        worker rank die): ``/health`` turns 503 and every waiting request gets an error."""
        if self._error is None:
            self._error = EngineDeadError(reason)
        self._fail_all(EngineDeadError(reason))

    def begin_drain(self) -> None:
        """Refuse new requests (``/health`` and new requests answer 503); the ones in
        flight run to completion (SIGTERM: ``server/lifecycle.py``)."""
        self._draining.set()

    def abort_all(self) -> None:
        """End every request in flight now (the drain ran out of time, or a second signal):
        each caller gets a last output with ``finish_reason="abort"`` (streams then send
        their final chunk and ``[DONE]``), and requests still arriving are ended the same
        way. Runs on the engine thread, after the outputs already queued."""
        self._draining.set()
        self._commands.put(("abort_all", None))

    def num_in_flight(self) -> int:
        """Requests whose caller still waits for outputs."""
        with self._lock:
            return len(self._queues)

    def metrics(self) -> EngineMetrics:
        return self._metrics

    async def current_metrics(self) -> EngineMetrics:
        """``metrics()`` for the /metrics route (the same snapshot in this process)."""
        return self._metrics

    def default_params(self) -> Dict[str, Any]:
        return dict(self._defaults)

    # ---------------------------------------------------------------- tokenizer
    def encode(self, text: str) -> List[int]:
        return self.engine.tokenizer.encode(text)

    # ---------------------------------------------------------------- requests
    # ``generate`` (RequestStreams) calls these three once per request.
    def _open_stream(self, request_id: str) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self._register(request_id, (asyncio.get_running_loop(), q))
        return q

    def _submit(self, request_id: str, prompt_token_ids: List[int],
                params: SamplingParams) -> None:
        self._commands.put(("add", (request_id, prompt_token_ids, params)))

    def _close_stream(self, request_id: str) -> None:
        with self._lock:
            self._queues.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def submit(self, request_id: str, prompt_token_ids: List[int], params: SamplingParams,
               sink: OutputSink) -> None:
        """``generate`` for a caller in another process: the outputs go to ``sink``
        (the finished one last), or ``sink.fail`` is called (a request the engine's
        admission refuses, as in ``generate``). Raises ``EngineDeadError`` when the engine
        is not running, ``ValueError`` for a request id in use."""
        self._register(request_id, (sink, None))
        self._submit(request_id, list(prompt_token_ids), params)

    def _register(self, request_id: str, entry: Tuple[Any, Optional[asyncio.Queue]]) -> None:
        if not self.is_healthy():
            raise EngineDeadError("the engine loop is not running")
        with self._lock:
            if request_id in self._queues:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._queues[request_id] = entry

    def submitted_by(self, sink: OutputSink) -> List[str]:
        """The requests in flight whose outputs go to ``sink``."""
        with self._lock:
            return [rid for rid, (s, q) in self._queues.items() if s is sink and q is None]

    def abort_submitted(self, request_id: str) -> None:
        """The remote caller stopped waiting for ``request_id`` (``submit``)."""
        with self._lock:
            known = self._queues.pop(request_id, None) is not None
        if known:
            self.abort(request_id)

    # ---------------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_commands(block=not self.engine.has_unfinished())
                if self._stop.is_set():
                    break
                if not self.engine.has_unfinished():
                    continue
                outputs = self.engine.step()
                self._metrics = self.engine.metrics()
                self._deliver_step(outputs)
        except BaseException as e:  # the loop must never die silently
            self._error = e
            logger.error("engine loop died: %s\n%s", e, traceback.format_exc())
            self._fail_all(EngineDeadError(f"engine loop died: {e}"))

    def _drain_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd: Tuple[str, Any]) -> None:
        kind, arg = cmd
        if kind == "add":
            request_id, prompt, params = arg
            if self._aborting_all and request_id != _WARMUP_ID:
                self._deliver(_aborted(request_id))
                return
            try:
                self.engine.add_request(request_id, prompt, params)
            except ValueError as e:
                self._deliver_error(request_id, e)
        elif kind == "abort":
            self.engine.abort_request(arg)
            self._metrics = self.engine.metrics()
        elif kind == "abort_all":
            self._aborting_all = True
            self._abort_everything()

    def _abort_everything(self) -> None:
        with self._lock:
            waiting = [rid for rid in self._queues]
        for rid in list(self.engine.requests):
            if rid != _WARMUP_ID:
                self.engine.abort_request(rid)
        self._metrics = self.engine.metrics()
        for rid in waiting:
            self._deliver(_aborted(rid))
        if waiting:
            logger.warning("aborted %d request(s) still in flight", len(waiting))

    def _deliver(self, out: RequestOutput) -> None:
        if out.request_id == _WARMUP_ID:
            if out.finished:
                self._ready.set()
                logger.info("engine warm-up step done; ready to serve")
            return
        with self._lock:
            target = self._queues.get(out.request_id)
            if target is not None and target[1] is None and out.finished:
                del self._queues[out.request_id]  # a sink's request ends with its output
        if target is not None:
            sink, q = target
            if q is None:
                sink.deliver([out])
            else:
                sink.call_soon_threadsafe(q.put_nowait, out)

    def _deliver_step(self, outputs: List[RequestOutput]) -> None:
        """A step's outputs, handed to each event loop in one callback: one wake-up of the
        loop per step instead of one per request (at 256 streams, 16 us a token of lock,
        self-pipe write and callback scheduling on the engine thread)."""
        by_loop: Dict[asyncio.AbstractEventLoop, List[Tuple[asyncio.Queue, RequestOutput]]] = {}
        by_sink: Dict[OutputSink, List[RequestOutput]] = {}
        warm_up = []
        with self._lock:
            for out in outputs:
                target = self._queues.get(out.request_id)
                if target is None:
                    if out.request_id == _WARMUP_ID:
                        warm_up.append(out)
                elif target[1] is None:
                    by_sink.setdefault(target[0], []).append(out)
                    if out.finished:
                        del self._queues[out.request_id]
                else:
                    by_loop.setdefault(target[0], []).append((target[1], out))
        for out in warm_up:  # _deliver takes the lock itself
            self._deliver(out)
        for sink, outs in by_sink.items():
            sink.deliver(outs)
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that loop is already closed: nobody is waiting
                pass

    def _deliver_error(self, request_id: str, err: BaseException) -> None:
        with self._lock:
            target = self._queues.get(request_id)
            if target is not None and target[1] is None:
                del self._queues[request_id]
        if target is not None:
            self._send_error(request_id, target, err)

    def _fail_all(self, err: BaseException) -> None:
        with self._lock:
            targets = list(self._queues.items())
            for rid, (_, q) in targets:
                if q is None:
                    del self._queues[rid]
        for rid, target in targets:
            self._send_error(rid, target, err)

    @staticmethod
    def _send_error(request_id: str, target: Tuple[Any, Optional[asyncio.Queue]],
                    err: BaseException) -> None:
        sink, q = target
        if q is None:
            sink.fail(request_id, err)
            return
        try:
            sink.call_soon_threadsafe(q.put_nowait, err)
        except RuntimeError:  # that loop is already closed
            pass

    # ---------------------------------------------------------------- agent API (issue 15)
    def render_chat_prompt(self, messages: List[Dict[str, Any]],
                           **template_kwargs: Any) -> Tuple[str, List[int]]:
        """The rendered chat as text and as token ids (``Tokenizer.render_chat_prompt``)."""
        return self.engine.tokenizer.render_chat_prompt(messages, **template_kwargs)

    async def check_structured(self, spec: Any) -> None:
        """Compile a request's output constraint (cached for when the request is added);
        raises ``StructuredOutputError`` (a ValueError with ``param``). Runs in a worker
        thread: a large schema can take a while to compile and must not stall the loop."""
        await asyncio.get_running_loop().run_in_executor(None, self.engine.grammar.compile, spec)
