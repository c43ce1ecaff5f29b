"""A prompt that fills the context is refused on every path, by the one rule that checks
it (``core/prompt_limits.check_prompt_length``, issue 35): the HTTP routes answer a 400
with the same message, ``param`` and code for chat, completions and streams, whether the
engine runs in this process (``AsyncEngine``) or behind the API process's channel
(``RemoteEngine`` over a socket pair to an ``ApiHost``), and the engine's own admission
refuses a caller that skips the server (``tests/engine`` has the offline ``LLM``)."""

import contextlib

import pytest

from cvllm.server import ServerSettings
from tests.engine.test_async_engine import CountingRunner, _engine, _wait, tokenizer  # noqa: F401
from tests.runtime.test_api_host import _connect, _disconnect

MAX_MODEL_LEN = 256  # tests.engine.test_async_engine._engine's


def _message(n: int) -> str:
    return (f"This model's maximum context length is {MAX_MODEL_LEN} tokens; your prompt "
            f"has {n} tokens, which leaves no room to generate. Please shorten the prompt.")


@contextlib.asynccontextmanager
async def _serving(tokenizer, remote: bool):  # noqa: F811
    """The engine face the server holds: the AsyncEngine itself or a RemoteEngine."""
    engine = _engine(tokenizer, CountingRunner(delay_s=0.001))
    if not remote:
        engine.start()
        try:
            assert await _wait(engine.is_ready)
            yield engine
        finally:
            engine.shutdown(1.0)
        return
    host, face, task, writer = await _connect(engine, tokenizer)
    try:
        yield face
    finally:
        _disconnect(engine, host, task, writer)


def _cases(tokenizer):  # noqa: F811
    words = "word " * 400
    chat_len = len(tokenizer.render_chat_prompt([{"role": "user", "content": words}])[1])
    return [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": words}]},
         "messages", chat_len),
        ("/v1/completions", {"prompt": words}, "prompt", len(tokenizer.encode(words))),
        ("/v1/completions", {"prompt": list(range(1, MAX_MODEL_LEN + 1))}, "prompt",
         MAX_MODEL_LEN),
    ]


@pytest.mark.parametrize("remote", [False, True], ids=["in-process", "api-process"])
async def test_every_route_refuses_on_both_paths(tokenizer, make_client, remote):  # noqa: F811
    cases = _cases(tokenizer)
    async with _serving(tokenizer, remote) as face:
        async with make_client(face, ServerSettings(served_model_name="m")) as client:
            for route, body, param, n in cases:
                for stream in (False, True):
                    resp = await client.post(route, json={**body, "stream": stream})
                    assert resp.status == 400, (route, stream, await resp.text())
                    err = (await resp.json())["error"]
                    assert err == {"message": _message(n), "type": "invalid_request_error",
                                   "param": param, "code": "context_length_exceeded"}
            # one token less fits: the room left is one token
            resp = await client.post("/v1/completions", json={
                "prompt": list(range(1, MAX_MODEL_LEN)), "max_tokens": 5})
            body = await resp.json()
            assert resp.status == 200 and body["usage"]["completion_tokens"] == 1, body


async def test_empty_prompt_is_refused_on_both_paths(tokenizer, make_client):  # noqa: F811
    for remote in (False, True):
        async with _serving(tokenizer, remote) as face:
            async with make_client(face, ServerSettings(served_model_name="m")) as client:
                for stream in (False, True):
                    # "" encodes to no token at all: the engine's rule refuses it
                    resp = await client.post("/v1/completions",
                                             json={"prompt": "", "stream": stream})
                    assert resp.status == 400
                    err = (await resp.json())["error"]
                    assert err == {"message": "The prompt is empty.", "param": "prompt",
                                   "type": "invalid_request_error", "code": None}, err
