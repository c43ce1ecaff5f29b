"""``generate``'s loop, shared by the two engines a handler may hold: ``AsyncEngine`` (the
engine thread of this process) and ``server/remote_engine.RemoteEngine`` (rank 0's engine
over the channel, in the API process).

Each request's outputs arrive on an ``asyncio.Queue`` of its own, read by the handler's
``async for`` on the event loop; how a queue is opened, how the request is sent and how it
is let go are the engine's (``RequestStreams``' three hooks, called once per request).
Torch-free: the API process imports it.
"""

from __future__ import annotations

import abc
import asyncio
from typing import AsyncIterator, List

from cvllm.outputs import RequestOutput
from cvllm.sampling_params import SamplingParams


class RequestStreams(abc.ABC):
    """``generate`` over one output queue per request."""

    async def generate(self, request_id: str, prompt_token_ids: List[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Yield this request's outputs until it finishes. Leaving early (the client went
        away, the handler was cancelled) aborts the request and frees its KV blocks. A
        request the engine's admission refuses (``LLMEngine.add_request``: an empty or too
        long prompt, a token out of the vocabulary) raises its ``ValueError`` here."""
        q = self._open_stream(request_id)
        finished = False
        try:
            self._submit(request_id, list(prompt_token_ids), params)
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True  # refused, or the engine died: the engine let it go
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._close_stream(request_id)
            if not finished:
                self.abort(request_id)

    @abc.abstractmethod
    def _open_stream(self, request_id: str) -> asyncio.Queue:
        """A new output queue registered for ``request_id``; raises the engine's
        ``EngineDeadError`` when it takes no requests, ``ValueError`` for an id in use."""

    @abc.abstractmethod
    def _submit(self, request_id: str, prompt_token_ids: List[int],
                params: SamplingParams) -> None:
        """Hand the request to the engine."""

    @abc.abstractmethod
    def _close_stream(self, request_id: str) -> None:
        """Forget the request's queue (its outputs from now on are dropped)."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """Stop the request on the engine side (a no-op once the engine is gone)."""
