"""/metrics through prometheus_client (issue 35 item 7): the classic text format unless
the scrape asks for OpenMetrics, both parsed back by prometheus_client's own parsers; the
registry is the application's own (nothing in the process-global one, no process or gc
series); and in the API process a scrape shows what rank 0's engine counted."""

import prometheus_client
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_om
from prometheus_client.parser import text_string_to_metric_families as parse_text

from cvllm.server import ServerSettings, build_app
from tests.engine.test_async_engine import CountingRunner, _engine, tokenizer  # noqa: F401
from tests.runtime.test_api_host import _connect, _disconnect

OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def _families(text, parse):
    return {f.name: f for f in parse(text)}


def _value(family, suffix="", **labels):
    (value,) = [s.value for s in family.samples
                if s.name == family.name + suffix and s.labels == labels]
    return value


async def test_classic_text_by_default(engine, make_client):
    async with make_client(engine) as client:
        for headers in (None, {"Accept": "text/plain"}, {"Accept": "*/*"}):
            resp = await client.get("/metrics", headers=headers)
            assert resp.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
            families = _families(await resp.text(), parse_text)
            assert families["cvllm_kv_blocks_free"].type == "gauge"
            assert _value(families["cvllm_kv_blocks_free"]) == 40
            # the classic parser drops a counter's _total from the family's name
            assert families["cvllm_prefix_cache_hits"].type == "counter"
            assert _value(families["cvllm_prefix_cache_hits"], "_total") == 640
            success = families["cvllm_request_success"]
            assert _value(success, "_total", finish_reason="stop") == 5
            assert _value(success, "_total", finish_reason="abort") == 0
            ttft = families["cvllm_time_to_first_token_seconds"]
            assert ttft.type == "histogram" and _value(ttft, "_count") == 0
            assert _value(ttft, "_bucket", le="+Inf") == 0


async def test_openmetrics_when_asked(engine, make_client):
    async with make_client(engine) as client:
        resp = await client.get("/metrics", headers={"Accept": "application/openmetrics-text"})
        assert resp.status == 200
        assert resp.headers["Content-Type"] == OPENMETRICS
        text = await resp.text()
    assert text.endswith("# EOF\n")
    families = _families(text, parse_om)  # raises on anything that is not OpenMetrics
    assert families["cvllm_steps"].type == "counter"
    assert _value(families["cvllm_generation_tokens"], "_total") == 456
    assert _value(families["cvllm_num_requests_running"]) == 2
    assert _value(families["cvllm_e2e_request_latency_seconds"], "_bucket", le="+Inf") == 0


async def test_the_registry_is_the_apps_own(engine, make_client, fake_engine_cls):
    build_app(fake_engine_cls(), ServerSettings())  # a second app in this process: no clash
    async with make_client(engine) as client:
        text = await (await client.get("/metrics")).text()
    names = {f.name for f in parse_text(text)}
    assert names and all(n.startswith("cvllm_") for n in names)  # no process_ or python_gc_
    assert not [m for m in prometheus_client.REGISTRY.collect() if m.name.startswith("cvllm")]


async def test_the_api_process_shows_what_rank_0_counted(tokenizer, make_client):  # noqa: F811
    engine = _engine(tokenizer, CountingRunner(delay_s=0.001))
    host, remote, task, writer = await _connect(engine, tokenizer)
    try:
        async with make_client(remote, ServerSettings(served_model_name="m")) as client:
            for k in (2, 3):
                resp = await client.post("/v1/completions", json={
                    "prompt": [5, 6, 7], "max_tokens": k, "ignore_eos": True})
                assert resp.status == 200
            text = await (await client.get("/metrics")).text()
        families = _families(text, parse_text)
        counted = engine.metrics()
        assert _value(families["cvllm_generation_tokens"], "_total") == \
            counted.generation_tokens_total >= 5
        assert _value(families["cvllm_request_success"], "_total", finish_reason="length") \
            == counted.requests_finished["length"] >= 2
        assert _value(families["cvllm_time_to_first_token_seconds"], "_count") == 2
    finally:
        _disconnect(engine, host, task, writer)
