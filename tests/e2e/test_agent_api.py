"""The agent API end to end: one real ``cvllm serve`` process (default model, CPU) with
``--enforce-parser hermes --reasoning-parser qwen3`` and the test MCP server, driven by
the official ``openai`` SDK (sync and async, streamed and not).

The default model's output is forced with ``guided_regex`` (the escaped scripted text):
its tokenizer spells every marker, special or not, with ordinary tokens, so the parser
sees exactly the scripted text. The other parsers are reached through the documented
per-request ``tool_call_parser`` extension, so one server start serves every format.
"""

import asyncio
import concurrent.futures
import json
import os
import re
import sys
import time

import jsonschema
import openai
import pytest
import requests

pytestmark = pytest.mark.slow
TOOLS_SERVER = os.path.join(os.path.dirname(__file__), "..", "chat", "mcp_servers",
                            "tools_server.py")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ARGS = {"city": "Paris"}
CALLS = {  # parser -> (scripted output, expected content)
    "hermes": ('Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
               '\n</tool_call>', "Checking."),
    "qwen3_coder": ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                    "</parameter>\n</function>\n</tool_call>", "Checking."),
    "mistral": ('Checking. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "Checking."),
    "llama3_json": ('Checking. <|python_tag|>{"name": "get_weather", "parameters": '
                    '{"city": "Paris"}}', "Checking."),
    "deepseek_v3": ("Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
                    '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "Checking."),
    "glm45": ("Checking.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris"
              "</arg_value>\n</tool_call>", "Checking."),
    "json": ('{"name": "get_weather", "arguments": {"city": "Paris"}}', None),
}
FINAL = "It is sunny in Paris."
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(default_gguf, tmp_path_factory):
    from tests.distributed.tp_helpers import Server

    log = tmp_path_factory.mktemp("agent") / "serve.log"
    srv = Server([sys.executable, "-m", "cvllm"],
                 ["--cpu", "--max-model-len", "1024", "--enforce-parser", "hermes",
                  "--reasoning-parser", "qwen3", "--mcp-command", sys.executable,
                  "--mcp-args", os.path.abspath(TOOLS_SERVER), "--mcp-max-rounds", "1",
                  "--log-level", "DEBUG"], log, env=dict(os.environ, CVLLM_NO_PROGRESS="1"))
    try:
        srv.wait_healthy(120)
        model = requests.get(srv.base + "/v1/models").json()["data"][0]["id"]
        yield srv.base, model, log
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def aclient(server):
    """A factory: an async client is bound to the event loop it first runs on. Its
    timeout covers the 350 samples sent at once (``sampled``): 60 s on a 2-core VM
    with AMX, 140 s on one without."""
    return lambda: openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key="x",
                                      max_retries=0, timeout=600)


def _forced(parser, text, **kw):
    return dict(messages=kw.pop("messages", USER), tools=[WEATHER], temperature=0,
                max_tokens=200, extra_body={"guided_regex": re.escape(text),
                                           "tool_call_parser": parser}, **kw)


