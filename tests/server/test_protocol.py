"""Unit tests of request parsing, sampling-param resolution and response shapes."""

import pytest

from cvllm.outputs import TokenLogprob
from cvllm.server.chat import ChatShapes, parse_chat_request
from cvllm.server.completions import CompletionShapes, parse_completion_request
from cvllm.server.errors import ApiError
from cvllm.server.params import fan_out, resolve_sampling_params
from cvllm.server.request_body import parse_json_body
from cvllm.server.responses import ChoiceResult


def chat(**kw):
    body = {"messages": [{"role": "user", "content": "hi"}], **kw}
    return parse_chat_request(body)


def error_of(fn, *args) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(*args)
    return info.value


@pytest.mark.parametrize("raw", [b"", b"{", b"[1, 2]", b'"x"', b'{"a": NaN}', b"\xff\xfe{"])
def test_parse_json_body_rejects(raw):
    err = error_of(parse_json_body, raw)
    assert err.status == 400 and err.type == "invalid_request_error"


@pytest.mark.parametrize("body,param", [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2.5}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "top_k": True}, "top_k"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": [1]}, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"messages": [{"role": "user", "content": "x"}], "model": 3}, "model"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": 1}},
     "stream_options.include_usage"),
])
def test_chat_bad_fields_name_param(body, param):
    err = error_of(parse_chat_request, body)
    assert (err.status, err.param) == (400, param)


def test_chat_parses_everything():
    req = chat(model="m", stream=True, stream_options={"include_usage": True}, max_tokens=5,
               max_completion_tokens=7, temperature=0, top_p=0.5, top_k=3, min_p=0.1,
               presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1, seed=4,
               stop="x", stop_token_ids=[2], ignore_eos=True, n=2, logprobs=True,
               top_logprobs=3, user="u", unknown_field={"ignored": 1})
    assert req.max_tokens == 7 and req.stream and req.include_usage and req.n == 2
    assert req.num_logprobs == 3
    over = req.sampling.overrides()
    assert over["temperature"] == 0.0 and over["stop"] == ["x"] and over["seed"] == 4
    assert over["ignore_eos"] is True and "user" not in over


def test_chat_content_parts_and_nulls():
    req = parse_chat_request({"messages": [
        {"role": "system", "content": [{"type": "text", "text": "a"},
                                       {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": []},
        {"role": "user", "content": "c", "name": "bob"}], "temperature": None})
    assert [m["content"] for m in req.messages] == ["a\nb", "", "c"]
    assert req.messages[2]["name"] == "bob" and req.sampling.temperature is None


@pytest.mark.parametrize("prompt,expected", [("hi", "hi"), (["hi"], "hi"), ([1, 2], [1, 2]),
                                             ([[3, 4]], [3, 4])])
def test_completion_prompt_forms(prompt, expected):
    assert parse_completion_request({"prompt": prompt}).prompt == expected


@pytest.mark.parametrize("body,param", [
    ({}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"), ({"prompt": 5}, "prompt"),
    ({"prompt": "x", "echo": True}, "echo"), ({"prompt": "x", "logprobs": -1}, "logprobs"),
])
def test_completion_bad_fields(body, param):
    err = error_of(parse_completion_request, body)
    assert (err.status, err.param) == (400, param)


def test_resolve_precedence_and_capping():
    defaults = {"temperature": 0.3, "top_k": 5, "max_gen_tokens": 50, "max_tokens": 999,
                "n": 4, "not_a_param": 1}
    p = resolve_sampling_params(chat(temperature=0.9), defaults, 10, 100, "messages")
    assert (p.temperature, p.top_k, p.max_tokens, p.n) == (0.9, 5, 50, 1)
    p = resolve_sampling_params(chat(max_tokens=500), defaults, 10, 100, "messages")
    assert p.max_tokens == 90  # capped to the room left in the context
    p = resolve_sampling_params(chat(), {}, 10, 100, "messages")
    assert p.max_tokens == 90  # no server default: up to the context


def test_resolve_errors():
    err = error_of(resolve_sampling_params, chat(), {}, 100, 100, "messages")
    assert err.status == 400 and "100" in err.message and err.code == "context_length_exceeded"
    err = error_of(resolve_sampling_params, chat(temperature=7), {}, 1, 100, "messages")
    assert err.param == "temperature"
    err = error_of(resolve_sampling_params, chat(n=99), {}, 1, 100, "messages")
    assert err.param == "n"


def test_fan_out_offsets_seeds():
    p = resolve_sampling_params(chat(n=3, seed=7), {}, 1, 100, "messages")
    assert [q.seed for q in fan_out(p, 3)] == [7, 8, 9]
    assert all(q.n == 1 for q in fan_out(p, 3))
    p = resolve_sampling_params(chat(n=2), {}, 1, 100, "messages")
    assert [q.seed for q in fan_out(p, 2)] == [None, None]


def test_response_shapes():
    lp = [TokenLogprob(104, "h", float("-inf"), {"h": -0.1})]
    shapes = ChatShapes("chatcmpl-1", "m", num_logprobs=1)
    body = shapes.response([ChoiceResult(0, "h", "stop", 1, lp)], 4)
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    entry = body["choices"][0]["logprobs"]["content"][0]
    assert entry["logprob"] == -9999.0 and entry["top_logprobs"][0]["token"] == "h"
    cshapes = CompletionShapes("cmpl-1", "m", include_usage=True, num_logprobs=1)
    chunk = cshapes.stream_delta(0, "h", lp, text_offset=3)
    assert chunk["usage"] is None and chunk["choices"][0]["logprobs"]["text_offset"] == [3]
    assert cshapes.usage_chunk(2, 3)["choices"] == []
