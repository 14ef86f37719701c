"""The Anthropic Messages adapter without a model: requests translated to the OpenAI chat shape,
OpenAI results and chunk sequences (tool calls and reasoning included) translated to Messages
and event sequences (joined, the events equal the message), and the routes on a fake engine:
validation, error shapes, keys, count_tokens, one queue with the OpenAI routes."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from test_serve_hostile import BAD_BODIES, KEY, _client

from spark_cli.serve.anthropic import (CountRequest, EventStream, MessagesRequest, error_body, matched_stop,
                                       to_chat, to_message)
from spark_cli.serve.protocol import ApiError, ChatRequest, parse


def _req(body: dict, model: type = MessagesRequest):
    return parse(model, json.dumps({"max_tokens": 8, **body}).encode())


def _chat(body: dict) -> dict:
    return to_chat(_req(body))


# ---------------------------------------------------------------- requests


def test_system_text_and_stop_become_an_openai_chat():
    c = _chat({"model": "m", "system": "Be brief.", "stop_sequences": ["\n\n", "END"], "temperature": 0.2,
               "top_k": 5, "top_p": 0.5, "metadata": {"user_id": "u1"},
               "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                            {"role": "user", "content": [{"type": "text", "text": "One. "},
                                                         {"type": "text", "text": "Two."}]}]})
    assert c["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                             {"role": "assistant", "content": "Hello."},
                             {"role": "user", "content": [{"type": "text", "text": "One. "},
                                                          {"type": "text", "text": "Two."}]}]
    assert (c["model"], c["max_tokens"], c["stop"], c["temperature"], c["top_k"], c["top_p"]) == (
        "m", 8, ["\n\n", "END"], 0.2, 5, 0.5)
    req = parse(ChatRequest, json.dumps(c).encode())  # what the OpenAI side takes
    assert req.message_dicts()[-1] == {"role": "user", "content": "One. \nTwo."}  # llama-server's join of parts
    assert (req.asked_limit, req.stops, req.temperature) == (8, ["\n\n", "END"], 0.2)
    # unset sampling fields stay unset: the server's defaults, as on /v1/chat/completions
    bare = parse(ChatRequest, json.dumps(_chat({"messages": [{"role": "user", "content": "x"}]})).encode())
    assert (bare.temperature, bare.top_k, bare.stops) == (ChatRequest.model_fields["temperature"].default,
                                                          ChatRequest.model_fields["top_k"].default, [])


def test_system_blocks_tool_use_tool_result_and_thinking():
    c = _chat({
        "system": [{"type": "text", "text": "You are "}, {"type": "text", "text": "a tool user."}],
        "tools": [{"name": "weather", "description": "Weather now", "input_schema": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
                  {"name": "clock", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "messages": [
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Two cities.", "signature": "sig"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_01", "name": "weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "toolu_02", "name": "weather", "input": {"city": "Rome"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01", "content": "18 C"},
                {"type": "tool_result", "tool_use_id": "toolu_02", "is_error": True,
                 "content": [{"type": "text", "text": "no station"}]},
                {"type": "text", "text": "Thanks."}]}]})
    assert c["messages"] == [
        {"role": "system", "content": "You are a tool user."},  # llama-server joins system blocks as they are
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."}], "reasoning_content": "Two cities.",
         "tool_calls": [
             {"id": "toolu_01", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
             {"id": "toolu_02", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_01", "content": "18 C"},
        {"role": "tool", "tool_call_id": "toolu_02",
         "content": [{"type": "text", "text": "Error: no station"}]},
        {"role": "user", "content": [{"type": "text", "text": "Thanks."}]}]
    assert c["tools"] == [
        {"type": "function", "function": {"name": "weather", "description": "Weather now", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
        {"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}}]
    assert c["tool_choice"] == "required" and c["parallel_tool_calls"] is False
    assert c["chat_template_kwargs"] == {"enable_thinking": True}
    text = parse(ChatRequest, json.dumps(c).encode()).message_dicts()
    assert text[0]["content"] == "You are a tool user." and text[4] == {"role": "tool", "tool_call_id": "toolu_02",
                                                                      "content": "Error: no station"}


def test_an_assistant_turn_of_tool_calls_only_has_no_content():
    c = _chat({"messages": [{"role": "user", "content": "t?"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_9", "name": "clock", "input": {}}]}]})
    assert c["messages"][1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "toolu_9", "type": "function", "function": {"name": "clock", "arguments": "{}"}}]}


@pytest.mark.parametrize("choice,want", [
    ({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "none"}, "none"),
    ({"type": "tool", "name": "clock"}, {"type": "function", "function": {"name": "clock"}}),
])
def test_tool_choice(choice, want):
    c = _chat({"messages": [{"role": "user", "content": "x"}], "tool_choice": choice,
               "tools": [{"name": "clock", "input_schema": {"type": "object"}}]})
    assert c["tool_choice"] == want and "parallel_tool_calls" not in c


def test_count_request_needs_no_max_tokens():
    r = parse(CountRequest, b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}')
    assert to_chat(r) == {"messages": [{"role": "user", "content": "hi"}], "model": "m"}


MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body,where", [
    ({"messages": MSG}, "max_tokens: Field required"),
    ({"messages": MSG, "max_tokens": 0}, "max_tokens:"),
    ({"messages": "hi", "max_tokens": 4}, "messages:"),
    ({"messages": [], "max_tokens": 4}, "messages:"),
    ({"messages": [{"role": "system", "content": [{"type": "tool_result", "tool_use_id": "a"}]}], "max_tokens": 4},
     "messages.0: content.0: a tool_result block is not allowed in a system message"),
    ({"messages": [{"role": "tool", "content": "x"}], "max_tokens": 4}, "messages.0.role:"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 4},
     "messages.0.content.0: Input tag 'image'"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}], "max_tokens": 4},
     "tool_use_id: Field required"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b", "input": {}}]}],
      "max_tokens": 4}, "content.0: a tool_use block is not allowed in a user message"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "b", "input": "x"}]}],
      "max_tokens": 4}, "input: Input should be a valid dictionary"),
    ({"messages": MSG, "max_tokens": 4, "tools": [{"name": "f", "input_schema": "object"}]},
     "tools.0.input_schema: Input should be a valid dictionary"),
    ({"messages": MSG, "max_tokens": 4, "tools": [{"name": "f"}]}, "tools.0: input_schema: required"),
    ({"messages": MSG, "max_tokens": 4, "tool_choice": {"type": "tool"}}, "tool_choice: name: required"),
    ({"messages": MSG, "max_tokens": 4, "tool_choice": {"type": "sometimes"}}, "tool_choice.type:"),
    ({"messages": MSG, "max_tokens": 4, "temperature": 1.5}, "temperature:"),
    ({"messages": MSG, "max_tokens": 4, "stop_sequences": ["a", ""]}, "stop_sequences:"),
    ({"messages": MSG, "max_tokens": 4, "system": 7}, "system:"),
])
def test_validation_names_the_field(body, where):
    with pytest.raises(ApiError) as e:
        parse(MessagesRequest, json.dumps(body).encode())
    assert e.value.status == 400 and where in e.value.message, e.value.message


# ---------------------------------------------------------------- results and streams


def _body(content: str = "", reasoning: str = "", calls: tuple = (), finish: str = "stop",
          usage: tuple[int, int] = (11, 7)) -> dict:
    message: dict = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [{"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                                 for i, n, a in calls]
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "the-model",
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1], "total_tokens": sum(usage)}}


def test_a_text_result_is_a_message():
    m = to_message(_body("Paris."), id="msg_1")
    assert m == {"id": "msg_1", "type": "message", "role": "assistant", "model": "the-model",
                 "content": [{"type": "text", "text": "Paris."}], "stop_reason": "end_turn", "stop_sequence": None,
                 "usage": {"input_tokens": 11, "output_tokens": 7}}
    assert to_message(_body("x"))["id"].startswith("msg_")


def test_reasoning_and_tool_calls_become_thinking_and_tool_use_blocks():
    m = to_message(_body("Let me look.", "The user wants weather.",
                         (("call_a", "weather", '{"city": "Paris"}'), ("toolu_b", "clock", "")), "tool_calls"))
    assert m["content"] == [
        {"type": "thinking", "thinking": "The user wants weather.", "signature": ""},
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_call_a", "name": "weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "toolu_b", "name": "clock", "input": {}}]
    assert m["stop_reason"] == "tool_use"


@pytest.mark.parametrize("finish,stop_word,stops,reason,sequence", [
    ("stop", None, None, "end_turn", None),
    ("length", None, None, "max_tokens", None),
    ("tool_calls", None, None, "tool_use", None),
    ("stop", "END", ["END", "\n\n"], "stop_sequence", "END"),
    ("stop", "</tool_call>", ["END"], "end_turn", None),  # a stop the server added is not the client's
])
def test_stop_reasons(finish, stop_word, stops, reason, sequence):
    req = _req({"messages": MSG, **({"stop_sequences": stops} if stops else {})})
    m = to_message(_body("a", finish=finish), matched_stop(stop_word, req))
    assert (m["stop_reason"], m["stop_sequence"]) == (reason, sequence)


def _pieces(text: str, cuts: list[int]) -> list[str]:
    at = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(at, at[1:])]


def _chunks(body: dict, cuts: list[int]) -> list[dict]:
    """The OpenAI chunks of `body`, each text cut at `cuts`, tool calls by index, then finish and usage."""
    msg, choice = body["choices"][0]["message"], body["choices"][0]
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": body["model"],
            "usage": None}

    def chunk(delta: dict, finish: str | None = None) -> dict:
        return {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}

    out = [chunk({"role": "assistant", "content": ""})]
    out += [chunk({"reasoning_content": p}) for p in _pieces(msg.get("reasoning_content", ""), cuts)]
    out += [chunk({"content": p}) for p in _pieces(msg["content"] or "", cuts)]
    for i, call in enumerate(msg.get("tool_calls") or ()):
        args = _pieces(call["function"]["arguments"], cuts)
        out.append(chunk({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                          "function": {"name": call["function"]["name"], "arguments": ""}}]}))
        out += [chunk({"tool_calls": [{"index": i, "function": {"arguments": a}}]}) for a in args]
    out.append(chunk({}, choice["finish_reason"]))
    out.append({**base, "choices": [], "usage": body["usage"]})
    return out


def _join(events: list[dict]) -> dict:
    """What a client builds from the events, checking their order as documented."""
    assert events[0]["type"] == "message_start" and events[-1] == {"type": "message_stop"}
    assert events[-2]["type"] == "message_delta"
    msg, block, partial = copy.deepcopy(events[0]["message"]), None, ""
    assert msg["content"] == [] and msg["stop_reason"] is None
    for ev in events[1:-1]:
        kind = ev["type"]
        if kind == "ping":
            continue
        if kind == "content_block_start":
            assert block is None and ev["index"] == len(msg["content"])
            block, partial = copy.deepcopy(ev["content_block"]), ""
            msg["content"].append(block)
        elif kind == "content_block_delta":
            assert block is not None and ev["index"] == len(msg["content"]) - 1
            d = ev["delta"]
            field, value = {"text_delta": ("text", "text"), "thinking_delta": ("thinking", "thinking"),
                            "input_json_delta": (None, "partial_json")}[d["type"]]
            assert d[value], "an empty delta"
            if field is None:
                assert block["type"] == "tool_use"
                partial += d[value]
            else:
                assert block["type"] == field
                block[field] += d[value]
        elif kind == "content_block_stop":
            assert block is not None and ev["index"] == len(msg["content"]) - 1
            if block["type"] == "tool_use":
                block["input"] = json.loads(partial or "{}")
            block = None
        elif kind == "message_delta":
            assert block is None
            msg.update(ev["delta"])
            msg["usage"]["output_tokens"] = ev["usage"]["output_tokens"]
        else:
            raise AssertionError(f"unexpected event {kind}")
    return msg


def _events(body: dict, cuts: list[int], stop: str | None = None) -> list[dict]:
    es = EventStream(body["model"], body["usage"]["prompt_tokens"], id="msg_s")
    events = es.start()
    for ch in _chunks(body, cuts):
        events += es.feed(ch)
    return events + es.end(stop)


CASES = [_body("Paris is the capital."), _body("", finish="length"),
         _body("Let me check.", "Weather, two cities. Use the tool.",
               (("call_1", "weather", '{"city": "Paris", "units": ["c", "f"]}'),
                ("call_2", "clock", "{}")), "tool_calls", (40, 25)),
         _body("", "", (("call_x", "search", '{"q": "spark \\"moe\\""}'),), "tool_calls"),
         _body("Done.", "Short thought.", finish="length", usage=(3, 9))]


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(range(len(CASES))), cuts=st.lists(st.integers(0, 200), max_size=8))
def test_streamed_events_joined_equal_the_message(case, cuts):
    body = CASES[case]
    assert _join(_events(body, cuts)) == to_message(body, id="msg_s")


def test_event_sequence_of_thinking_text_and_a_tool_call():
    body = _body("Hi.", "Hm.", (("call_1", "clock", '{"tz": "UTC"}'),), "tool_calls", (5, 4))
    types = [(e["type"], e.get("delta", {}).get("type") or e.get("content_block", {}).get("type"))
             for e in _events(body, [])]
    assert types == [("message_start", None), ("ping", None),
                     ("content_block_start", "thinking"), ("content_block_delta", "thinking_delta"),
                     ("content_block_stop", None),
                     ("content_block_start", "text"), ("content_block_delta", "text_delta"), ("content_block_stop", None),
                     ("content_block_start", "tool_use"), ("content_block_delta", "input_json_delta"),
                     ("content_block_stop", None), ("message_delta", None), ("message_stop", None)]
    end = _events(body, [])[-2]
    assert end["delta"] == {"stop_reason": "tool_use", "stop_sequence": None} and end["usage"] == {"output_tokens": 4}


def test_a_stop_sequence_ends_the_stream_too():
    body = _body("a b")
    events = _events(body, [1], stop="END")
    assert _join(events) == to_message(body, "END", id="msg_s")
    assert _join(events)["stop_reason"] == "stop_sequence"


@pytest.mark.parametrize("status,kind,http", [(400, "invalid_request_error", 400), (401, "authentication_error", 401),
                                              (404, "not_found_error", 404), (413, "request_too_large", 413),
                                              (500, "api_error", 500), (503, "overloaded_error", 529)])
def test_error_shape(status, kind, http):
    from spark_cli.serve.anthropic import error_status

    assert error_body(status, "why") == {"type": "error", "error": {"type": kind, "message": "why"}}
    assert error_status(status) == http


# ---------------------------------------------------------------- the routes on a fake engine


def _sse(text: str) -> list[dict]:
    events = []
    for frame in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in frame.splitlines())
        ev = json.loads(lines["data"])
        assert lines["event"] == ev["type"]
        events.append(ev)
    return events


HDR = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
ASK = {"model": "claude-x", "max_tokens": 16, "messages": [{"role": "user", "content": "hi there"}]}


def test_messages_stream_and_count_tokens_on_the_fake_engine():
    with _client(api_key=KEY) as tc:
        r = tc.post("/v1/messages", json=ASK, headers=HDR)
        assert r.status_code == 200, r.text
        m = r.json()
        assert m["id"].startswith("msg_") and m["model"] == "claude-x" and m["role"] == "assistant"
        assert m["content"] == [{"type": "text", "text": "yes of course "}] and m["stop_reason"] == "end_turn"
        assert m["usage"]["output_tokens"] == 3
        # the same prompt on the OpenAI route: the same tokens counted
        o = tc.post("/v1/chat/completions", json={"messages": ASK["messages"]},
                    headers={"Authorization": f"Bearer {KEY}"}).json()
        assert o["usage"]["prompt_tokens"] == m["usage"]["input_tokens"] > 0
        s = tc.post("/v1/messages", json={**ASK, "stream": True}, headers=HDR)
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        joined = _join(_sse(s.text))
        assert {**joined, "id": m["id"]} == m
        n = tc.post("/v1/messages/count_tokens", json={"model": "x", "messages": ASK["messages"]}, headers=HDR)
        assert n.status_code == 200 and n.json() == {"input_tokens": m["usage"]["input_tokens"]}
        # a stop sequence: the earliest in the text wins, and is named
        r = tc.post("/v1/messages", json={**ASK, "stop_sequences": ["course", "of"]}, headers=HDR).json()
        assert (r["content"], r["stop_reason"], r["stop_sequence"]) == (
            [{"type": "text", "text": "yes "}], "stop_sequence", "of")
        r = tc.post("/v1/messages", json={**ASK, "max_tokens": 2}, headers=HDR).json()
        assert r["stop_reason"] == "max_tokens" and r["usage"]["output_tokens"] == 2


def test_keys_errors_and_paths_in_anthropic_shape():
    def shape(r, status: int, kind: str) -> None:
        assert r.status_code == status, r.text
        body = r.json()
        assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"], body

    with _client(api_key=KEY, max_body=4096) as tc:
        shape(tc.post("/v1/messages", json=ASK), 401, "authentication_error")
        shape(tc.post("/v1/messages", json=ASK, headers={"x-api-key": "wrong"}), 401, "authentication_error")
        assert tc.post("/v1/messages", json=ASK, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert tc.get("/v1/models", headers={"x-api-key": KEY}).status_code == 200
        # the OpenAI routes keep their shape
        assert tc.get("/v1/models").json()["error"]["type"] == "authentication_error"
        shape(tc.post("/v1/messages/nothing", json=ASK, headers=HDR), 404, "not_found_error")
        shape(tc.get("/v1/messages", headers=HDR), 405, "invalid_request_error")
        shape(tc.post("/v1/messages", json={**ASK, "max_tokens": None}, headers=HDR), 400, "invalid_request_error")
        r = tc.post("/v1/messages", json={k: v for k, v in ASK.items() if k != "max_tokens"}, headers=HDR)
        shape(r, 400, "invalid_request_error")
        assert "max_tokens" in r.json()["error"]["message"]
        shape(tc.post("/v1/messages", json={**ASK, "messages": [{"role": "user", "content": "word " * 2000}]},
                      headers=HDR), 413, "request_too_large")
        shape(tc.post("/v1/messages", json=ASK, headers={**HDR, "Host": "evil.example"}), 400, "invalid_request_error")
        shape(tc.post("/v1/messages", json=ASK, headers={**HDR, "Origin": "https://evil.example"}), 403,
              "permission_error")
        assert tc.post("/v1/messages", json=ASK, headers=HDR).json()["content"][0]["text"] == "yes of course "


def test_over_the_context_and_hostile_bodies_are_400():
    with _client() as tc:
        r = tc.post("/v1/messages", json={**ASK, "messages": [{"role": "user", "content": "w " * 300}]})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
        assert "context" in r.json()["error"]["message"]
        for case, body in BAD_BODIES.items():
            raw = body[:-1] + b', "max_tokens": 4}'
            r = tc.post("/v1/messages", content=raw, headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (case, r.text)
        assert tc.post("/v1/messages", json=ASK).status_code == 200


def test_what_claude_code_sends_besides_becomes_the_chat_it_means(caplog):
    """A system message inside messages stays where it is; output_config's effort and format
    reach the template and the grammar; metadata and context_management are accepted; a server
    tool is skipped with a warning."""
    c = _chat({"system": [{"type": "text", "text": "Top."}], "metadata": {"user_id": "u"},
               "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
               "output_config": {"effort": "high", "format": {"type": "json_schema", "schema": {"type": "object"}}},
               "thinking": {"type": "adaptive"},
               "tools": [{"name": "Read", "input_schema": {"type": "object"}},
                         {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}],
               "messages": [{"role": "user", "content": "Hi"},
                            {"role": "system", "content": [{"type": "text", "text": "Agents: a, b."}]}]})
    assert c["messages"] == [{"role": "system", "content": "Top."}, {"role": "user", "content": "Hi"},
                             {"role": "system", "content": "Agents: a, b."}]
    assert [t["function"]["name"] for t in c["tools"]] == ["Read"]
    assert c["reasoning_effort"] == "high" and c["chat_template_kwargs"] == {"enable_thinking": True}
    assert c["response_format"] == {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}
    assert [r.getMessage() for r in caplog.records] == [
        "tools.1: 'web_search' (web_search_20250305) skipped: spark serve runs no server tools"]
    with pytest.raises(ApiError, match=r"^tools.1.type: 'web_search_20250305' is a server tool"):
        _chat({"messages": [{"role": "user", "content": "Hi"}], "tool_choice": {"type": "tool", "name": "web_search"},
               "tools": [{"name": "Read", "input_schema": {"type": "object"}},
                         {"type": "web_search_20250305", "name": "web_search"}]})


def test_a_refusal_of_the_translated_request_names_the_messages_field():
    from spark_cli.serve.anthropic import anthropic_param

    req = _req({"system": "S", "tools": [{"type": "web_search_20250305", "name": "w"},
                                         {"name": "Read", "input_schema": {"type": "object"}}],
                "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                          {"type": "tool_result", "tool_use_id": "t"}]},
                             {"role": "system", "content": "mid"}]})
    assert anthropic_param("tools.0.function.parameters.properties.x", req) == "tools.1.input_schema.properties.x"
    assert anthropic_param("tools.0.function.name", req) == "tools.1.name"
    assert anthropic_param("messages.0.content", req) == "system"
    assert [anthropic_param(f"messages.{i}", req) for i in (1, 2, 3)] == ["messages.0", "messages.0", "messages.1"]
    assert anthropic_param("stop", req) == "stop_sequences"
    assert anthropic_param("response_format.json_schema", req) == "output_config.format.json_schema"
    assert anthropic_param("max_tokens", req) == "max_tokens"