def _assemble(chunks):
    """A stream's chunks -> (content, reasoning, [(id, name, arguments)], finish_reason)."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for d in delta.tool_calls or ():
            call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            if d.id:
                assert call["id"] is None and d.function.name, "id and name come first, once"
                call["id"] = d.id
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return (content or None, reasoning or None,
            [(c["id"], c["name"], c["arguments"]) for _, c in sorted(calls.items())], finish)


def _summary(message, finish):
    calls = [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or ()]
    return (message.content, getattr(message, "reasoning_content", None), calls, finish)


def _round_trip(client, model, parser):
    """Non-streamed call, streamed call, then the tool result back and a final answer."""
    text, content = CALLS[parser]
    full = client.chat.completions.create(model=model, **_forced(parser, text))
    choice = full.choices[0]
    streamed = _assemble(client.chat.completions.create(model=model, stream=True,
                                                        **_forced(parser, text)))
    call = choice.message.tool_calls[0] if choice.message.tool_calls else None
    answer = None
    if call is not None:
        messages = USER + [choice.message.model_dump(exclude_none=True),
                           {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
        answer = client.chat.completions.create(model=model, **_forced(parser, FINAL,
                                                                       messages=messages))
    return full, streamed, answer


@pytest.fixture(scope="module")
def round_trips(client, server):
    # Concurrent: the engine batches the parsers' requests.
    with concurrent.futures.ThreadPoolExecutor(len(CALLS)) as pool:
        futures = {p: pool.submit(_round_trip, client, server[1], p) for p in CALLS}
        return {p: f.result() for p, f in futures.items()}


@pytest.mark.parametrize("parser", sorted(CALLS))
def test_round_trip_sync(round_trips, parser):
    full, streamed, answer = round_trips[parser]
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == CALLS[parser][1]
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == ARGS
    # The stream's deltas reassemble to the non-streamed answer (ids are per response).
    mine = _summary(choice.message, choice.finish_reason)
    assert streamed[:2] == mine[:2] and streamed[3] == mine[3]
    assert [c[1:] for c in streamed[2]] == [c[1:] for c in mine[2]]
    final = answer.choices[0]
    assert final.message.content == FINAL and final.finish_reason == "stop"
    assert not final.message.tool_calls


def test_round_trip_async(aclient, server):
    async def one(parser, aclient):
        text, _ = CALLS[parser]
        full = await aclient.chat.completions.create(model=server[1], **_forced(parser, text))
        stream = await aclient.chat.completions.create(model=server[1], stream=True,
                                                       **_forced(parser, text))
        return full, _assemble([c async for c in stream])

    async def main():
        client = aclient()
        return await asyncio.gather(*(one(p, client) for p in CALLS))

    for parser, (full, streamed) in zip(CALLS, asyncio.run(main())):
        choice = full.choices[0]
        assert choice.finish_reason == "tool_calls" == streamed[3], parser
        mine = _summary(choice.message, choice.finish_reason)
        assert [c[1:] for c in streamed[2]] == [c[1:] for c in mine[2]], parser
        assert mine[2][0][1] == "get_weather" and json.loads(mine[2][0][2]) == ARGS, parser
        assert streamed[0] == mine[0] == CALLS[parser][1], parser


# -------------------------------------------------------------------- reasoning
def test_reasoning_streamed_then_content(client, server):
    forced = {"guided_regex": re.escape("<think>The user wants a city.</think>Paris.")}
    full = client.chat.completions.create(model=server[1], messages=USER, temperature=0,
                                          max_tokens=40, extra_body=forced)
    message = full.choices[0].message
    assert message.reasoning_content == "The user wants a city."
    assert message.content == "Paris."
    details = full.usage.completion_tokens_details
    assert 0 < details.reasoning_tokens < full.usage.completion_tokens
    chunks = list(client.chat.completions.create(
        model=server[1], messages=USER, temperature=0, max_tokens=40, extra_body=forced,
        stream=True, stream_options={"include_usage": True}))
    kinds = []
    for c in chunks:
        if c.choices and getattr(c.choices[0].delta, "reasoning_content", None):
            kinds.append("r")
        if c.choices and c.choices[0].delta.content:
            kinds.append("c")
    assert kinds and kinds == sorted(kinds, reverse=True) and "c" in kinds  # r... then c...
    assert _assemble(chunks)[:2] == ("Paris.", "The user wants a city.")
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == \
        details.reasoning_tokens


def test_thinking_off_gives_no_reasoning(client, server):
    forced = {"guided_regex": re.escape("<think>x</think>Paris."),
              "chat_template_kwargs": {"enable_thinking": False}}
    full = client.chat.completions.create(model=server[1], messages=USER, temperature=0,
                                          max_tokens=40, extra_body=forced)
    message = full.choices[0].message
    assert getattr(message, "reasoning_content", None) is None
    assert message.content == "<think>x</think>Paris."
    assert full.usage.completion_tokens_details.reasoning_tokens == 0
    off = client.chat.completions.create(model=server[1], messages=USER, temperature=0,
                                         max_tokens=40,
                                         extra_body={"guided_regex": forced["guided_regex"],
                                                     "thinking": False})
    assert getattr(off.choices[0].message, "reasoning_content", None) is None


# -------------------------------------------------------------------- MCP through the flags
def test_mcp_tool_runs_and_its_result_reaches_the_next_round(client, server):
    _, model, log = server
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 20, "b": 22}}\n</tool_call>'
    out = client.chat.completions.create(model=model, messages=USER, temperature=0,
                                         max_tokens=60,
                                         extra_body={"guided_regex": re.escape(call)})
    choice = out.choices[0]
    # The MCP call is the server's business: the client never sees it as its own.
    assert not choice.message.tool_calls and choice.finish_reason == "stop"
    text = log.read_text()
    assert re.search(r"MCP add \{\"a\": 20, \"b\": 22\} -> '42'", text)
    # Round 2 was rendered with the tool's result in a tool message, and its usage counted.
    assert re.search(r"round 1 prompt: .*tool\\n42<\|im_end\|>", text)
    first = client.chat.completions.create(model=model, messages=USER, temperature=0,
                                           max_tokens=1).usage.prompt_tokens
    assert out.usage.prompt_tokens > 2 * first


# -------------------------------------------------------------------- forced tool_choice
SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 12},
            "address": {"type": "object", "properties": {"zip": {"type": "string",
                                                                 "pattern": "^[0-9]{5}$"}},
                        "required": ["zip"], "additionalProperties": False}},
            "required": ["name", "address"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "arrays": {"type": "object", "properties": {"tags": {
        "type": "array", "items": {"type": "string", "maxLength": 8},
        "minItems": 1, "maxItems": 3}}, "required": ["tags"], "additionalProperties": False},
    "enums": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "string", "enum": ["S", "M", "L"]}},
        "required": ["color", "size"], "additionalProperties": False},
    "bounded": {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": -1, "maximum": 1, "multipleOf": 0.25}},
        "required": ["age", "score"], "additionalProperties": False},
    "required": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "ok": {"type": "boolean"}, "note": {"type": "string", "maxLength": 10}},
        "required": ["id", "ok"], "additionalProperties": False},
}
BOOK = {"type": "function", "function": {"name": "book", "parameters": SCHEMAS["bounded"]}}
TAGS = {"type": "function", "function": {"name": "tag", "parameters": SCHEMAS["arrays"]}}
SAMPLES = 50
SPLIT = (13, 13, 12, 12)  # n per request: 50 choices, batched by the engine


@pytest.fixture(scope="module")
def sampled(aclient, server):
    """Every 50-sample set at temperature 1, all requests at once."""
    model = server[1]
    sets = {f"schema:{k}": dict(response_format={"type": "json_schema", "json_schema": {
        "name": k, "schema": s, "strict": True}}) for k, s in SCHEMAS.items()}
    # One call per answer: with parallel calls the array has no end at temperature 1 and
    # runs into max_tokens (a cut answer is no call at all).
    sets["required"] = dict(tools=[TAGS, BOOK], tool_choice="required",
                            parallel_tool_calls=False)
    sets["named"] = dict(tools=[TAGS, BOOK],
                         tool_choice={"type": "function", "function": {"name": "book"}})

    async def main():
        client = aclient()
        # seeded (choice i of a request draws with seed + i): the same samples every run,
        # and no two requests share a seed range
        jobs = [(k, client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Fill in the form."}],
            temperature=1, max_tokens=256, n=n, seed=1000 * j, **kw))
            for j, (k, kw, n) in enumerate((k, kw, n) for k, kw in sets.items() for n in SPLIT)]
        results = await asyncio.gather(*(j for _, j in jobs))
        out = {}
        for (k, _), r in zip(jobs, results):
            out.setdefault(k, []).extend(r.choices)
        return out

    started = time.time()
    out = asyncio.run(main())
    print(f"\n{len(sets) * SAMPLES} constrained samples in {time.time() - started:.1f} s")
    return out


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_response_format_50_of_50(sampled, name):
    choices = sampled[f"schema:{name}"]
    assert len(choices) == SAMPLES
    for c in choices:
        jsonschema.validate(json.loads(c.message.content), SCHEMAS[name])


@pytest.mark.parametrize("mode", ["required", "named"])
def test_forced_tool_choice_50_of_50(sampled, mode):
    choices = sampled[mode]
    assert len(choices) == SAMPLES
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (TAGS, BOOK)}
    for c in choices:
        assert c.finish_reason == "tool_calls" and c.message.tool_calls
        for call in c.message.tool_calls:
            assert call.id.startswith("call_")
            if mode == "named":
                assert call.function.name == "book"
            jsonschema.validate(json.loads(call.function.arguments),
                                schemas[call.function.name])


def test_forced_call_streams_as_tool_call_deltas(client, server):
    kw = dict(model=server[1], messages=USER, tools=[WEATHER, BOOK], temperature=0,
              max_tokens=80, tool_choice={"type": "function", "function": {"name": "book"}},
              parallel_tool_calls=False)
    full = client.chat.completions.create(**kw)
    streamed = _assemble(client.chat.completions.create(stream=True, **kw))
    mine = _summary(full.choices[0].message, full.choices[0].finish_reason)
    assert streamed[3] == mine[3] == "tool_calls"
    assert [c[1:] for c in streamed[2]] == [c[1:] for c in mine[2]]
    assert mine[2][0][1] == "book" and streamed[0] is None


# -------------------------------------------------------------------- bad input
BAD = [
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": "x"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "(?=a)b"}}}}}},
     "response_format"),
    ({"guided_regex": "(?<=a)b"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a(?=b)"}}, "structured_outputs"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_call_parser": "klingon"}, "tool_call_parser"),
]


@pytest.mark.parametrize("extra,param", BAD)
def test_bad_input_is_a_400_naming_the_field(server, extra, param):
    base, model, _ = server
    body = dict({"model": model, "messages": USER, "max_tokens": 4}, **extra)
    r = requests.post(base + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert requests.get(base + "/health", timeout=5).status_code == 200


@pytest.mark.parametrize("raw", [
    b'{"model": "M", "messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}',
    b'{"model": "M", "messages": [{"role": "user", "content": "a\\u0000b"}], "max_tokens": 2}',
    b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
    b'"tools": [{"type": "function", "function": {"name": "f", "description": "\\udfff"}}]}',
])
def test_surrogates_and_nul_bytes_never_500(server, raw):
    base, model, _ = server
    r = requests.post(base + "/v1/chat/completions", data=raw.replace(b'"M"', json.dumps(
        model).encode()), headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert r.json()["error"]["param"], r.text
    assert requests.get(base + "/health", timeout=5).status_code == 200
