"""The API-process channel in one process: ``runtime/api_host.ApiHost`` on one end of a
socket pair around an ``AsyncEngine`` (a stand-in runner, no model), ``RemoteEngine`` on
the other inside an event loop. Everything the handlers use crosses it as it would
between the two processes: readiness, streams equal to in-process ``generate``, aborts
freeing the engine's request, refused prompts and constraints as ValueErrors naming
their field, metrics now, drain, a failed engine failing its remote requests, and the API
side going away aborting what it left in flight."""

import asyncio
import signal
import socket

import pytest

from cvllm.runtime.api_host import ApiHost
from cvllm.runtime.api_launch import make_hello
from cvllm.sampling_params import SamplingParams, StructuredOutputs
from cvllm.server.remote_engine import EngineDeadError, EngineRequestError, RemoteEngine
from tests.engine.test_async_engine import CountingRunner, _engine, _wait, tokenizer  # noqa: F401

GREEDY = SamplingParams(temperature=0, max_tokens=5)


async def _connect(engine, tok):
    ours, theirs = socket.socketpair()
    engine._defaults = {"temperature": 0.5}
    host = ApiHost(engine, ours, make_hello(engine, {}, {}, 30.0))
    host.start()
    engine.start()
    reader, writer = await asyncio.open_unix_connection(sock=theirs)
    from cvllm.server.api_process import _read_hello

    got = await _read_hello(reader)
    remote = RemoteEngine(reader, writer, got, tok)
    task = asyncio.get_running_loop().create_task(remote.run())
    assert await _wait(remote.is_ready) and remote.is_healthy()
    return host, remote, task, writer


def _disconnect(engine, host, task=None, writer=None) -> None:
    import shutil

    if writer is not None:
        writer.close()
    if task is not None:
        task.cancel()
    host.close()
    engine.shutdown(1.0)
    shutil.rmtree(host._hello.tokenizer_dir, ignore_errors=True)


async def _collect(engine, rid, prompt, params):
    return [o async for o in engine.generate(rid, prompt, params)]


def test_requests_stream_through_the_channel(tokenizer):  # noqa: F811
    async def main():
        engine = _engine(tokenizer, CountingRunner(delay_s=0.003))
        host, remote, task, writer = await _connect(engine, tokenizer)
        assert remote.model_name == "m" and remote.default_params() == {"temperature": 0.5}
        assert remote.encode("hello there") == tokenizer.encode("hello there")
        msgs = [{"role": "user", "content": "hi"}]
        assert remote.render_chat_prompt(msgs) == tokenizer.render_chat_prompt(msgs)
        # two at once: each gets its own tokens, as in-process
        a, b = await asyncio.gather(_collect(remote, "a", [100, 101], GREEDY),
                                    _collect(remote, "b", [200], GREEDY))
        assert [t for o in a for t in o.delta_token_ids] == [102, 103, 104, 105, 106]
        assert [t for o in b for t in o.delta_token_ids] == [201, 202, 203, 204, 205]
        assert a[-1].finished and a[-1].finish_reason == "length" and a[-1].num_prompt_tokens == 2
        assert remote.num_in_flight() == 0 and engine.num_in_flight() == 0
        m = await remote.current_metrics()
        assert m.generation_tokens_total >= 10 and m is remote.metrics()
        # leaving a stream early aborts the request on the engine side
        gen = remote.generate("c", [5], SamplingParams(temperature=0, max_tokens=10_000))
        first = await gen.__anext__()
        assert first.delta_token_ids
        await gen.aclose()
        assert await _wait(lambda: "c" not in engine.engine.requests)
        # refused before the engine runs it: ValueErrors naming their field
        with pytest.raises(EngineRequestError, match="maximum context length"):
            await _collect(remote, "d", list(range(300)), GREEDY)
        with pytest.raises(ValueError) as e:
            await remote.check_structured(StructuredOutputs("json_schema", '{"type": "nope"}'))
        assert getattr(e.value, "param", None) == "response_format"
        await remote.check_structured(StructuredOutputs("regex", "[ab]+"))
        # a signal rank 0 got reaches the API side's handler, once
        seen = []
        remote.on_signal(seen.append)
        host.signal("SIGTERM")
        assert await _wait(lambda: seen == [signal.SIGTERM])
        remote.begin_drain()
        assert not remote.is_healthy()
        assert await _wait(lambda: not engine.is_healthy())
        _disconnect(engine, host, task, writer)

    asyncio.run(main())


