"""Non-generation routes and cross-cutting behaviour: models, health, metrics, auth, errors."""

import subprocess
import sys
from pathlib import Path

import pytest

from cvllm.server import ServerSettings

GOOD_CHAT = {"model": "served", "messages": [{"role": "user", "content": "hello"}]}


def assert_error(body, type_="invalid_request_error", param=None):
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == type_ and isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param
    return err


async def still_serves(client, headers=None):
    resp = await client.post("/v1/chat/completions", json=GOOD_CHAT, headers=headers)
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["choices"][0]["message"]["content"] == "hello"


async def test_models(engine, make_client):
    async with make_client(engine) as client:
        body = await (await client.get("/v1/models")).json()
        assert body["object"] == "list" and [m["id"] for m in body["data"]] == ["served"]
        assert body["data"][0]["max_model_len"] == 64
        resp = await client.get("/v1/models/served")
        assert resp.status == 200 and (await resp.json())["id"] == "served"
        resp = await client.get("/v1/models/other/model")
        assert resp.status == 404
        assert_error(await resp.json(), "not_found_error", "model")


async def test_health_follows_engine(engine, make_client):
    async with make_client(engine) as client:
        engine.ready = False
        resp = await client.get("/health")
        assert resp.status == 503
        assert_error(await resp.json(), "server_error")
        resp = await client.post("/v1/chat/completions", json=GOOD_CHAT)
        assert resp.status == 503
        engine.ready = True
        resp = await client.get("/health")
        assert resp.status == 200 and await resp.json() == {"status": "ok"}
        engine.healthy = False
        assert (await client.get("/health")).status == 503
        engine.healthy = True
        await still_serves(client)


