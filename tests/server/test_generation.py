"""Chat and completions end to end against the FakeEngine: bodies, SSE, n, logprobs, aborts."""

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from cvllm.server import ServerSettings, build_app, sse


def chat_body(text="hello", **kw):
    return {"model": "served", "messages": [{"role": "user", "content": text}], **kw}


async def sse_events(resp):
    """The JSON payloads of an SSE response, and whether it ended with [DONE]."""
    assert resp.status == 200, await resp.text()
    assert resp.content_type == "text/event-stream"
    raw = await resp.text()
    assert raw.endswith("\n\n")
    events = [e[len("data: "):] for e in raw.split("\n\n") if e]
    assert all(e for e in events)
    done = events[-1] == "[DONE]"
    return [json.loads(e) for e in events if e != "[DONE]"], done


async def wait_for(predicate, timeout=3.0):
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def check_usage(usage, prompt_tokens, completion_tokens, cached_tokens=0):
    assert usage == {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                     "total_tokens": prompt_tokens + completion_tokens,
                     "prompt_tokens_details": {"cached_tokens": cached_tokens}}


async def test_chat_non_stream(engine, make_client):
    async with make_client(engine) as client:
        resp = await client.post("/v1/chat/completions", json=chat_body("hello"))
        body = await resp.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["model"] == "served" and isinstance(body["created"], int)
    choice = body["choices"][0]
    assert choice == {"index": 0, "message": {"role": "assistant", "content": "hello"},
                      "logprobs": None, "finish_reason": "stop"}
    check_usage(body["usage"], 5, 5)
    assert engine.finished == [body["id"]] and engine.aborted == []


@pytest.mark.parametrize("extra,content,reason,tokens", [
    ({"max_tokens": 3}, "hel", "length", 3),
    ({"max_completion_tokens": 2, "max_tokens": 4}, "he", "length", 2),
    ({"stop": "l"}, "he", "stop", 3),
    ({"stop": ["o", "x"], "max_tokens": 10}, "hell", "stop", 5),
    ({"ignore_eos": True, "max_tokens": 7}, "hellohe", "length", 7),
])
async def test_chat_stop_and_length(engine, make_client, extra, content, reason, tokens):
    async with make_client(engine) as client:
        body = await (await client.post("/v1/chat/completions",
                                        json=chat_body("hello", **extra))).json()
    assert body["choices"][0]["message"]["content"] == content
    assert body["choices"][0]["finish_reason"] == reason
    check_usage(body["usage"], 5, tokens)


async def test_max_tokens_capped_to_context(engine, make_client):
    engine.max_model_len = 8
    async with make_client(engine) as client:
        body = await (await client.post("/v1/chat/completions",
                                        json=chat_body("hello", max_tokens=100,
                                                       ignore_eos=True))).json()
    assert body["choices"][0]["finish_reason"] == "length"
    check_usage(body["usage"], 5, 3)  # 8 - 5 tokens of room


async def test_server_defaults_apply(engine, make_client):
    engine.defaults = {"temperature": 0.0, "top_k": 4, "max_gen_tokens": 2}
    async with make_client(engine) as client:
        body = await (await client.post("/v1/chat/completions", json=chat_body())).json()
        assert body["usage"]["completion_tokens"] == 2
        await client.post("/v1/chat/completions", json=chat_body(temperature=0.5, top_k=9))
    first, second = engine.started.values()
    assert (first.temperature, first.top_k, first.max_tokens) == (0.0, 4, 2)
    assert (second.temperature, second.top_k) == (0.5, 9)


async def test_chat_stream_with_usage(engine, make_client):
    async with make_client(engine) as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(
            "hey", stream=True, stream_options={"include_usage": True}))
        chunks, done = await sse_events(resp)
    assert done
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-2])
    assert text == "hey"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and all(c["usage"] is None for c in chunks[:-1])
    check_usage(chunks[-1]["usage"], 3, 3)


async def test_chat_stream_without_usage(engine, make_client):
    async with make_client(engine) as client:
        chunks, done = await sse_events(await client.post(
            "/v1/chat/completions", json=chat_body("ab", stream=True, max_tokens=1)))
    assert done and "usage" not in chunks[-1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_n_choices_fan_out(engine, make_client):
    async with make_client(engine) as client:
        body = await (await client.post("/v1/chat/completions",
                                        json=chat_body("hi", n=3, seed=7))).json()
        chunks, done = await sse_events(await client.post(
            "/v1/chat/completions", json=chat_body("hi", n=2, stream=True)))
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == "hi" for c in body["choices"])
    check_usage(body["usage"], 2, 6)
    ids = list(engine.started)[:3]
    assert len(set(ids)) == 3 and all(i.startswith(body["id"]) for i in ids)
    assert [engine.started[i].seed for i in ids] == [7, 8, 9]
    assert all(engine.started[i].n == 1 for i in ids)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"]["role"] == "assistant" and mine[-1]["finish_reason"] == "stop"
        assert "".join(c["delta"].get("content", "") for c in mine) == "hi"
    assert done


async def test_chat_logprobs(engine, make_client):
    async with make_client(engine) as client:
        body = await (await client.post("/v1/chat/completions", json=chat_body(
            "ab", logprobs=True, top_logprobs=1))).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == ["a", "b"]
    assert content[0] == {"token": "a", "logprob": -0.25, "bytes": [97],
                          "top_logprobs": [{"token": "a", "logprob": -0.25, "bytes": [97]}]}


