"""OpenAI's Responses API (`/v1/responses`) and Vertex AI's predict route (`AIP_MODE=PREDICTION`)
of `spark serve` (issue 24), on the fake engine of test_serve_parity (fast tier): the official
`openai` client's responses.create (whole and streamed, and its stream helper), the translation of
every input item kind, reasoning and tool calls as output items, what Spark cannot do refused by
name in OpenAI's error shape (the server serving on), and /predict with one, two (on two slots)
and bad instances."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

from test_serve import KEY
from test_serve_parity import CHAT, _Engine

from _serve_client import fake_client
from spark_cli.serve.protocol import ApiError, parse
from spark_cli.serve.responses import EventStream, ResponsesRequest, chat_request, to_chat
from spark_cli.serve.vertex import Vertex, format_alias

openai = pytest.importorskip("openai")

HI = "hi there"
TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


class _Scripted(_Engine):
    """Answers with REPLY's words (each a token, its piece the word and a space), then ends."""

    REPLY = "yes of course"

    def make_sampler(self, *args, **kw):
        reply: list[int] = []

        def sample(engine, logits, row=-1):
            if not reply:
                reply.extend([self._id(w) for w in self.REPLY.split()] + [self.EOG])
            return reply.pop(0)

        return SimpleNamespace(sample=sample, prime=lambda prompt: None, close=lambda: None)


def _client(engine=_Engine, **state):
    return fake_client(lambda: engine(n_ctx=256), **state)


def _oai(tc, key: str = "none") -> "openai.OpenAI":
    return openai.OpenAI(base_url="http://127.0.0.1:8080/v1", api_key=key, http_client=tc, max_retries=0)


def _chat_answer(tc, messages) -> dict:
    return tc.post("/v1/chat/completions", json={"messages": messages, "temperature": 0}).json()


# ---------------------------------------------------------------- the Responses API


def test_responses_create_whole_and_streamed_with_the_openai_client():
    with _client() as tc:
        c = _oai(tc)
        chat = _chat_answer(tc, [{"role": "system", "content": "Book"}, {"role": "user", "content": HI}])
        res = c.responses.create(model="gpt-4.1", input=[{"role": "system", "content": "Book"},
                                                          {"role": "user", "content": HI}],
                                 max_output_tokens=8, temperature=0)
        assert res.id.startswith("resp_") and res.object == "response" and res.status == "completed"
        assert res.model == "gpt-4.1" and [o.type for o in res.output] == ["message"]
        assert res.output[0].id.startswith("msg_") and res.output[0].role == "assistant"
        assert res.output_text == chat["choices"][0]["message"]["content"] == "yes of course "
        assert (res.usage.input_tokens, res.usage.output_tokens, res.usage.total_tokens) == (
            chat["usage"]["prompt_tokens"], 3, chat["usage"]["prompt_tokens"] + 3)
        # instructions are the system message: the same prompt
        same = c.responses.create(model="m", instructions="Book", input=HI, temperature=0)
        assert same.usage.input_tokens == res.usage.input_tokens
        counted = tc.post("/v1/responses/input_tokens", json={"instructions": "Book", "input": HI}).json()
        assert counted == {"object": "response.input_tokens", "input_tokens": res.usage.input_tokens}

        events = list(c.responses.create(model="gpt-4.1", input=HI, max_output_tokens=8, stream=True))
        kinds = [e.type for e in events]
        n = kinds.count("response.output_text.delta")
        assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", *["response.output_text.delta"] * n,
                         "response.output_text.done", "response.content_part.done", "response.output_item.done",
                         "response.completed"] and n == 3
        assert [e.sequence_number for e in events] == list(range(len(events)))
        resp_id, msg_id = events[0].response.id, events[2].item.id
        assert resp_id.startswith("resp_") and msg_id.startswith("msg_")
        assert all(e.item_id == msg_id for e in events if hasattr(e, "item_id"))
        done = events[-1].response
        assert done.id == resp_id and done.output[0].id == msg_id
        assert "".join(e.delta for e in events if e.type.endswith(".delta")) == done.output_text == res.output_text
        assert done.usage.output_tokens == 3 and events[-1].model_extra["timings"]["predicted_n"] == 3
        with c.responses.stream(model="m", input=HI) as s:  # the client's helper needs output_index and content_index
            assert s.get_final_response().output_text == res.output_text


