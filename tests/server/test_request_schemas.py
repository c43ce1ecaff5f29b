"""The pydantic request schemas (cvllm/server/schemas/): the agent-API fields of issue 15
(tools, tool_choice, tool-call messages, response_format, structured_outputs, guided_*,
thinking) and that any bad body is a 400 naming a field, never another exception."""

import copy
import json

import pytest

from cvllm.sampling_params import StructuredOutputs
from cvllm.server.chat import parse_chat_request
from cvllm.server.completions import parse_completion_request
from cvllm.server.errors import ApiError

USER = [{"role": "user", "content": "hi"}]
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}},
                  "required": ["city"]}


def tool(name="get_weather", **function):
    return {"type": "function", "function": {"name": name, **function}}


def chat(**kw):
    return {"messages": USER, **kw}


def error_of(fn, body) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(body)
    return info.value


# --------------------------------------------------------------------------- tools


def test_tools_are_plain_dicts_and_tool_choice_defaults_to_auto():
    req = parse_chat_request(chat(tools=[tool(description="d", parameters=WEATHER_PARAMS),
                                         tool("search")]))
    assert req.tools == [
        {"type": "function", "function": {"name": "get_weather", "description": "d",
                                          "parameters": WEATHER_PARAMS}},
        {"type": "function", "function": {"name": "search"}}]
    assert all(type(t) is dict and type(t["function"]) is dict for t in req.tools)
    assert req.tool_choice == "auto" and req.parallel_tool_calls is True
    assert req.named_tool is None


def test_no_tools_means_choice_none():
    req = parse_chat_request(chat())
    assert req.tools is None and req.tool_choice == "none"
    assert parse_chat_request(chat(tools=[])).tool_choice == "none"


def test_named_and_required_tool_choice():
    named = {"type": "function", "function": {"name": "b"}}
    req = parse_chat_request(chat(tools=[tool("a"), tool("b")], tool_choice=named,
                                  parallel_tool_calls=False))
    assert req.tool_choice == named and req.named_tool == "b"
    assert req.parallel_tool_calls is False
    req = parse_chat_request(chat(tools=[tool("a")], tool_choice="required"))
    assert req.tool_choice == "required"


# ------------------------------------------------------------------------ messages


def test_tool_call_arguments_reach_the_template_as_a_mapping():
    calls = [{"id": "c1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
             {"id": "c2", "function": {"name": "f", "arguments": "not json"}},
             {"id": "c3", "function": {"name": "f", "arguments": "[1, 2]"}}]
    req = parse_chat_request({"messages": [
        *USER, {"role": "assistant", "content": None, "tool_calls": calls,
                "reasoning_content": "think"},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C", "name": "get_weather"}]})
    assistant, answer = req.messages[1], req.messages[2]
    assert assistant["content"] == "" and assistant["reasoning_content"] == "think"
    args = [c["function"]["arguments"] for c in assistant["tool_calls"]]
    assert args == [{"city": "Paris"}, "not json", "[1, 2]"]
    assert assistant["tool_calls"][1]["type"] == "function"
    assert answer == {"role": "tool", "content": "18 C", "tool_call_id": "c1",
                      "name": "get_weather"}
    kept = req.input_messages[1].tool_calls[0].function
    assert kept.arguments == '{"city": "Paris"}'  # the client's text, as given
    assert kept.arguments_object() == {"city": "Paris"}


def test_text_parts_join_and_nul_bytes_are_text():
    req = parse_chat_request({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a\x00"},
                                     {"type": "text", "text": "b"}]}],
        "stop": "\x00"})
    assert req.messages[0]["content"] == "a\x00\nb"
    assert req.sampling.stop == ["\x00"]


# ----------------------------------------------------------------- structured output


def canonical(schema) -> str:
    # compact, keys in the client's order (the grammar follows the declared order)
    return json.dumps(schema, separators=(",", ":"))


@pytest.mark.parametrize("fields,expected", [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutputs("json_object")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w",
                                                                 "schema": WEATHER_PARAMS}}},
     StructuredOutputs("json_schema", canonical(WEATHER_PARAMS))),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}},
     StructuredOutputs("json_schema", '{"type":"object"}')),
    ({"structured_outputs": {"json": WEATHER_PARAMS}},
     StructuredOutputs("json_schema", canonical(WEATHER_PARAMS))),
    ({"structured_outputs": {"json": json.dumps(WEATHER_PARAMS)}},
     StructuredOutputs("json_schema", canonical(WEATHER_PARAMS))),
    ({"structured_outputs": {"regex": r"\d+"}}, StructuredOutputs("regex", r"\d+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}},
     StructuredOutputs("choice", '["yes", "no"]')),
    ({"structured_outputs": {"grammar": "root ::= 'a'"}},
     StructuredOutputs("grammar", "root ::= 'a'")),
    ({"structured_outputs": {"json_object": True}}, StructuredOutputs("json_object")),
    ({"guided_json": WEATHER_PARAMS}, StructuredOutputs("json_schema", canonical(WEATHER_PARAMS))),
    ({"guided_regex": "a|b"}, StructuredOutputs("regex", "a|b")),
    ({"guided_choice": ["é", "b"]}, StructuredOutputs("choice", '["é", "b"]')),
    ({"guided_grammar": "root ::= 'x'"}, StructuredOutputs("grammar", "root ::= 'x'")),
])
def test_constraints_normalize_to_structured_outputs(fields, expected):
    assert parse_chat_request(chat(**fields)).structured_outputs == expected
    assert parse_completion_request({"prompt": "p", **fields}).structured_outputs == expected