def metric_samples(text):
    """{'name{labels}': value} of exposition text (values as prometheus_client writes
    them: floats)."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            samples[key] = float(value)
    return samples


async def test_metrics(engine, make_client):
    async with make_client(engine) as client:
        resp = await client.get("/metrics")
        assert resp.status == 200 and resp.content_type == "text/plain"
        text = await resp.text()
    samples = metric_samples(text)
    for line in ["cvllm_num_requests_running 2", "cvllm_num_requests_waiting 1",
                 "cvllm_kv_blocks_total 100", "cvllm_kv_blocks_free 40",
                 "cvllm_prompt_tokens_total 123", "cvllm_generation_tokens_total 456",
                 "cvllm_preemptions_total 3", 'cvllm_request_success_total{finish_reason="stop"} 5',
                 "cvllm_kv_blocks_cached 7", "cvllm_prefix_cache_queries_total 900",
                 "cvllm_prefix_cache_hits_total 640",
                 "# TYPE cvllm_prefix_cache_hits_total counter",
                 'cvllm_request_success_total{finish_reason="abort"} 0',
                 "# TYPE cvllm_request_success_total counter",
                 "# TYPE cvllm_kv_blocks_free gauge"]:
        if line.startswith("#"):
            assert line in text.splitlines()
        else:
            key, _, value = line.rpartition(" ")
            assert samples[key] == float(value), line
    assert all(line.startswith("# HELP ") for line in text.splitlines()
               if line.startswith("#") and "TYPE" not in line)


async def test_api_key(engine, make_client):
    settings = ServerSettings(api_key="sekrit", served_model_name="served")
    async with make_client(engine, settings) as client:
        for headers in [None, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}]:
            resp = await client.post("/v1/chat/completions", json=GOOD_CHAT, headers=headers)
            assert resp.status == 401
            assert_error(await resp.json(), "authentication_error")
        assert (await client.get("/v1/models")).status == 401
        assert (await client.get("/health")).status == 200  # probes need no key
        assert (await client.get("/metrics")).status == 200  # nor do scrapers
        await still_serves(client, {"Authorization": "Bearer sekrit"})


async def test_unknown_route_and_method(engine, make_client):
    async with make_client(engine) as client:
        resp = await client.get("/v2/nothing")
        assert resp.status == 404
        assert_error(await resp.json(), "not_found_error")
        resp = await client.get("/v1/chat/completions")
        assert resp.status == 405 and "POST" in resp.headers["Allow"]
        assert_error(await resp.json())
        await still_serves(client)


async def test_body_too_large(engine, make_client):
    settings = ServerSettings(served_model_name="served", max_body_bytes=1024)
    async with make_client(engine, settings) as client:
        resp = await client.post("/v1/completions", data=b"{" + b" " * 4096 + b"}",
                                 headers={"Content-Type": "application/json"})
        assert resp.status == 413
        assert_error(await resp.json())
        await still_serves(client)


BAD_BODIES = [
    (b"{not json", None),
    (b"[1, 2, 3]", None),
    (b"", None),
    (b'{"model": "served"}', "messages"),
    (b'{"messages": []}', "messages"),
    (b'{"messages": {"role": "user"}}', "messages"),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', "temperature"),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": 5}', "temperature"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}', "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "x"}], "top_p": 0}', "top_p"),
    (b'{"messages": [{"role": "user", "content": "x"}], "n": 100}', "n"),
    (b'{"messages": [{"role": "assistant", "content": "x"}]}', "messages"),  # template error
]


@pytest.mark.parametrize("raw,param", BAD_BODIES)
async def test_bad_chat_bodies(engine, make_client, raw, param):
    async with make_client(engine) as client:
        resp = await client.post("/v1/chat/completions", data=raw,
                                 headers={"Content-Type": "application/json"})
        assert resp.status == 400, await resp.text()
        assert_error(await resp.json(), param=param)
        await still_serves(client)
    assert len(engine.started) == 1  # only the good request reached the engine


async def test_unknown_model_is_404(engine, make_client):
    async with make_client(engine) as client:
        resp = await client.post("/v1/chat/completions", json={**GOOD_CHAT, "model": "gpt-9"})
        assert resp.status == 404
        assert_error(await resp.json(), "not_found_error", "model")
        # The served name, the engine's own name and no name at all are accepted.
        for model in ["fake-model", None]:
            body = {**GOOD_CHAT, "model": model}
            assert (await client.post("/v1/chat/completions", json=body)).status == 200


@pytest.mark.parametrize("route,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 64}]}),
    ("/v1/completions", {"prompt": "y" * 70}),
    ("/v1/completions", {"prompt": list(range(1, 65))}),
])
async def test_prompt_too_long(engine, make_client, route, body):
    async with make_client(engine) as client:
        resp = await client.post(route, json=body)
        assert resp.status == 400
        err = assert_error(await resp.json())
        assert "64" in err["message"] and str(len(body.get("prompt") or "x" * 64)) in err["message"]
        assert err["code"] == "context_length_exceeded"
        await still_serves(client)


async def test_engine_refusal_is_400(engine, make_client):
    engine.fail_generate = ValueError("token id out of vocabulary")
    async with make_client(engine) as client:
        resp = await client.post("/v1/completions", json={"prompt": [999999]})
        assert resp.status == 400
        assert "vocabulary" in assert_error(await resp.json())["message"]


async def test_unexpected_error_is_500_and_server_survives(engine, make_client):
    engine.fail_generate = RuntimeError("boom")
    async with make_client(engine) as client:
        resp = await client.post("/v1/chat/completions", json=GOOD_CHAT)
        assert resp.status == 500
        err = assert_error(await resp.json(), "server_error")
        assert "boom" not in err["message"]  # internals stay in the log
        engine.fail_generate = None
        await still_serves(client)


def test_server_does_not_import_torch():
    code = "import sys, cvllm.server; sys.exit('torch' in sys.modules)"
    repo_root = Path(__file__).resolve().parents[2]
    assert subprocess.run([sys.executable, "-c", code], cwd=repo_root).returncode == 0
