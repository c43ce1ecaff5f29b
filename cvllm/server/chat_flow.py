"""The agent flow of ``POST /v1/chat/completions``: tools, reasoning, MCP rounds.

Called by ``handlers.chat_completions`` (rank 0, event-loop thread, once per HTTP request)
when the request's ``ChatPlan`` needs parsing (tools offered, or a reasoning parser);
plain chats keep the handlers' faster text path. Builds one ``ChoiceRun`` per choice
(``agent.py``), merges their events in arrival order and answers one JSON body or an
SSE stream. Every run is closed in a ``finally``, so a failure or a vanished client
aborts whatever is still generating.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, List, Optional, Sequence, Tuple

from aiohttp import web

from cvllm.server.agent import ChoiceEvent, ChoiceRun, RunSetup
from cvllm.server.agent_plan import ChatPlan
from cvllm.server.chat import ChatShapes
from cvllm.server.context import ServerContext
from cvllm.server.errors import ApiError
from cvllm.server.middleware import json_dumps
from cvllm.server.params import fan_out, resolve_sampling_params
from cvllm.server.responses import cached_prompt_tokens
from cvllm.server.sse import SSEStream, cancel_on_disconnect, stream_error


async def agent_chat(request: web.Request, ctx: ServerContext, req: Any, plan: ChatPlan,
                     shapes: ChatShapes, kwargs: dict,
                     prompt: Tuple[str, List[int]]) -> web.StreamResponse:
    """Answer a chat request through parsers (and MCP rounds when MCP tools are offered)."""
    defaults, max_len = ctx.engine.default_params(), ctx.engine.max_model_len

    def params_for(prompt_len: int, index: int):
        params = resolve_sampling_params(req, defaults, prompt_len, max_len, "messages",
                                         plan.constraint, plan.skip_special_tokens)
        return fan_out(params, req.n)[index]

    setup = RunSetup(ctx.engine, plan, shapes.request_id, kwargs, params_for,
                     ctx.mcp if plan.mcp_names else None, ctx.settings.mcp_max_rounds)
    runs = [ChoiceRun(setup, i, req.messages, prompt) for i in range(req.n)]
    try:
        for run in runs:
            await run.start()
    except ValueError as exc:  # the engine refused the request (contract: ValueError)
        await _close(runs)
        raise ApiError(400, str(exc), param=getattr(exc, "param", None)) from None
    except BaseException:
        await _close(runs)
        raise
    async with cancel_on_disconnect(request):
        if req.stream:
            return await _stream(request, runs, shapes)
        return await _full(runs, shapes)


async def _close(runs: Sequence[ChoiceRun]) -> None:
    for run in runs:
        await run.aclose()


async def merged(runs: Sequence[ChoiceRun]) -> AsyncIterator[Tuple[ChoiceRun, Optional[ChoiceEvent]]]:
    """(run, event) in arrival order; (run, None) when that run has ended."""
    if len(runs) == 1:  # one choice is read directly: no task hop per token
        async for event in runs[0].events():
            yield runs[0], event
        yield runs[0], None
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(run: ChoiceRun) -> None:
        try:
            async for event in run.events():
                queue.put_nowait((run, event))
            queue.put_nowait((run, None))
        except Exception as exc:  # handed to the consumer, which raises it
            queue.put_nowait((run, exc))

    tasks = [asyncio.create_task(pump(run)) for run in runs]
    try:
        ended = 0
        while ended < len(runs):
            run, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            ended += item is None
            yield run, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _usage(runs: Sequence[ChoiceRun]) -> Tuple[int, int, int, int]:
    """(prompt, completion, cached, reasoning) tokens: the shared first prompt once, the
    later rounds' prompts of every choice, every round's output."""
    prompt = runs[0].prompt_tokens[0] + sum(sum(r.prompt_tokens[1:]) for r in runs)
    cached = cached_prompt_tokens([r.cached_tokens[0] if r.cached_tokens else 0 for r in runs])
    cached += sum(sum(r.cached_tokens[1:]) for r in runs)
    return (prompt, sum(r.completion_tokens for r in runs), cached,
            sum(r.reasoning_tokens for r in runs))


async def _full(runs: Sequence[ChoiceRun], shapes: ChatShapes) -> web.Response:
    try:
        async for _ in merged(runs):
            pass
    except ValueError as exc:
        raise ApiError(400, str(exc), param=getattr(exc, "param", None)) from None
    finally:
        await _close(runs)
    prompt, _, cached, _ = _usage(runs)
    body = shapes.agent_response([r.result() for r in runs], prompt, cached)
    return web.json_response(body, dumps=json_dumps)


async def _stream(request: web.Request, runs: Sequence[ChoiceRun],
                  shapes: ChatShapes) -> web.StreamResponse:
    sse = SSEStream(request)
    try:
        await sse.prepare()
        for run in runs:
            await sse.send(shapes.stream_start(run.index))
        async for run, event in merged(runs):
            if event is None:
                await sse.send(shapes.stream_finish(run.index, run.finish_reason or "abort"))
            else:
                await sse.send(_chunk(shapes, event))
        if shapes.include_usage:
            await sse.send(shapes.agent_usage_chunk(*_usage(runs)))
        await sse.done()
    except Exception as exc:  # a client gone away included
        await stream_error(sse, shapes.request_id, exc)
    finally:
        await _close(runs)
    return sse.response


def _chunk(shapes: ChatShapes, event: ChoiceEvent) -> Any:
    d = event.delta
    if d.content and not (d.reasoning or d.tool_calls or event.logprobs):
        return shapes.text_delta_json(event.index, d.content)  # pre-encoded plain text
    return shapes.delta_chunk(event.index, d.content, d.reasoning, d.tool_calls,
                              event.logprobs)