def test_schema_text_keeps_the_key_order_and_the_format_name_is_kept():
    """The properties' order is the order the grammar writes them in: never sorted."""
    a = {"type": "object", "properties": {"z": {"type": "integer"}, "a": {"type": "string"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "point", "schema": a, "strict": True}}
    req = parse_chat_request(chat(response_format=fmt))
    assert req.response_format_name == "point"
    assert list(json.loads(req.structured_outputs.value)["properties"]) == ["z", "a"]
    assert req.structured_outputs == parse_chat_request(chat(guided_json=a)).structured_outputs
    assert parse_chat_request(chat(guided_json=a)).response_format_name is None


# --------------------------------------------------------------- thinking, ignored


@pytest.mark.parametrize("fields,expected", [
    ({}, None), ({"thinking": True}, True),
    ({"chat_template_kwargs": {"enable_thinking": False}}, False),
    ({"thinking": True, "chat_template_kwargs": {"enable_thinking": False}}, False),
    ({"thinking": False, "chat_template_kwargs": {"enable_thinking": None}}, False),
])
def test_enable_thinking_the_explicit_template_kwarg_wins(fields, expected):
    req = parse_chat_request(chat(**fields))
    assert req.enable_thinking is expected
    assert req.chat_template_kwargs.get("enable_thinking") is expected


def test_template_kwargs_keep_other_keys_and_drop_reserved_ones():
    req = parse_chat_request(chat(chat_template_kwargs={"custom": [1], "messages": "x",
                                                        "bos_token": "b"}))
    assert req.chat_template_kwargs == {"custom": [1]}


def test_accepted_and_ignored_fields():
    req = parse_chat_request(chat(reasoning_effort="low", user="u", metadata={"k": "v"},
                                  store=False, service_tier="auto", unknown={"x": 1}))
    assert req.sampling.overrides() == {} and req.structured_outputs is None


def test_the_first_error_is_found_in_the_api_reference_order_of_the_fields():
    from cvllm.server.schemas.request_fields import CommonFields

    assert list(CommonFields.model_fields) == [
        "model", "stream", "stream_options", "n", "temperature", "top_p", "top_k", "min_p",
        "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "min_tokens",
        "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens", "user"]
    assert error_of(parse_chat_request, chat(n=0, temperature="x")).param == "n"


# ---------------------------------------------------------------------- bad bodies

NAMED_X = {"type": "function", "function": {"name": "x"}}
ASSISTANT_CALL = {"role": "assistant", "content": None,
                  "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]}


def with_call(**call):
    msg = copy.deepcopy(ASSISTANT_CALL)
    msg["tool_calls"][0].update(call)
    return {"messages": [*USER, msg]}


BAD_CHAT = [
    # tools
    (chat(tools={}), "tools"),
    (chat(tools=["f"]), "tools[0]"),
    (chat(tools=[{"type": "retrieval", "function": {"name": "f"}}]), "tools[0].type"),
    (chat(tools=[{"type": "function"}]), "tools[0].function"),
    (chat(tools=[tool(None)]), "tools[0].function.name"),
    (chat(tools=[tool("has space")]), "tools[0].function.name"),
    (chat(tools=[tool("x" * 65)]), "tools[0].function.name"),
    (chat(tools=[tool("")]), "tools[0].function.name"),
    (chat(tools=[tool("a"), tool("n\x00")]), "tools[1].function.name"),
    (chat(tools=[tool(description=3)]), "tools[0].function.description"),
    (chat(tools=[tool(parameters="{}")]), "tools[0].function.parameters"),
    (chat(tools=[tool(parameters={"type": "objekt"})]), "tools[0].function.parameters"),
    (chat(tools=[tool(parameters={"properties": {"a": {"minimum": "1"}}})]),
     "tools[0].function.parameters"),
    (chat(tools=[tool(parameters={"type": "string", "pattern": "("})]),
     "tools[0].function.parameters"),
    (chat(tools=[tool(strict="yes")]), "tools[0].function.strict"),
    (chat(tools=[tool("a"), tool("b"), tool("a")]), "tools[2].function.name"),
    # tool_choice
    (chat(tool_choice="always"), "tool_choice"),
    (chat(tool_choice=1), "tool_choice"),
    (chat(tool_choice="required"), "tool_choice"),
    (chat(tool_choice=NAMED_X), "tool_choice.function.name"),
    (chat(tools=[tool("y")], tool_choice=NAMED_X), "tool_choice.function.name"),
    (chat(tools=[tool("x")], tool_choice={"type": "function"}), "tool_choice.function"),
    (chat(tools=[tool("x")], tool_choice={"type": "f", "function": {"name": "x"}}),
     "tool_choice.type"),
    (chat(tools=[tool("x")], tool_choice={"function": {"name": 5}}),
     "tool_choice.function.name"),
    (chat(parallel_tool_calls="true"), "parallel_tool_calls"),
    (chat(parallel_tool_calls=1), "parallel_tool_calls"),
    # messages
    (with_call(id=3), "messages[1].tool_calls[0].id"),
    (with_call(id=None), "messages[1].tool_calls[0].id"),
    (with_call(type="code"), "messages[1].tool_calls[0].type"),
    (with_call(function={"name": "f", "arguments": {"a": 1}}),
     "messages[1].tool_calls[0].function.arguments"),
    (with_call(function={"name": "f"}), "messages[1].tool_calls[0].function.arguments"),
    (with_call(function={"arguments": "{}"}), "messages[1].tool_calls[0].function.name"),
    (with_call(function="f"), "messages[1].tool_calls[0].function"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": {}}]},
     "messages[0].tool_calls"),
    ({"messages": [*USER, {"role": "tool", "content": "r"}]}, "messages[1].tool_call_id"),
    ({"messages": [*USER, {"role": "tool", "content": "r", "tool_call_id": 7}]},
     "messages[1].tool_call_id"),
    ({"messages": [*USER, {"role": "tool", "tool_call_id": "c"}]}, "messages[1].content"),
    ({"messages": [{"role": "user", "content": "x", "name": 5}]}, "messages[0].name"),
    ({"messages": [{"role": "assistant", "content": "x", "reasoning_content": []}]},
     "messages[0].reasoning_content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, "b"]}]},
     "messages[0].content[1]"),
    ({"messages": [{"role": "user", "content": {"type": "text", "text": "a"}}]},
     "messages[0].content"),
    ({"messages": [{"role": None, "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": ["user"], "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x"}, None]}, "messages[1]"),
    # response_format
    (chat(response_format="json"), "response_format"),
    (chat(response_format={"type": "xml"}), "response_format"),
    (chat(response_format={"type": ["text"]}), "response_format"),
    (chat(response_format={"type": "json_schema"}), "response_format.json_schema"),
    (chat(response_format={"type": "json_schema", "json_schema": {}}),
     "response_format.json_schema.name"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "a.b"}}),
     "response_format.json_schema.name"),
    (chat(response_format={"type": "json_schema",
                           "json_schema": {"name": "a", "schema": {"type": 1}}}),
     "response_format.json_schema.schema"),
    (chat(response_format={"type": "json_schema",
                           "json_schema": {"name": "a", "schema": []}}),
     "response_format.json_schema.schema"),
    (chat(response_format={"type": "json_schema",
                           "json_schema": {"name": "a", "description": 1}}),
     "response_format.json_schema.description"),
    # structured_outputs and guided_*
    (chat(structured_outputs={}), "structured_outputs"),
    (chat(structured_outputs=[]), "structured_outputs"),
    (chat(structured_outputs={"regex": "a", "choice": ["a"]}), "structured_outputs"),
    (chat(structured_outputs={"json_object": False}), "structured_outputs"),
    (chat(structured_outputs={"regex": "(?P<"}), "structured_outputs.regex"),
    (chat(structured_outputs={"regex": "a{99999999999}"}), "structured_outputs.regex"),
    (chat(structured_outputs={"json": 3}), "structured_outputs.json"),
    (chat(structured_outputs={"json": "[1]"}), "structured_outputs.json"),
    (chat(structured_outputs={"json": {"type": "nope"}}), "structured_outputs.json"),
    (chat(structured_outputs={"choice": "a"}), "structured_outputs.choice"),
    (chat(structured_outputs={"grammar": ""}), "structured_outputs.grammar"),
    (chat(guided_json="{oops"), "guided_json"),
    (chat(guided_json={"enum": 3}), "guided_json"),
    (chat(guided_regex=["a"]), "guided_regex"),
    (chat(guided_regex="[a-"), "guided_regex"),
    (chat(guided_choice=[]), "guided_choice"),
    (chat(guided_choice=["a", ""]), "guided_choice[1]"),
    (chat(guided_choice=["a", 1]), "guided_choice[1]"),
    (chat(guided_grammar=5), "guided_grammar"),
    (chat(response_format={"type": "json_object"}, guided_regex="a"), "guided_regex"),
    (chat(structured_outputs={"regex": "a"}, guided_choice=["a"]), "guided_choice"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "a"}},
          structured_outputs={"json_object": True}), "structured_outputs"),
    # thinking and accepted-but-ignored fields
    (chat(thinking="on"), "thinking"),
    (chat(chat_template_kwargs={"enable_thinking": "no"}),
     "chat_template_kwargs.enable_thinking"),
    (chat(chat_template_kwargs=[]), "chat_template_kwargs"),
    (chat(reasoning_effort=1), "reasoning_effort"),
    (chat(user=["u"]), "user"),
    (chat(metadata=[]), "metadata"),
    (chat(metadata={"a": "b", "c": 1}), "metadata.c"),
    (chat(store="no"), "store"),
    (chat(service_tier=0), "service_tier"),
    # strictness of the older fields, and huge or deep junk
    (chat(temperature=True), "temperature"),
    (chat(temperature=float("inf")), "temperature"),
    (chat(n=1.0), "n"),
    (chat(seed="1"), "seed"),
    (chat(logprobs=1), "logprobs"),
    (chat(top_logprobs=True, logprobs=True), "top_logprobs"),
    (chat(max_completion_tokens=0), "max_completion_tokens"),
    (chat(stop=["a"] * 1000 + [None]), "stop"),
    (chat(stop_token_ids=list(range(100_000)) + ["x"]), "stop_token_ids"),
    ({"messages": USER * 50_000 + [{}]}, "messages[50000].role"),
    (chat(tools=[tool(f"t{i}") for i in range(2000)] + [tool("t7")]), "tools[2000].function.name"),
    (chat(tools=[[[[[[[[[[[]]]]]]]]]]]), "tools[0]"),
    (chat(guided_json=json.loads('{"items":' * 600 + "{}" + "}" * 600)), "guided_json"),
]


