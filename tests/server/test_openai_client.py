"""The official ``openai`` client against a real server on 127.0.0.1 in a background thread."""

import asyncio
import threading

import openai
import pytest

from cvllm.server import ServerSettings, build_app, start_server


class BackgroundServer:
    """Runs the app on its own event loop in a daemon thread; ``port`` is the bound one."""

    def __init__(self, engine, settings: ServerSettings):
        self.loop = asyncio.new_event_loop()
        self._app = build_app(engine, settings)
        self._settings = settings
        self._started = threading.Event()
        self.port = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        asyncio.set_event_loop(self.loop)
        self.runner = self.loop.run_until_complete(start_server(self._app, self._settings))
        self.port = self.runner.addresses[0][1]
        self._started.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.runner.cleanup())
        self.loop.close()

    def __enter__(self):
        self._thread.start()
        assert self._started.wait(5), "server did not start"
        return self

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


@pytest.fixture(scope="module")
def client(fake_engine_cls):
    settings = ServerSettings(host="127.0.0.1", port=0, api_key="k",
                              served_model_name="served")
    with BackgroundServer(fake_engine_cls(), settings) as server:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="k",
                            max_retries=0, timeout=5)


def test_models_list(client):
    assert [m.id for m in client.models.list()] == ["served"]
    assert client.models.retrieve("served").id == "served"


def test_chat_non_stream(client):
    out = client.chat.completions.create(
        model="served", messages=[{"role": "user", "content": "hello"}], temperature=0)
    assert out.choices[0].message.content == "hello"
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_chat_stream(client):
    stream = client.chat.completions.create(
        model="served", messages=[{"role": "user", "content": "hey"}], stream=True,
        stream_options={"include_usage": True}, max_tokens=2)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "he"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 2


def test_completions(client):
    out = client.completions.create(model="served", prompt="abc", max_tokens=5)
    assert out.choices[0].text == "abc" and out.usage.prompt_tokens == 3
    stream = client.completions.create(model="served", prompt="xy", stream=True)
    assert "".join(c.choices[0].text for c in stream) == "xy"


def test_errors_surface_as_openai_exceptions(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="served", messages=[])
    assert info.value.body["param"] == "messages"
    bad = openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
