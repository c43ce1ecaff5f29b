"""The generation routes: ``POST /v1/chat/completions`` and ``POST /v1/completions``.

Run per HTTP request on rank 0's event loop. Each handler parses the body
(``request_body``, then ``chat`` or ``completions``), tokenizes through the engine,
resolves sampling params (``params``), compiles an output constraint once (a 400 naming
its field when the grammar engine refuses it), fans out n engine requests
(``generation``) and answers either one JSON body or an SSE stream (``sse``). A chat
request with tools, MCP tools or a reasoning parser goes through ``chat_flow`` instead
(its ``ChatPlan`` from ``agent_plan`` says so); plain chats keep this text path.
The ``GenerationGroup`` is closed in a ``finally``, so a client that disconnects or an
error aborts whatever is still running in the engine. A vanished client is noticed by
``sse.cancel_on_disconnect`` (aiohttp itself cancels the handler only when the runner was
given ``handler_cancellation=True``, which ``web.run_app`` does not do by default).
"""

from __future__ import annotations

import uuid
from typing import Any, Callable, List, Optional, Tuple, Union

from aiohttp import web

from cvllm.server.agent_plan import constraint_field, plan_chat
from cvllm.server.chat import ChatShapes, parse_chat_request
from cvllm.server.chat_flow import agent_chat
from cvllm.server.completions import CompletionShapes, parse_completion_request
from cvllm.server.context import CONTEXT_KEY, ServerContext
from cvllm.server.errors import ApiError
from cvllm.server.generation import ChoiceState, GenerationGroup
from cvllm.server.middleware import json_dumps
from cvllm.server.params import fan_out, resolve_sampling_params
from cvllm.server.request_body import parse_json_body
from cvllm.server.responses import cached_prompt_tokens
from cvllm.server.sse import SSEStream, cancel_on_disconnect, stream_error

Shapes = Union[ChatShapes, CompletionShapes]


async def _parse(request: web.Request,
                 parse: Callable[[dict], Any]) -> Tuple[ServerContext, dict, Any]:
    """(context, JSON body, ``parse(body)``) once the model named is ours and the engine
    is ready."""
    ctx = request.app[CONTEXT_KEY]
    # request.read() raises HTTPRequestEntityTooLarge (413) past client_max_size.
    body = parse_json_body(await request.read())
    req = parse(body)
    ctx.check_model(req.model)
    ctx.check_ready()
    return ctx, body, req


async def chat_completions(request: web.Request) -> web.StreamResponse:
    ctx, body, req = await _parse(request, parse_chat_request)
    plan = plan_chat(req, body, ctx.settings, ctx.mcp)
    kwargs = template_kwargs(req, plan)
    try:
        prompt = ctx.engine.render_chat_prompt(req.messages, **kwargs)
    except ValueError as exc:  # template errors (e.g. roles out of order) are the client's
        raise ApiError(400, f"Could not apply the chat template: {exc}",
                       param="messages") from None
    params = resolve_sampling_params(req, ctx.engine.default_params(), len(prompt[1]),
                                     ctx.engine.max_model_len, "messages", plan.constraint,
                                     plan.skip_special_tokens)
    await check_constraint(ctx, plan.constraint, plan.constraint_param)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    shapes = ChatShapes(request_id, ctx.model_name, req.stream and req.include_usage,
                        req.num_logprobs)
    if plan.agentic:
        return await agent_chat(request, ctx, req, plan, shapes, kwargs, prompt)
    return await _generate(request, ctx, shapes, prompt[1], params, req.n, req.stream)


def template_kwargs(req, plan) -> dict:
    """The chat template's variables: the client's ``chat_template_kwargs`` and, as
    transformers' ``apply_chat_template`` passes them, the offered ``tools`` (ours win a
    clash, and one dict means no keyword can be given twice)."""
    kwargs = dict(req.chat_template_kwargs)
    if plan.template_tools is not None:
        kwargs["tools"] = plan.template_tools
    return kwargs