def test_timings_per_token_ride_on_the_deltas_and_a_progress_report_is_in_progress():
    with _client() as tc, tc.stream("POST", "/responses", json={"input": HI, "stream": True,
                                                                "timings_per_token": True}) as s:
        data = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert all("timings" in d for d in data if d["type"] == "response.output_text.delta")
    assert data[-1]["type"] == "response.completed" and "prompt_per_second" in data[-1]["timings"]
    # the return_progress hook: a chunk with prompt_progress is a response.in_progress event with it
    stream = EventStream("m", 0)
    stream.start()
    progress = {"total": 10, "cache": 0, "processed": 4, "time_ms": 3}
    ev = stream.feed({"choices": [], "prompt_progress": progress, "timings": {"prompt_n": 4}})
    assert [(e["type"], e["prompt_progress"], e["timings"]) for e in ev] == [
        ("response.in_progress", progress, {"prompt_n": 4})]


def test_every_input_item_kind_becomes_the_chat_message_llama_server_makes():
    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
        {"type": "message", "role": "user", "content": "Weather in Paris?"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Call the tool."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."},
                                                             {"type": "refusal", "refusal": "No more."}]},
        {"role": "user", "content": "Thanks"},
    ]
    req = parse(ResponsesRequest, json.dumps({"instructions": "sys", "input": items, "tools": [TOOL],
                                              "tool_choice": {"type": "function", "name": "get_weather"},
                                              "max_output_tokens": 5, "reasoning": {"effort": "low"},
                                              "top_k": 3, "store": False}).encode())
    body = to_chat(req)
    assert body["messages"] == [
        {"role": "system", "content": "sys"},
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [], "reasoning_content": "Call the tool.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": [{"type": "text", "text": "Sunny."}, {"type": "text", "text": "No more."}]},
        {"role": "user", "content": "Thanks"},
    ]
    chat = chat_request(req)
    assert chat.choice == "get_weather" and chat.asked_limit == 5 and chat.top_k == 3
    assert chat.template_kwargs() == {"reasoning_effort": "low"}
    assert chat.tool_dicts()[0]["function"]["parameters"] == TOOL["parameters"]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = parse(ResponsesRequest, json.dumps({"input": "x", "text": {"format": {
        "type": "json_schema", "name": "n", "schema": schema}}}).encode())
    assert chat_request(fmt).response_format.schema() == schema


