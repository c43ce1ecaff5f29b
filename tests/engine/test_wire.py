"""engine/wire.py: sampling params, outputs (logprobs included) and metrics come back
equal through JSON, and values of the wrong shape are refused with a WireError (or the
dataclass's own validation error), never half-built."""

import json

import pytest

from cvllm.engine import wire
from cvllm.outputs import EngineMetrics, RequestOutput, TokenLogprob
from cvllm.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputs


def _trip(value):
    return json.loads(json.dumps(value))


def test_sampling_params_round_trip():
    p = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=-5, max_tokens=None,
                       stop=["\n\n", "END"], stop_token_ids=[7], n=3, logprobs=2,
                       structured_outputs=StructuredOutputs("json_schema", '{"type":"object"}'))
    assert wire.params_from_wire(_trip(wire.params_to_wire(p))) == p
    plain = SamplingParams()
    assert wire.params_from_wire(_trip(wire.params_to_wire(plain))) == plain


def test_sampling_params_are_validated_again():
    d = wire.params_to_wire(SamplingParams())
    with pytest.raises(wire.WireError, match="unknown sampling fields"):
        wire.params_from_wire(dict(d, evil=1))
    with pytest.raises(SamplingParamsError, match="temperature"):
        wire.params_from_wire(dict(d, temperature=9))
    with pytest.raises(SamplingParamsError, match="unknown constraint kind"):
        wire.params_from_wire(dict(d, structured_outputs={"kind": "sql", "value": "x"}))
    with pytest.raises(wire.WireError):
        wire.params_from_wire([1, 2])


def test_every_sampling_field_has_a_wire_kind():
    import dataclasses

    assert set(wire._PARAM_KINDS) == {f.name for f in dataclasses.fields(SamplingParams)}


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 5.5), ("seed", 1.5), ("logprobs", True), ("n", "2"), ("top_k", None),
    ("temperature", True), ("temperature", "0.5"), ("ignore_eos", 1), ("stop", "END"),
    ("stop", [1]), ("stop_token_ids", ["a"]), ("stop_token_ids", [2 ** 70]),
    ("structured_outputs", {"kind": 5}), ("structured_outputs", "regex"),
])
def test_sampling_fields_of_the_wrong_type_are_refused(field, value):
    d = dict(wire.params_to_wire(SamplingParams()), **{field: value})
    with pytest.raises(wire.WireError, match=field):
        wire.params_from_wire(d)


def test_channel_messages_round_trip_and_check_their_fields():
    from cvllm.engine import api_messages as am

    hello = am.Hello("m", 4096, {"temperature": 0.5}, {"port": 0}, 30.0, "/tmp/tok", "{{x}}",
                     "probe", [1, 2], mcp={"mcp_command": None})
    assert am.Hello.from_wire(_trip(hello.to_wire())) == hello
    with pytest.raises(wire.WireError, match="version"):
        am.Hello.from_wire(dict(hello.to_wire(), version=99))
    with pytest.raises(wire.WireError, match="max_model_len"):
        am.Hello.from_wire(dict(hello.to_wire(), max_model_len="big"))
    with pytest.raises(wire.WireError, match="HELLO"):
        am.Hello.from_wire(dict(hello.to_wire(), extra=1))
    sub = am.Submit("r-1", [5, 6], SamplingParams(max_tokens=3))
    assert am.Submit.from_wire(_trip(sub.to_wire())) == sub
    assert am.Submit.id_of({"id": 7}) is None and am.Submit.id_of(sub.to_wire()) == "r-1"
    call = am.RpcCall(3, "check_structured", {"kind": "regex", "value": "a+"})
    assert am.RpcCall.from_wire(_trip(call.to_wire())) == call
    with pytest.raises(wire.WireError, match="unknown RPC method"):
        am.RpcCall.from_wire({"call": 1, "method": "shutdown"})
    reply = am.RpcReply(3, False, error={"message": "bad", "value_error": True})
    assert am.RpcReply.from_wire(_trip(reply.to_wire())) == reply
    assert am.EngineStatus.from_wire({"ready": 1, "healthy": 0}) == am.EngineStatus(True, False)
    assert am.Signal.from_wire({"name": "SIGTERM"}).name == "SIGTERM"
    with pytest.raises(wire.WireError, match="unknown signal"):
        am.Signal.from_wire({"name": "SIGKILL"})


def test_outputs_round_trip_with_logprobs():
    lp = TokenLogprob(5, "\u00e9", -0.25, top={"\u00e9": -0.25, "e": -1.5}, top_ids={5: -0.25, 9: -1.5})
    outs = [RequestOutput("a", "h\u00e9", [4, 5], 3, 2, finished=True, finish_reason="stop",
                          stop_reason="\n", logprobs=[lp, lp], num_cached_tokens=16),
            RequestOutput("b", "", [], 7, 0),
            RequestOutput("c", "x", [1], 1, 1, finished=True, finish_reason="stop", stop_reason=2)]
    assert [wire.output_from_wire(x) for x in _trip([wire.output_to_wire(o) for o in outs])] == outs


@pytest.mark.parametrize("bad", [
    ["a", "t", [1], 1, 1, False, None, None, 0],                 # a field short
    ["", "t", [1], 1, 1, False, None, None, 0, None],            # empty id
    ["a", "t", [-1], 1, 1, False, None, None, 0, None],          # not a token id
    ["a", "t", [True], 1, 1, False, None, None, 0, None],        # a bool is no token id
    ["a", 5, [1], 1, 1, False, None, None, 0, None],             # text not a string
    ["a", "t", [1], 1, 1, "yes", None, None, 0, None],           # finished not a bool
    ["a", "t", [1], 1, 1, True, "stop", [2], 0, None],           # stop reason a list
    ["a", "t", [1], 1, 1, True, "stop", None, 0, [[1, "x", -1.0, [], []], [2]]],  # logprob
])
def test_malformed_outputs_are_refused(bad):
    with pytest.raises(wire.WireError):
        wire.output_from_wire(bad)


def test_metrics_round_trip():
    m = EngineMetrics(num_running=3, kv_blocks_total=100, prefix_cache_hits_total=64,
                      requests_finished={"stop": 2, "length": 1})
    m.latency.time_to_first_token.observe(0.03)
    m.latency.inter_token_latency.observe(0.011)
    back = wire.metrics_from_wire(_trip(wire.metrics_to_wire(m)))
    assert back == m
    d = wire.metrics_to_wire(m)
    d["latency"]["time_to_first_token"]["counts"] = [1]
    with pytest.raises(wire.WireError, match="counts"):
        wire.metrics_from_wire(d)