async def check_constraint(ctx: ServerContext, spec, param: Optional[str]) -> None:
    """Compile the output constraint before anything runs: one the grammar engine refuses
    is a 400 naming the request field it came from."""
    if spec is None:
        return
    try:
        await ctx.engine.check_structured(spec)
    except ValueError as exc:
        raise ApiError(400, str(exc), param=param or getattr(exc, "param", None)) from None


async def completions(request: web.Request) -> web.StreamResponse:
    ctx, body, req = await _parse(request, parse_completion_request)
    if isinstance(req.prompt, str):
        prompt_ids = list(ctx.engine.encode(req.prompt))
    else:
        prompt_ids = req.prompt
    params = resolve_sampling_params(req, ctx.engine.default_params(), len(prompt_ids),
                                     ctx.engine.max_model_len, "prompt", req.structured_outputs)
    await check_constraint(ctx, req.structured_outputs, constraint_field(body))
    request_id = f"cmpl-{uuid.uuid4().hex}"
    shapes = CompletionShapes(request_id, ctx.model_name, req.stream and req.include_usage,
                              req.num_logprobs)
    return await _generate(request, ctx, shapes, prompt_ids, params, req.n, req.stream)


def _engine_request_ids(request_id: str, n: int) -> List[str]:
    return [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]


async def _generate(request: web.Request, ctx: ServerContext, shapes: Shapes,
                    prompt_ids: List[int], params, n: int, stream: bool) -> web.StreamResponse:
    group = GenerationGroup(ctx.engine, _engine_request_ids(shapes.request_id, n),
                            prompt_ids, fan_out(params, n))
    try:
        await group.start()
    except ValueError as exc:  # the engine refused the request (contract: ValueError)
        raise ApiError(400, str(exc), param=getattr(exc, "param", None)) from None
    async with cancel_on_disconnect(request):
        if stream:
            return await _stream_response(request, group, shapes, len(prompt_ids))
        return await _full_response(group, shapes, len(prompt_ids))


async def _full_response(group: GenerationGroup, shapes: Shapes,
                         prompt_tokens: int) -> web.Response:
    states = [ChoiceState(i) for i in range(group.n)]
    try:
        async for index, out in group.outputs():
            states[index].add(out)
    except ValueError as exc:
        raise ApiError(400, str(exc), param=getattr(exc, "param", None)) from None
    finally:
        # Also runs on CancelledError when the client disconnects: aborts in the engine.
        await group.aclose()
    body = shapes.response([s.result() for s in states], prompt_tokens)
    return web.json_response(body, dumps=json_dumps)


async def _stream_response(request: web.Request, group: GenerationGroup, shapes: Shapes,
                           prompt_tokens: int) -> web.StreamResponse:
    sse = SSEStream(request)
    states = [ChoiceState(i) for i in range(group.n)]
    try:
        await sse.prepare()
        for state in states:
            first = shapes.stream_start(state.index)
            if first is not None:
                await sse.send(first)
        async for index, out in group.outputs():
            state = states[index]
            offset = state.text_len
            state.add(out)
            if out.logprobs:
                await sse.send(shapes.stream_delta(index, out.delta_text, out.logprobs, offset))
            elif out.delta_text:
                await sse.send(shapes.text_delta_json(index, out.delta_text))
            if out.finished:
                await sse.send(shapes.stream_finish(index, state.finish_reason))
        for state in states:
            if not state.finished:
                await sse.send(shapes.stream_finish(state.index, "abort"))
        if shapes.include_usage:
            used = sum(s.num_output_tokens for s in states)
            cached = cached_prompt_tokens([s.num_cached_tokens for s in states])
            await sse.send(shapes.usage_chunk(prompt_tokens, used, cached))
        await sse.done()
    except Exception as exc:  # a client gone away included
        await stream_error(sse, shapes.request_id, exc)
    finally:
        await group.aclose()
    return sse.response