def test_reasoning_and_tool_calls_are_output_items():
    class Thinks(_Scripted):
        REPLY = "<think> look it up </think> " + CALL

    with _client(Thinks) as tc:
        c = _oai(tc)
        res = c.responses.create(model="m", input="Weather in Paris?", tools=[TOOL])
        assert [o.type for o in res.output] == ["reasoning", "function_call"]
        assert res.output[0].id.startswith("rs_") and res.output[0].content[0].text.strip() == "look it up"
        call = res.output[1]
        assert call.call_id.startswith("call_") and call.id == "fc_" + call.call_id[5:]
        assert (call.name, json.loads(call.arguments), call.status) == ("get_weather", {"city": "Paris"}, "completed")
        events = list(c.responses.create(model="m", input="Weather in Paris?", tools=[TOOL], stream=True))
        kinds = [e.type for e in events]
        assert "response.reasoning_text.delta" in kinds and "response.function_call_arguments.delta" in kinds
        added = [e.item for e in events if e.type == "response.output_item.added"]
        assert [(i.type, i.status) for i in added] == [("reasoning", "in_progress"), ("function_call", "in_progress")]
        assert added[1].name == "get_weather"  # the call's name from its first event (Codex reads it there)
        args = next(e for e in events if e.type == "response.function_call_arguments.done")
        final = events[-1].response.output
        assert args.item_id == added[1].id == final[1].id and json.loads(args.arguments) == {"city": "Paris"}
        assert [o.type for o in final] == ["reasoning", "function_call"]
        # the call sent back with its output: a tool message the next turn reads
        again = c.responses.create(model="m", tools=[TOOL], input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
        assert again.status == "completed" and again.usage.input_tokens > res.usage.input_tokens


def test_what_codex_sends_is_accepted_and_hosted_tools_are_skipped(caplog):
    """include, reasoning.summary, store, prompt_cache_key, client_metadata, namespace and
    web_search tools (skipped with a warning), and a reasoning item sent back with only its
    encrypted_content (left out of the prompt)."""
    class Thinks(_Scripted):
        REPLY = "<think> hmm </think> " + CALL

    body = {"input": [{"role": "developer", "content": [{"type": "input_text", "text": "be brief"}]},
                      {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
                      {"type": "reasoning", "summary": [], "encrypted_content": "gAAAA"}],
            "tools": [{"type": "namespace", "name": "agents", "tools": [TOOL]}, TOOL,
                      {"type": "web_search", "external_web_access": False}],
            "tool_choice": "auto", "parallel_tool_calls": True, "reasoning": {"summary": "auto", "effort": "low"},
            "store": False, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "k",
            "client_metadata": {"x": "y"}, "stream": False}
    with _client(Thinks) as tc:
        r = tc.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        out = r.json()["output"]
        assert [o["type"] for o in out] == ["reasoning", "function_call"] and out[1]["name"] == "get_weather"
        assert "encrypted_content" not in out[0] and out[0]["content"][0]["text"].strip() == "hmm"
        rendered = tc.post("/v1/responses/input_tokens", json=body).json()["input_tokens"]
        assert rendered == tc.post("/v1/responses/input_tokens", json={
            **body, "tools": [TOOL], "input": body["input"][:2]}).json()["input_tokens"]
    warned = [r.getMessage() for r in caplog.records if r.name == "spark.serve"]
    assert warned[:2] == ["tools.0: a 'namespace' tool skipped: spark serve runs no hosted tools",
                          "tools.2: a 'web_search' tool skipped: spark serve runs no hosted tools"]


@pytest.mark.parametrize("body,where", [
    ({}, "input"),
    ({"input": 5}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input.0.content.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input.0.content.0.type"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input.0.arguments"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
    ({"input": [{"type": "web_search_call", "id": "ws"}]}, "input.0.type"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input.0.role"),
    ({"input": [{"content": "x"}]}, "input.0"),
    ({"input": []}, "input"),
    ({"input": HI, "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": HI, "conversation": "conv_1"}, "conversation"),
    ({"input": HI, "background": True}, "background"),
    ({"input": HI, "top_logprobs": 3}, "top_logprobs"),
    ({"input": HI, "truncation": "auto"}, "truncation"),
    ({"input": HI, "tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}}, "tools.0.type"),
    ({"input": HI, "tools": [{**TOOL, "parameters": {"type": "array"}}]}, "tools.0.parameters"),
    ({"input": HI, "tools": [{"type": "web_search"}, {**TOOL, "parameters": {"type": "array"}}]},
     "tools.1.parameters"),  # counting the skipped tool
    ({"input": HI, "tools": [{"type": "namespace", "name": "ns", "tools": []}, {**TOOL, "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": "one"}}}}], "tool_choice": "required"},
     "tools.1.parameters"),  # the grammar's refusal too
    ({"input": HI, "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": HI, "tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": HI, "text": {"verbosity": "low"}}, "text.verbosity"),
    ({"input": HI, "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format"),
    ({"input": HI, "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": HI, "temperature": 3}, "temperature"),
    ({"input": HI, "mirostat": 2}, "mirostat"),
    ({"input": HI, "messages": [{"role": "user", "content": HI}]}, "messages"),
])
def test_what_spark_cannot_do_is_refused_by_name(body, where):
    with _client() as tc:
        r = tc.post("/v1/responses", json=body)
        err = r.json()["error"]
        assert r.status_code == 400 and err["type"] == "invalid_request_error", r.text
        assert err["param"] == where and err["message"].startswith(where + ":"), err
        assert tc.post("/v1/responses", json={"input": HI}).status_code == 200  # the server serves on


def test_the_openai_client_gets_the_refusal_and_the_key_is_checked():
    with _client(api_key=KEY) as tc:
        with pytest.raises(openai.BadRequestError) as e:
            _oai(tc, KEY).responses.create(model="m", input=HI, previous_response_id="resp_x")
        assert e.value.body["param"] == "previous_response_id" and "stores no responses" in e.value.message
        with pytest.raises(openai.AuthenticationError):
            _oai(tc, "wrong").responses.create(model="m", input=HI)
        assert _oai(tc, KEY).responses.create(model="m", input=HI).output_text == "yes of course "


def test_a_failure_in_the_stream_is_an_error_event():
    stream = EventStream("m", 0)
    ev = stream.error(ApiError(503, "the engine failed", "unavailable_error"))
    assert ev == {"type": "error", "sequence_number": 0, "code": "unavailable_error",
                  "message": "the engine failed", "param": None}


# ---------------------------------------------------------------- Vertex AI's predict route


def _predict(tc, *instances, **headers):
    return tc.post("/predict", json={"instances": list(instances)}, headers=headers)


def _chat_instance(text: str) -> dict:
    return {"@requestFormat": "chatCompletions", "max_tokens": 8, "messages": [{"role": "user", "content": text}]}


def test_vertex_settings_from_the_environment():
    assert Vertex.from_env({}) is None and Vertex.from_env({"AIP_MODE": "TRAINING"}) is None
    assert Vertex.from_env({"AIP_MODE": "PREDICTION"}) == Vertex(8080, "/predict", "")
    assert Vertex.from_env({"AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": "9000", "AIP_PREDICT_ROUTE": "v1/endpoint",
                            "AIP_HEALTH_ROUTE": "/ping"}) == Vertex(9000, "/v1/endpoint", "/ping")
    from spark_cli.errors import UsageError
    with pytest.raises(UsageError, match="AIP_HTTP_PORT"):
        Vertex.from_env({"AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": "http"})
    assert [format_alias(p) for p in ("/v1/chat/completions", "/apply-template", "/v1/chat/completions/input_tokens",
                                      "/completion", "/v1/messages")] == [
        "chatCompletions", "applyTemplate", "chatCompletionsInputTokens", "completion", "messages"]


def test_predict_one_instance_is_the_chat_answer():
    with _client(vertex=Vertex(health_route="/ping"), api_key=KEY) as tc:
        auth = {"Authorization": f"Bearer {KEY}"}
        assert _predict(tc, _chat_instance(HI)).status_code == 401  # behind the same key
        assert tc.get("/ping").json() == {"status": "ok"}  # the health route, public as /health
        r = _predict(tc, _chat_instance(HI), **auth)
        assert r.status_code == 200 and list(r.json()) == ["predictions"]
        (p,) = r.json()["predictions"]
        assert p["object"] == "chat.completion" and p["choices"][0]["message"] == {
            "role": "assistant", "content": "yes of course "}
        direct = _predict(tc, {"@requestFormat": "/v1/chat/completions", **CHAT}, **auth).json()["predictions"]
        assert direct[0]["choices"][0]["message"]["content"] == "yes of course "
    with _client() as tc:  # without AIP_MODE=PREDICTION there is no predict route
        assert tc.post("/predict", json={"instances": []}).status_code == 404


class _Slow(_Engine):
    """Two slots, each decode step takes a while, and the sequences of each step are recorded."""

    def __init__(self, n_ctx: int):
        super().__init__(n_ctx, n_seq=2)
        self.steps: list[set[int]] = []

    def decode(self, entries):
        time.sleep(0.02)
        self.steps.append({seq for _, seq, _ in entries})
        super().decode(entries)


def test_predict_two_instances_run_at_once_on_two_slots():
    eng = _Slow(n_ctx=256)
    with fake_client(lambda: eng, vertex=Vertex()) as tc:
        chat = _predict(tc, _chat_instance("Say hello"), _chat_instance("Say world")).json()["predictions"]
        assert [p["choices"][0]["message"]["content"] for p in chat] == ["yes of course "] * 2
        assert {0, 1} in eng.steps  # one batch decoded both
        native = {"@requestFormat": "completion", "prompt": "hello there", "n_predict": 4}
        both = _predict(tc, native, {**native, "prompt": "other words"}).json()["predictions"]
        # `prompt`: llama-server's, the prompt's tokens detokenized (this fake's pieces end in a space)
        assert [p["prompt"] for p in both] == ["hello there ", "other words "]
        assert sorted(p["id_slot"] for p in both) == [0, 1]


def test_predict_bad_instances_are_errors_in_their_place():
    with _client(vertex=Vertex()) as tc:
        good = _chat_instance(HI)
        out = _predict(tc, good, "text", {"max_tokens": 8}, {"@requestFormat": "embeddings"},
                       {**good, "stream": True}, {**good, "temperature": 9},
                       {"@requestFormat": "responses", "input": HI}).json()["predictions"]
        assert out[0]["choices"][0]["message"]["content"] == "yes of course "
        errors = [p["error"] for p in out[1:6]]
        # NOTE: embeddings has its route (llama-server's), not supported without --embedding
        assert [e["code"] for e in errors] == [400, 400, 501, 400, 400]
        assert [e["type"] for e in errors] == ["invalid_request_error"] * 2 + ["not_supported_error"] + [
            "invalid_request_error"] * 2
        assert "must be a JSON object" in errors[0]["message"] and "@requestFormat" in errors[1]["message"]
        assert "Start it with `--embeddings`" in errors[2]["message"]
        assert errors[3]["param"] == "stream" and errors[4]["param"] == "temperature"
        assert out[6]["object"] == "response" and out[6]["output"][0]["content"][0]["text"] == "yes of course "
        for body in ({}, {"instances": "x"}, {"instances": [good] * 129}):
            r = tc.post("/predict", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == "instances", r.text
        assert _predict(tc, good).status_code == 200  # the server serves on


def test_a_predict_route_that_is_a_route_already_is_refused():
    from spark_cli.errors import UsageError
    with pytest.raises(UsageError, match="AIP_PREDICT_ROUTE=/v1/models"):
        with _client(vertex=Vertex(predict_route="/v1/models")):
            pass


def test_a_max_tokens_cut_right_after_a_complete_call_is_length_as_llama_servers():
    class Calls(_Scripted):
        REPLY = CALL

    n = len(CALL.split())  # each word a token: the call is complete with the last one
    chat_tool = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}
    with _client(Calls) as tc:
        body = {"messages": [{"role": "user", "content": HI}], "tools": [chat_tool]}
        cut = tc.post("/v1/chat/completions", json={**body, "max_tokens": n}).json()["choices"][0]
        assert cut["finish_reason"] == "length" and cut["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
        whole = tc.post("/v1/chat/completions", json={**body, "max_tokens": n + 5}).json()["choices"][0]
        assert whole["finish_reason"] == "tool_calls"
        tool = {"name": "get_weather", "input_schema": TOOL["parameters"]}
        m = tc.post("/v1/messages", json={"messages": [{"role": "user", "content": HI}], "tools": [tool],
                                          "max_tokens": n}).json()
        assert m["stop_reason"] == "max_tokens" and m["content"][-1]["type"] == "tool_use"


def test_a_forced_call_that_breaks_its_schema_is_a_warning_in_the_log(caplog):
    """The grammar may be looser than the schema (core/json_schema.relax): the call is checked
    after generation against the original. (The fake engine samples no grammar: its scripted
    call stands for what a relaxed grammar let through.)"""
    class Calls(_Scripted):
        REPLY = CALL

    strict = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 3, "pattern": "^[a-z]+$"}}}}}
    with _client(Calls) as tc:
        body = {"messages": [{"role": "user", "content": HI}], "tools": [strict], "tool_choice": "required"}
        r = tc.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "tool_calls"
        fits = {**strict, "function": {**strict["function"], "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}}}}
        assert tc.post("/v1/chat/completions", json={**body, "tools": [fits]}).status_code == 200
    warned = [r.getMessage() for r in caplog.records if r.name == "spark.serve"]
    assert len(warned) == 1 and warned[0].startswith(
        "the arguments of the forced call to 'get_weather' break its schema: city: 'Paris' ")
