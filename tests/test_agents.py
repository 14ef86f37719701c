"""Agents on `spark serve`: tools, tool_choice, tool round trips, structured output and
/apply-template, end to end on the RPC stand-in with the official `openai` client; bad agent
input answered 4xx in OpenAI's shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


from test_serve import KEY, _SlowLoadingEngine, _start, _stop

from spark_cli.core.chat_template import TemplateError
from spark_cli.native.rpc import RpcServer
from spark_cli.serve.app import ServerState, create_app
from spark_cli.serve.learn import Learner
from spark_cli.serve.stats import ServerStats
from spark_cli.serve.worker import Worker

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

WEATHER_SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": WEATHER_SCHEMA}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ANSWER_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                                  "age": {"type": "integer"}, "tags": {"type": "array", "items": {
                                                      "type": "string", "maxLength": 8}, "maxItems": 2}},
                 "required": ["name", "age", "tags"], "additionalProperties": False}
N = 80  # tokens at most per answer (a grammar-bound call is shorter)


def validate(value, schema: dict, where: str = "$") -> list[str]:
    """The problems of `value` against the JSON Schema subset these tests use."""
    errs: list[str] = []
    kinds = {"object": dict, "array": list, "string": str, "integer": int, "number": (int, float), "boolean": bool}
    t = schema.get("type")
    if t and not (isinstance(value, kinds[t]) and not (t in ("integer", "number") and isinstance(value, bool))):
        return [f"{where}: not {t}: {value!r}"]
    if "enum" in schema and value not in schema["enum"]:
        errs.append(f"{where}: {value!r} not in {schema['enum']}")
    if isinstance(value, str) and len(value) > schema.get("maxLength", len(value)):
        errs.append(f"{where}: longer than {schema['maxLength']}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        errs += [f"{where}: missing {k}" for k in schema.get("required", []) if k not in value]
        if schema.get("additionalProperties") is False:
            errs += [f"{where}: unexpected {k}" for k in value if k not in props]
        for k, v in value.items():
            if k in props:
                errs += validate(v, props[k], f"{where}.{k}")
    if isinstance(value, list):
        if len(value) > schema.get("maxItems", len(value)):
            errs.append(f"{where}: more than {schema['maxItems']} items")
        errs += [e for i, v in enumerate(value) for e in validate(v, schema.get("items", {}), f"{where}[{i}]")]
    return errs


def test_the_validator_finds_problems():
    assert validate({"city": "Paris", "unit": "celsius"}, WEATHER_SCHEMA) == []
    assert len(validate({"city": "P" * 13, "unit": "kelvin", "x": 1}, WEATHER_SCHEMA)) == 3
    assert validate({"unit": "celsius"}, WEATHER_SCHEMA) == ["$: missing city"]


@pytest.fixture(scope="module")
def rpc():
    srv = RpcServer(threads=1).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def server(small_model, rpc, tmp_path_factory):
    d = tmp_path_factory.mktemp("agents")
    m = d / small_model.name
    m.symlink_to(small_model)
    srv = _start(m, rpc, d, "--api-key", KEY, "--learn-every", "0", "--no-learn", "--jinja")
    yield srv
    _stop(srv)


def _call_args(call, schema: dict) -> dict:
    args = json.loads(call.function.arguments)
    assert validate(args, schema) == [], (call.function.arguments, validate(args, schema))
    return args


@pytest.mark.model
def test_required_tool_choice_returns_a_valid_call(server):
    c = server.client()
    r = c.chat.completions.create(model="x", messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required",
                                  temperature=0, max_tokens=N)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1
    call = ch.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    _call_args(call, {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}[call.function.name])

    named = c.chat.completions.create(model="x", messages=ASK, tools=[WEATHER, CLOCK], temperature=0.9, seed=7,
                                      tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=N)
    call = named.choices[0].message.tool_calls[0]
    assert call.function.name == "get_time"
    _call_args(call, CLOCK["function"]["parameters"])


@pytest.mark.model
def test_streaming_and_non_streaming_agree(server):
    c = server.client()
    kw = dict(model="x", messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=N)
    whole = c.chat.completions.create(**kw).choices[0]
    chunks = list(c.chat.completions.create(**kw, stream=True))
    calls: dict[int, dict] = {}
    for ch in chunks:
        for tc in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
            got = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            got["id"] = tc.id or got["id"]
            got["name"] = (tc.function.name if tc.function else None) or got["name"]
            got["arguments"] += (tc.function.arguments or "") if tc.function else ""
    want = whole.message.tool_calls[0]
    assert list(calls) == [0] and calls[0]["id"].startswith("call_")
    assert (calls[0]["name"], calls[0]["arguments"]) == (want.function.name, want.function.arguments)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"

    plain = dict(model="x", messages=ASK, temperature=0, max_tokens=12)
    text = c.chat.completions.create(**plain).choices[0].message.content
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(**plain, stream=True)
                       if ch.choices)
    assert streamed == text and text


@pytest.mark.model
def test_tool_round_trip(server):
    c = server.client()
    first = c.chat.completions.create(model="x", messages=ASK, tools=[WEATHER], tool_choice="required",
                                      temperature=0, max_tokens=N)
    call = first.choices[0].message.tool_calls[0]
    result = "18 degrees and sunny"
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": result}]
    city = json.loads(call.function.arguments)["city"]
    with server.http() as h:
        for choice in ("auto", "none"):
            prompt = h.post("/apply-template", json={"messages": history, "tools": [WEATHER],
                                                     "tool_choice": choice}).json()["prompt"]
            call_at = prompt.rfind(f'"city": {json.dumps(city)}')
            assert 0 <= call_at < prompt.find(result), (choice, prompt)  # the call, then its result
    second = c.chat.completions.create(model="x", messages=history, tools=[WEATHER], tool_choice="none",
                                       temperature=0, max_tokens=8)
    assert second.choices[0].finish_reason in ("stop", "length") and second.choices[0].message.tool_calls is None


@pytest.mark.model
def test_tool_choice_none_renders_without_tools(server):
    with server.http() as h:
        with_tools = h.post("/apply-template", json={"messages": ASK, "tools": [WEATHER]}).json()["prompt"]
        none = h.post("/apply-template", json={"messages": ASK, "tools": [WEATHER], "tool_choice": "none"}).json()
        bare = h.post("/apply-template", json={"messages": ASK}).json()["prompt"]
    assert "get_weather" in with_tools and none["prompt"] == bare and "get_weather" not in bare


@pytest.mark.model
def test_response_format_returns_valid_json(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": ANSWER_SCHEMA}}
    r = server.client().chat.completions.create(
        model="x", messages=[{"role": "user", "content": "Describe a person as JSON."}], response_format=fmt,
        temperature=0, max_tokens=N)
    assert r.choices[0].finish_reason == "stop"
    assert validate(json.loads(r.choices[0].message.content), ANSWER_SCHEMA) == []


@pytest.mark.model
def test_json_object_is_an_object(server):
    """An open object may go on past max_tokens (the grammar has no bound): what came is an object's start."""
    r = server.client().chat.completions.create(
        model="x", messages=[{"role": "user", "content": "Reply with JSON."}], response_format={"type": "json_object"},
        temperature=0, max_tokens=24)
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