async def test_cached_tokens_in_usage(engine, make_client):
    """``usage.prompt_tokens_details.cached_tokens``: the engine's prefix-cache hit; with
    n choices the prompt tokens none of them computed (the smallest hit)."""
    engine.cached_tokens = lambda rid: 1 if rid.endswith("-0") else 4
    async with make_client(engine) as client:
        body = await (await client.post("/v1/chat/completions", json=chat_body("hello"))).json()
        check_usage(body["usage"], 5, 5, cached_tokens=4)
        body = await (await client.post("/v1/completions", json={
            "prompt": "abcde", "max_tokens": 2, "n": 2})).json()
        check_usage(body["usage"], 5, 4, cached_tokens=1)
        chunks, _ = await sse_events(await client.post("/v1/chat/completions", json=chat_body(
            "hey", n=2, stream=True, stream_options={"include_usage": True})))
        check_usage(chunks[-1]["usage"], 3, 6, cached_tokens=1)
        engine.cached_tokens = lambda rid: 2
        chunks, _ = await sse_events(await client.post("/v1/completions", json={
            "prompt": "abc", "stream": True, "stream_options": {"include_usage": True}}))
        check_usage(chunks[-1]["usage"], 3, 3, cached_tokens=2)


async def test_completions_non_stream_and_stream(engine, make_client):
    async with make_client(engine) as client:
        body = await (await client.post("/v1/completions", json={
            "model": "served", "prompt": "abc", "max_tokens": 2, "logprobs": 2})).json()
        chunks, done = await sse_events(await client.post("/v1/completions", json={
            "prompt": [104, 105], "stream": True, "stream_options": {"include_usage": True}}))
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    choice = body["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("ab", "length")
    assert choice["logprobs"]["tokens"] == ["a", "b"]
    assert choice["logprobs"]["text_offset"] == [0, 1]
    assert choice["logprobs"]["top_logprobs"][0] == {"a": -0.25, "z": -2.0}
    check_usage(body["usage"], 3, 2)
    assert done and all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "hi"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    check_usage(chunks[-1]["usage"], 2, 2)


async def test_chat_template_kwargs_passed(engine, make_client):
    async with make_client(engine) as client:
        await client.post("/v1/chat/completions", json=chat_body(
            chat_template_kwargs={"enable_thinking": False, "messages": "clash",
                                  "bos_token": "x"}))
    assert engine.template_kwargs == [{"enable_thinking": False}]


async def test_stream_disconnect_aborts(fake_engine_cls, make_client):
    engine = fake_engine_cls(max_model_len=100_000, token_delay=0.01)
    async with make_client(engine) as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(
            "abc", stream=True, ignore_eos=True, max_tokens=10_000))
        for _ in range(3):
            assert (await resp.content.readline()).startswith(b"data: ")
            await resp.content.readline()
        resp.close()  # drop the connection mid-stream
        await wait_for(lambda: len(engine.aborted) == 1)
        assert engine.aborted == list(engine.started) and engine.finished == []
        body = await (await client.post("/v1/chat/completions", json=chat_body("ok"))).json()
        assert body["choices"][0]["message"]["content"] == "ok"


async def test_non_stream_disconnect_aborts(fake_engine_cls, make_client):
    engine = fake_engine_cls(max_model_len=100_000, token_delay=0.01)
    async with make_client(engine) as client:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(client.post("/v1/chat/completions", json=chat_body(
                "abc", n=2, ignore_eos=True, max_tokens=10_000)), timeout=0.2)
        await wait_for(lambda: len(engine.aborted) == 2)
        assert sorted(engine.aborted) == sorted(engine.started) and engine.finished == []


async def test_error_mid_stream_becomes_event(engine, make_client):
    engine.fail_after = 2
    async with make_client(engine) as client:
        chunks, done = await sse_events(await client.post(
            "/v1/chat/completions", json=chat_body("hello", stream=True)))
        assert done and chunks[-1]["error"]["type"] == "server_error"
        assert "".join(c["choices"][0]["delta"].get("content", "")
                       for c in chunks[:-1]) == "he"
        assert engine.aborted == list(engine.started)
        engine.fail_after = None
        body = await (await client.post("/v1/chat/completions", json=chat_body("ok"))).json()
        assert body["choices"][0]["message"]["content"] == "ok"


async def test_disconnect_aborts_without_handler_cancellation(fake_engine_cls, monkeypatch):
    """``web.run_app`` defaults to handler_cancellation=False; the poll must catch it."""
    monkeypatch.setattr(sse, "DISCONNECT_POLL_S", 0.02)
    engine = fake_engine_cls(max_model_len=100_000, token_delay=0.01)
    runner = web.AppRunner(build_app(engine, ServerSettings()), handler_cancellation=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession() as session:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(session.post(
                    f"http://127.0.0.1:{port}/v1/completions",
                    json={"prompt": "abc", "ignore_eos": True, "max_tokens": 10_000}), 0.2)
        await wait_for(lambda: len(engine.aborted) == 1)
        assert engine.aborted == list(engine.started)
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("kind", ["chat", "completions"])
@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("want_logprobs", [None, 2])
def test_text_delta_template_equals_the_chunk_it_stands_for(kind, include_usage, want_logprobs):
    """The streamed path's pre-encoded text chunk is the JSON of ``stream_delta``."""
    from cvllm.server.chat import ChatShapes
    from cvllm.server.completions import CompletionShapes

    cls = ChatShapes if kind == "chat" else CompletionShapes
    shapes = cls("id-1", "m", include_usage, want_logprobs)
    for index in (0, 3, 0):
        for text in ("hi", "", 'quote " and \\ and \n', "\u00e9\u4f60\U0001f916", "\x00x"):
            fast = shapes.text_delta_json(index, text)
            assert json.loads(fast) == json.loads(json.dumps(shapes.stream_delta(index, text, [])))
