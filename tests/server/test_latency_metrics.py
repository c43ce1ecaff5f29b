"""Latency histograms on /metrics (issue 14 item 3): time to first token, inter-token
latency, end-to-end latency and queue time, in the Prometheus histogram format, with
counts that match the requests made through the HTTP API (a real AsyncEngine and
LLMEngine around a stand-in runner; the server's warm-up request is not counted)."""

import asyncio
import re

from cvllm.outputs import EngineMetrics, Histogram
from cvllm.server import ServerSettings
from cvllm.server.metrics import build_registry, exposition

NAMES = ("cvllm_time_to_first_token_seconds", "cvllm_inter_token_latency_seconds",
         "cvllm_e2e_request_latency_seconds", "cvllm_request_queue_time_seconds")


def render_metrics(metrics):
    """One snapshot as the classic exposition text, through the app's own path."""
    return exposition(build_registry(lambda: metrics), None)[0].decode("utf-8")


def _count(value):
    """A count as exposed (prometheus_client writes every sample value as a float)."""
    assert float(value).is_integer(), value
    return int(float(value))


def _histogram(text, name):
    """{le: cumulative count}, sum, count of one histogram in exposition text."""
    buckets = {m.group(1): _count(m.group(2)) for m in
               re.finditer(rf'^{name}_bucket{{le="([^"]+)"}} (\S+)$', text, re.M)}
    total = float(re.search(rf"^{name}_sum (\S+)$", text, re.M).group(1))
    count = _count(re.search(rf"^{name}_count (\S+)$", text, re.M).group(1))
    assert f"# TYPE {name} histogram" in text.splitlines()
    return buckets, total, count


def test_histogram_observe_and_exposition():
    h = Histogram((0.1, 1.0, 10.0))
    for v in (0.05, 0.1, 0.5, 1.0, 3.0, 99.0):
        h.observe(v)
    assert h.counts == [2, 2, 1, 1] and h.count == 6  # "le" includes the bound itself
    m = EngineMetrics()
    m.latency.time_to_first_token = h
    text = render_metrics(m)
    buckets, total, count = _histogram(text, "cvllm_time_to_first_token_seconds")
    assert buckets == {"0.1": 2, "1.0": 4, "10.0": 5, "+Inf": 6}
    assert abs(total - 103.65) < 1e-9 and count == 6
    for name in NAMES[1:]:  # never observed: present, all zero
        buckets, total, count = _histogram(text, name)
        assert count == 0 and total == 0 and set(buckets.values()) == {0}
    # vLLM's buckets by default
    fresh = render_metrics(EngineMetrics())
    assert _histogram(fresh, "cvllm_time_to_first_token_seconds")[0]["2560.0"] == 0
    assert _histogram(fresh, "cvllm_inter_token_latency_seconds")[0]["0.01"] == 0
    assert _histogram(fresh, "cvllm_request_queue_time_seconds")[0]["7680.0"] == 0


def test_snapshot_is_a_copy():
    from cvllm.outputs import LatencyHistograms

    live = LatencyHistograms()
    snap = live.copy()
    live.time_to_first_token.observe(1.0)
    assert snap.time_to_first_token.count == 0 and live.time_to_first_token.count == 1


async def test_metrics_counts_match_requests(make_client):
    from tests.engine.test_async_engine import CountingRunner, _engine, _wait
    from cvllm import loader
    from cvllm.engine.tokenizer import Tokenizer
    from cvllm.loader.default_model import default_model_path

    tokenizer = Tokenizer(loader.load_tokenizer(
        loader.resolve_model_source(None, str(default_model_path()))))
    engine = _engine(tokenizer, CountingRunner(delay_s=0.002))
    engine.start()
    try:
        assert await _wait(engine.is_ready)
        async with make_client(engine, ServerSettings(served_model_name="m")) as client:
            bodies = [{"prompt": "hello there", "max_tokens": k, "ignore_eos": True}
                      for k in (1, 4, 6)]
            resps = await asyncio.gather(*(client.post("/v1/completions", json=b)
                                           for b in bodies))
            assert [r.status for r in resps] == [200, 200, 200]
            text = await (await client.get("/metrics")).text()
    finally:
        engine.shutdown()
    counts = {}
    for name in NAMES:
        buckets, total, count = _histogram(text, name)
        values = list(buckets.values())
        assert values == sorted(values) and buckets["+Inf"] == count  # cumulative
        assert total >= 0
        counts[name] = count
    # 3 requests (the warm-up is left out): one first token each, one gap per later token
    assert counts == {"cvllm_time_to_first_token_seconds": 3,
                      "cvllm_inter_token_latency_seconds": 0 + 3 + 5,
                      "cvllm_e2e_request_latency_seconds": 3,
                      "cvllm_request_queue_time_seconds": 3}
