"""The hardened HTTP edge (server/edge.py), over real sockets on a real port: connection
cap, idle / header / body timeouts, and 4xx JSON for bytes that are not valid Unicode."""

import asyncio
import contextlib
import json
import time

import aiohttp
import pytest

from cvllm.server import ServerSettings, build_app, start_server
from cvllm.server.errors import ApiError
from cvllm.server.request_body import parse_json_body

from .test_routes import GOOD_CHAT, assert_error


@contextlib.asynccontextmanager
async def edge_server(engine, **kw):
    """A server listening through EdgeSite; yields (port, site)."""
    settings = ServerSettings(host="127.0.0.1", port=0, served_model_name="served", **kw)
    runner = await start_server(build_app(engine, settings), settings)
    try:
        yield runner.addresses[0][1], next(iter(runner.sites))
    finally:
        await runner.cleanup()


async def read_all(reader, timeout=3.0):
    """Everything until the server closes -> (status, json body or None, seconds taken)."""
    start = time.monotonic()
    data = await asyncio.wait_for(reader.read(), timeout)
    took = time.monotonic() - start
    if not data:
        return None, None, took
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), (json.loads(body) if body else None), took


async def exchange(port, raw: bytes, timeout=3.0):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        return await read_all(reader, timeout)
    finally:
        writer.close()