@pytest.mark.model
@pytest.mark.parametrize("case,body,where", [
    ("parameters not an object", {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
     "tools.0.function.parameters"),
    ("arguments not JSON", {"messages": ASK + [{"role": "assistant", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages.1.tool_calls.0.function.arguments"),
    ("unknown function", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ("unknown choice", {"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ("not JSON Schema", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "object", "not": 5}}}}, "not valid JSON Schema"),
    ("not JSON Schema in a tool", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "multipleOf": -3}}}}}], "tool_choice": "required"},
     "tools.0.function.parameters: not valid JSON Schema: -3 is less than or equal to the minimum of 0 "
     "(at properties.n.multipleOf)"),
])
def test_bad_agent_input_is_a_400(server, case, body, where):
    with server.http() as h:
        for path in ("/v1/chat/completions", "/apply-template"):
            r = h.post(path, json={"messages": ASK, **body})
            assert r.status_code == 400, (case, r.text)
            err = r.json()["error"]
            assert where in err["message"] and err["type"] == "invalid_request_error", err
        assert h.get("/health").status_code == 200  # and it keeps serving


class _RaisingTemplate(_SlowLoadingEngine):
    def chat_prompt(self, messages, add_generation_prompt=True, tools=None, extras=None):
        raise TemplateError("chat template tokenizer.chat_template: UndefinedError: 'foo' is undefined")


def test_a_template_that_raises_is_a_400():
    from starlette.testclient import TestClient

    worker = Worker(lambda: _RaisingTemplate(n_ctx=64), set(), ServerStats(), Learner(Path("none.gguf"), None, enabled=False))
    worker.start()
    assert worker.ready.wait(30)
    try:
        with TestClient(create_app(ServerState(worker, ServerStats(), "m")), base_url="http://127.0.0.1") as tc:
            for path in ("/v1/chat/completions", "/apply-template"):
                r = tc.post(path, json={"messages": ASK})
                assert r.status_code == 400, r.text
                msg = r.json()["error"]["message"]
                assert "tokenizer.chat_template" in msg and "'foo' is undefined" in msg
    finally:
        worker.shutdown(1)


# Claude Code's Read tool: integer bounds the grammar must express (issue 39)
READ_SCHEMA = {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object", "properties": {
    "file_path": {"type": "string", "maxLength": 24},
    "offset": {"type": "integer", "minimum": 0, "maximum": 9007199254740991},
    "limit": {"type": "integer", "exclusiveMinimum": 0, "maximum": 9007199254740991},
    "depth": {"type": "integer", "exclusiveMinimum": -4, "exclusiveMaximum": -1}},
    "required": ["file_path", "offset", "limit", "depth"], "additionalProperties": False}
READ = {"type": "function", "function": {"name": "Read", "description": "Read a file", "parameters": READ_SCHEMA}}


@pytest.mark.model
def test_a_tool_with_exclusive_minimum_is_accepted_and_forced_calls_satisfy_it(server):
    import jsonschema

    c = server.client()
    ask = [{"role": "user", "content": "Read notes.txt"}]
    auto = c.chat.completions.create(model="x", messages=ask, tools=[READ], temperature=0, max_tokens=8)
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")  # accepted: no grammar, no refusal
    checked = 0
    for seed in (1, 2, 3):  # sampled (not greedy): the grammar, not the model, keeps the numbers in range
        r = c.chat.completions.create(model="x", messages=ask, tools=[READ], tool_choice="required",
                                      temperature=1.0, seed=seed, max_tokens=N)
        ch = r.choices[0]
        if ch.finish_reason == "length":  # cut before the call closed: nothing to check
            continue
        args = json.loads(ch.message.tool_calls[0].function.arguments)
        jsonschema.validate(args, READ_SCHEMA)
        assert args["limit"] >= 1 and -3 <= args["depth"] <= -2
        checked += 1
    assert checked >= 2