@pytest.mark.parametrize("body,param", BAD_CHAT)
def test_bad_chat_bodies_are_400_naming_the_field(body, param):
    err = error_of(parse_chat_request, body)
    assert (err.status, err.type, err.param) == (400, "invalid_request_error", param)
    assert err.message.startswith("'") and "pydantic" not in err.message
    assert len(err.message) < 400 and err.message.encode("utf-8")


BAD_COMPLETION = [
    ({"prompt": "p", "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"prompt": "p", "guided_regex": "("}, "guided_regex"),
    ({"prompt": "p", "guided_json": {}, "guided_grammar": "g"}, "guided_grammar"),
    ({"prompt": "p", "structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"prompt": "p", "echo": "yes"}, "echo"),
    ({"prompt": "p", "stop": ["a", 2]}, "stop"),
    ({"prompt": [[1, -2]]}, "prompt"),
    ({"prompt": None}, "prompt"),
]


@pytest.mark.parametrize("body,param", BAD_COMPLETION)
def test_bad_completion_bodies_are_400_naming_the_field(body, param):
    err = error_of(parse_completion_request, body)
    assert (err.status, err.param) == (400, param)


def test_element_errors_of_whole_fields_still_say_which_element():
    err = error_of(parse_chat_request, chat(stop=["a", 1]))
    assert err.param == "stop" and err.message.startswith("'stop[1]' must be a string")


def test_values_in_messages_are_short_and_escaped():
    err = error_of(parse_chat_request, chat(tools=[tool("a")],
                                            tool_choice={"function": {"name": "\ud800" * 1000}}))
    assert err.param == "tool_choice.function.name" and len(err.message) < 200
    assert "\\ud800" in err.message
    err = error_of(parse_chat_request, chat(temperature="x" * 10_000))
    assert len(err.message) < 200


# ------------------------------------------------------------- junk at every path

RICH = {
    "model": "m", "stream": True, "stream_options": {"include_usage": True}, "n": 1,
    "temperature": 0.5, "stop": ["s"], "stop_token_ids": [1], "max_tokens": 5,
    "logprobs": True, "top_logprobs": 2, "thinking": True,
    "chat_template_kwargs": {"enable_thinking": False},
    "messages": [{"role": "system", "content": [{"type": "text", "text": "s"}]},
                 {"role": "user", "content": "u", "name": "n"},
                 {"role": "assistant", "content": None, "reasoning_content": "r",
                  "tool_calls": [{"id": "c", "type": "function",
                                  "function": {"name": "f", "arguments": "{}"}}]},
                 {"role": "tool", "content": "t", "tool_call_id": "c"}],
    "tools": [{"type": "function", "function": {"name": "f", "description": "d",
                                                "parameters": WEATHER_PARAMS, "strict": True}}],
    "tool_choice": {"type": "function", "function": {"name": "f"}},
    "parallel_tool_calls": False,
    "response_format": {"type": "json_schema",
                        "json_schema": {"name": "n", "schema": WEATHER_PARAMS}},
    "metadata": {"k": "v"}, "user": "u",
}
JUNK = [None, True, 0, -1, 1.5, float("nan"), "", "a\ud800b", "\x00", [], {}, [None] * 3000,
        {"type": "function"}, json.loads("[" * 500 + "]" * 500), "x" * 100_000, 2 ** 70]


def paths(value, prefix=()):
    yield prefix
    items = value.items() if isinstance(value, dict) else (
        enumerate(value) if isinstance(value, list) else ())
    for key, item in items:
        yield from paths(item, prefix + (key,))


def replaced(body, path, junk):
    body = copy.deepcopy(body)
    target = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = junk
    return body


def test_rich_body_is_valid():
    req = parse_chat_request(copy.deepcopy(RICH))
    assert req.named_tool == "f" and req.structured_outputs.kind == "json_schema"


def test_junk_at_every_path_is_accepted_or_a_400_naming_a_field():
    top_level = set(RICH) | {None}
    outcomes = {"ok": 0, "400": 0}
    for path in list(paths(RICH))[1:]:
        for junk in JUNK:
            try:
                parse_chat_request(replaced(RICH, path, junk))
                outcomes["ok"] += 1
            except ApiError as err:
                assert err.status == 400, (path, junk)
                head = err.param.split(".")[0].split("[")[0] if err.param else None
                assert head in top_level, (path, junk, err.param)
                err.message.encode("utf-8")  # the response can be written
                outcomes["400"] += 1
    assert outcomes["ok"] > 20 and outcomes["400"] > 500


def test_the_clients_skip_special_tokens_survives_the_server_params():
    from cvllm.server.params import resolve_sampling_params

    req = parse_chat_request(chat(skip_special_tokens=False))
    assert resolve_sampling_params(req, {}, 5, 100, "messages").skip_special_tokens is False
    req = parse_chat_request(chat())
    assert resolve_sampling_params(req, {}, 5, 100, "messages").skip_special_tokens is True
    # a tool parser that reads special tokens turns them on whatever the client said
    assert resolve_sampling_params(req, {}, 5, 100, "messages", None,
                                   skip_special_tokens=False).skip_special_tokens is False