async def read_response(reader) -> int:
    """One keep-alive response (Content-Length framed); returns its status."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    await reader.readexactly(length)
    return int(head.split()[1])


def chat_request(body: bytes, headers: bytes = b"") -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json"
            b"\r\n" + headers + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
            + body)


async def chat_ok(port) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                                json=GOOD_CHAT) as resp:
            assert resp.status == 200, await resp.text()


# ----------------------------------------------------------------------------- timeouts

async def test_bodies_that_never_come_are_closed_within_the_body_timeout(engine):
    async with edge_server(engine, body_timeout_s=0.5) as (port, site):
        stalled = []
        for _ in range(200):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{")
            stalled.append((reader, writer))
        start = time.monotonic()
        await chat_ok(port)  # served while 200 bodies are overdue
        results = await asyncio.gather(*(read_all(r) for r, _ in stalled))
        assert time.monotonic() - start < 0.5 + 1.5
        for status, body, _ in results:
            assert status == 408
            assert assert_error(body)["code"] == "body_timeout"
        for _, writer in stalled:
            writer.close()
        await asyncio.sleep(0.05)
        assert site.open_connections == 0
        await chat_ok(port)


async def test_slow_headers_get_408_after_the_header_timeout(engine):
    async with edge_server(engine, header_timeout_s=0.6, keepalive_timeout_s=5) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        start = time.monotonic()
        for line in (b"POST /v1/chat/completions HTTP/1.1\r\n", b"Host: t\r\n",
                     b"X-A: 1\r\n", b"X-B: 2\r\n", b"X-C: 3\r\n"):
            writer.write(line)  # a slowloris: one header line every 0.1 s, never the end
            await asyncio.sleep(0.1)
        status, body, _ = await read_all(reader)
        took = time.monotonic() - start
        writer.close()
        assert status == 408 and assert_error(body)["code"] == "header_timeout"
        # Counted from the first byte (a timer reset by each line would fire at 1.0 s),
        # and not the 5 s keep-alive.
        assert 0.6 <= took < 0.95


async def test_idle_connections_close_after_the_keepalive_timeout(engine):
    engine.token_delay = 0.1  # a request (5 tokens) outlasts the keep-alive timeout
    async with edge_server(engine, keepalive_timeout_s=0.3, header_timeout_s=5) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # silent
        status, _, took = await read_all(reader)
        assert status is None and 0.25 <= took < 1.5
        writer.close()

        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = json.dumps(GOOD_CHAT).encode()
        request = chat_request(body).replace(b"Connection: close", b"Connection: keep-alive")
        for _ in range(2):  # kept alive across requests longer than the idle timeout
            writer.write(request)
            assert await read_response(reader) == 200
        status, _, took = await read_all(reader)  # then idle: closed
        assert status is None and took < 1.5
        writer.close()


async def test_connections_over_the_cap_get_503(engine):
    async with edge_server(engine, max_connections=4) as (port, site):
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]
        await asyncio.sleep(0.05)
        assert site.open_connections == 4
        status, body, took = await exchange(port, b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        assert status == 503 and took < 0.5
        assert assert_error(body, "server_error")["code"] == "too_many_connections"
        for _, writer in held:
            writer.close()
        await asyncio.sleep(0.05)
        await chat_ok(port)


# ----------------------------------------------------------------------------- encodings

BAD_HEADER_VALUES = [b"a\xffb", b"a\xed\xa0\x80b", b"\xc3"]  # not UTF-8; a CESU surrogate


@pytest.mark.parametrize("value", BAD_HEADER_VALUES)
@pytest.mark.parametrize("name", [b"Authorization", b"User-Agent", b"Content-Type",
                                  b"X-Request-Id", b"Accept"])
async def test_header_values_that_are_not_utf8_are_400(engine, name, value):
    async with edge_server(engine, api_key="key") as (port, _):
        line = name + b": " + (b"Bearer key" + value if name == b"Authorization" else value)
        raw = chat_request(json.dumps(GOOD_CHAT).encode(), line + b"\r\n")
        if name != b"Authorization":
            raw = raw.replace(b"Host: t\r\n", b"Host: t\r\nAuthorization: Bearer key\r\n")
        if name == b"Content-Type":
            raw = raw.replace(b"Content-Type: application/json\r\n", b"", 1)
        status, body, _ = await exchange(port, raw)
        assert status == 400
        assert name.decode() in assert_error(body)["message"]


@pytest.mark.parametrize("raw", [
    b"GET /v1/models HTTP/1.1\r\nHost: t\r\nX-\xff: a\r\n\r\n",  # header name
    b"GET /v1/models/a\xffb HTTP/1.1\r\nHost: t\r\n\r\n",  # request target
    b"GET /v1/models HTTP/1.1\r\nHost: t\xed\xa0\x80\r\nConnection: close\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",  # TLS on the plain port
])
async def test_malformed_requests_get_json_4xx(engine, raw):
    async with edge_server(engine) as (port, _):
        status, body, _ = await exchange(port, raw)
        assert 400 <= status < 500
        assert_error(body)
        await chat_ok(port)


def chat(content="hi", **extra) -> dict:
    return {"model": "served", "messages": [{"role": "user", "content": content}], **extra}


S = "a\ud800b"  # json.dumps writes it as the escape "a\\ud800b"

SURROGATE_BODIES = [
    ("/v1/chat/completions", {"model": S, "messages": [{"role": "user", "content": "hi"}]},
     "model"),
    ("/v1/chat/completions", chat(S), "messages[0].content"),
    ("/v1/chat/completions", chat([{"type": "text", "text": "\udfff"}]),
     "messages[0].content[0].text"),
    ("/v1/chat/completions", {"messages": [{"role": S, "content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "name": S}]},
     "messages[0].name"),
    ("/v1/chat/completions", chat(stop=["ok", S]), "stop[1]"),
    ("/v1/chat/completions", chat(user=S), "user"),
    ("/v1/chat/completions", chat(chat_template_kwargs={"k": [S]}), "chat_template_kwargs.k[0]"),
    ("/v1/completions", {"prompt": S}, "prompt"),
    ("/v1/completions", {"prompt": [S]}, "prompt[0]"),
    ("/v1/completions", {"prompt": "hi", "stop": S}, "stop"),
]


@pytest.mark.parametrize("route,body,param", SURROGATE_BODIES)
async def test_lone_surrogates_in_any_field_are_400_naming_it(engine, make_client, route,
                                                              body, param):
    async with make_client(engine) as client:
        resp = await client.post(route, data=json.dumps(body),
                                 headers={"Content-Type": "application/json"})
        assert resp.status == 400
        assert_error(await resp.json(), param=param)
        assert not engine.started  # refused before the tokenizer or the engine


@pytest.mark.parametrize("raw", [
    b'{"messages": [{"role": "user", "content": "a\xed\xa0\x80b"}]}',  # encoded surrogate
    b'{"messages": [{"role": "user", "content": "a\xffb"}]}',
    b'{"model": "a\xc3", "messages": []}',
    '{"prompt": "x"}'.encode("utf-16"),
])
async def test_body_bytes_that_are_not_utf8_are_400(engine, make_client, raw):
    async with make_client(engine) as client:
        resp = await client.post("/v1/chat/completions", data=raw,
                                 headers={"Content-Type": "application/json"})
        assert resp.status == 400
        assert "UTF-8" in assert_error(await resp.json())["message"]


async def test_surrogate_pairs_and_a_bom_are_fine(engine, make_client):
    async with make_client(engine) as client:
        raw = b"\xef\xbb\xbf" + json.dumps(chat("a\U0001F600b")).encode()  # "\ud83d\ude00"
        assert b"\\ud83d\\ude00" in raw
        resp = await client.post("/v1/chat/completions", data=raw,
                                 headers={"Content-Type": "application/json"})
        assert resp.status == 200
        assert (await resp.json())["choices"][0]["message"]["content"] == "a\U0001F600b"


def test_a_surrogate_in_a_key_is_named_escaped():
    with pytest.raises(ApiError) as info:
        parse_json_body(json.dumps({"chat_template_kwargs": {"a\ud800": 1}}).encode())
    assert info.value.param == "chat_template_kwargs.a\\ud800"
    assert info.value.param.encode("utf-8")


async def test_a_model_path_with_bad_escapes_is_a_json_404(engine, make_client):
    async with make_client(engine) as client:
        for path in ("/v1/models/a%ffb", "/v1/models/a%ed%a0%80b"):
            resp = await client.get(path)
            assert resp.status == 404
            assert_error(await resp.json(), "not_found_error", "model")