def test_a_failed_engine_fails_remote_requests(tokenizer):  # noqa: F811
    async def main():
        engine = _engine(tokenizer, CountingRunner(delay_s=0.003))
        host, remote, task, writer = await _connect(engine, tokenizer)
        gen = remote.generate("x", [7], SamplingParams(temperature=0, max_tokens=10_000))
        await gen.__anext__()
        engine.fail("rank 1 is gone")
        with pytest.raises(EngineDeadError, match="rank 1 is gone"):
            async for _ in gen:
                pass
        assert await _wait(lambda: not remote.is_healthy())
        with pytest.raises(EngineDeadError):
            await _collect(remote, "y", [1], GREEDY)
        _disconnect(engine, host, task, writer)

    asyncio.run(main())


def test_the_api_side_leaving_aborts_its_requests(tokenizer):  # noqa: F811
    async def main():
        engine = _engine(tokenizer, CountingRunner(delay_s=0.003))
        host, remote, task, writer = await _connect(engine, tokenizer)
        gen = remote.generate("z", [9], SamplingParams(temperature=0, max_tokens=10_000))
        await gen.__anext__()
        assert "z" in engine.engine.requests
        task.cancel()
        writer.transport.abort()  # the API process died
        assert await _wait(host.closed.is_set)
        assert await _wait(lambda: "z" not in engine.engine.requests)
        assert engine.num_in_flight() == 0
        _disconnect(engine, host)

    asyncio.run(main())


def test_the_engine_side_closing_ends_the_api_side(tokenizer):  # noqa: F811
    async def main():
        engine = _engine(tokenizer, CountingRunner(delay_s=0.003))
        host, remote, task, writer = await _connect(engine, tokenizer)
        gen = remote.generate("w", [9], SamplingParams(temperature=0, max_tokens=10_000))
        await gen.__anext__()
        host.close()  # rank 0 went away
        # its reader and writer threads are over when close returns: a daemon thread that
        # ends later, while the interpreter finalizes, may free the engine's tensors there
        # and abort the exit (SIGABRT seen in tests/e2e/test_shutdown.py under load)
        assert [t for t in host._threads if t.is_alive()] == [] and len(host._threads) == 2
        await asyncio.wait_for(remote.closed_event.wait(), 5)
        with pytest.raises(EngineDeadError):
            async for _ in gen:
                pass
        assert not remote.is_ready() and not remote.is_healthy()
        _disconnect(engine, host)

    asyncio.run(main())


def test_a_tokenizer_that_cannot_travel_is_refused_before_anything_starts(tokenizer, tmp_path):  # noqa: F811
    """Saved and loaded back it must encode the probe as the original: else
    ``TokenizerStaysError`` (``cvllm serve`` then serves from one process)."""
    from types import SimpleNamespace

    from cvllm.runtime.api_launch import PROBE_TEXT, TokenizerStaysError, export_tokenizer

    info = export_tokenizer(tokenizer, str(tmp_path / "ok"))
    assert info["probe_ids"] == tokenizer.encode(PROBE_TEXT)

    def no_save(folder):
        raise OSError("read-only")

    unsaveable = SimpleNamespace(hf=SimpleNamespace(save_pretrained=no_save),
                                 encode=tokenizer.encode, chat_template_source="")
    with pytest.raises(TokenizerStaysError, match="cannot be saved"):
        export_tokenizer(unsaveable, str(tmp_path / "a"))
    shifted = SimpleNamespace(hf=tokenizer.hf, chat_template_source="",
                              encode=lambda text: [t + 1 for t in tokenizer.encode(text)])
    with pytest.raises(TokenizerStaysError, match="encodes differently"):
        export_tokenizer(shifted, str(tmp_path / "b"))
