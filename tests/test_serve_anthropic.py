"""`spark serve`'s Anthropic Messages API driven by the official `anthropic` client, on the RPC
stand-in: answers equal the OpenAI endpoint's (greedy), the event sequence, count_tokens, keys,
bad requests, one queue shared with OpenAI clients, cancellation, tool use (forced by a grammar,
streamed, a tool_result round trip), thinking blocks, and the counts folded on exit."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import pytest

from test_agents import WEATHER_SCHEMA, validate
from test_serve import KEY, N_PREDICT, PROMPTS, _start, _stop, model, rpc  # noqa: F401 - fixtures

from spark_cli.core.gguf_info import load_geometry
from spark_cli.core.profile import RoutingProfile, profile_path_for
from spark_cli.native.rpc import RpcServer

anthropic = pytest.importorskip("anthropic")
httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.model

GREEDY = {"temperature": 0}  # NOTE: anthropic 2.x has no temperature argument; the server takes it
COUNT_UP = "Count from 1 to 100: 1, 2, 3, 4, 5,"  # the demo model keeps counting: a long answer
WEATHER = {"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER_SCHEMA}
CLOCK = {"name": "get_time", "input_schema": {"type": "object", "properties": {"zone": {"type": "string"}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
FORCED = {"type": "tool", "name": "get_weather"}
N_TOOL = 80  # tokens at most for a forced call (the grammar ends it sooner)
TEMPLATES = Path(__file__).resolve().parents[1] / "spark_cli" / "data" / "templates"


@pytest.fixture(scope="module")
def server(model, rpc):  # noqa: F811 - test_serve's fixtures
    srv = _start(model, rpc, model.parent, "--api-key", KEY, "--queue", "8", "--learn-every", "0")
    yield srv
    _stop(srv)


def _client(server, key: str | None = KEY, **kw) -> "anthropic.Anthropic":
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=300, **kw)


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _openai(server, prompt: str, max_tokens: int = N_PREDICT):
    r = server.client().chat.completions.create(model="x", messages=_user(prompt), temperature=0,
                                                max_tokens=max_tokens)
    return r.choices[0].message.content, r.choices[0].finish_reason, r.usage


def test_message_stream_and_count_tokens(server):
    ac = _client(server)
    text, finish, usage = _openai(server, PROMPTS[0])
    t0 = time.perf_counter()
    m = ac.messages.create(model="claude-test", max_tokens=N_PREDICT, messages=_user(PROMPTS[0]), extra_body=GREEDY)
    wall = time.perf_counter() - t0
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == "claude-test"
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == text
    assert (m.usage.input_tokens, m.usage.output_tokens) == (usage.prompt_tokens, usage.completion_tokens)
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[finish] and m.stop_sequence is None
    print(f"\nanthropic round trip: {m.usage.output_tokens} tokens in {wall:.2f} s")

    events = list(ac.messages.create(model="claude-test", max_tokens=N_PREDICT, messages=_user(PROMPTS[0]),
                                     stream=True, extra_body=GREEDY))
    kinds = [e.type for e in events if e.type != "ping"]
    n = len(kinds) - 5
    assert kinds == ["message_start", "content_block_start", *["content_block_delta"] * n, "content_block_stop",
                     "message_delta", "message_stop"] and n > 1
    assert events[0].message.usage.input_tokens == m.usage.input_tokens
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == text
    assert events[-2].delta.stop_reason == m.stop_reason and events[-2].usage.output_tokens == m.usage.output_tokens

    with ac.messages.stream(model="claude-test", max_tokens=N_PREDICT, messages=_user(PROMPTS[0]),
                            extra_body=GREEDY) as s:
        final = s.get_final_message()
    assert final.model_dump(exclude={"id"}) == m.model_dump(exclude={"id"})

    system = "Answer in one word."
    counted = ac.messages.count_tokens(model="claude-test", messages=_user(PROMPTS[1]), system=system)
    s = ac.messages.create(model="claude-test", max_tokens=2, messages=_user(PROMPTS[1]), system=system,
                           extra_body=GREEDY)
    # NOTE: not against no system at all: the demo model's template then writes a longer default one
    assert counted.input_tokens == s.usage.input_tokens > ac.messages.count_tokens(
        model="claude-test", messages=_user(PROMPTS[1]), system="Answer.").input_tokens


def test_stop_sequence_cuts_and_is_named(server):
    ac = _client(server)
    full = ac.messages.create(model="x", max_tokens=12, messages=_user(COUNT_UP), extra_body=GREEDY).content[0].text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    assert len(full) > 6 and stop.strip(), full
    m = ac.messages.create(model="x", max_tokens=12, messages=_user(COUNT_UP), stop_sequences=[stop, "zzz"],
                           extra_body=GREEDY)
    assert m.content[0].text == full[:full.find(stop)]
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    with ac.messages.stream(model="x", max_tokens=12, messages=_user(COUNT_UP), stop_sequences=[stop],
                            extra_body=GREEDY) as s:
        final = s.get_final_message()
    assert (final.content[0].text, final.stop_reason, final.stop_sequence) == (m.content[0].text, "stop_sequence", stop)


def test_keys_and_bad_requests(server):
    assert _client(server, key=None, auth_token=KEY).messages.create(  # Authorization: Bearer
        model="x", max_tokens=1, messages=_user("Hi")).usage.output_tokens == 1
    with pytest.raises(anthropic.AuthenticationError) as e:
        _client(server, key="wrong").messages.create(model="x", max_tokens=1, messages=_user("Hi"))
    assert e.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(server.url + "/v1/messages", json={"model": "x", "max_tokens": 1, "messages": _user("Hi")})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    ac = _client(server)
    with pytest.raises(anthropic.BadRequestError, match="temperature"):
        ac.messages.create(model="x", max_tokens=4, messages=_user("Hi"), extra_body={"temperature": 3})
    with pytest.raises(anthropic.BadRequestError, match="messages.0.role"):
        ac.messages.create(model="x", max_tokens=4, messages=[{"role": "tool", "content": "Hi"}])
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        ac.post("/v1/messages", cast_to=object, body={"model": "x", "messages": _user("Hi")})
    with pytest.raises(anthropic.NotFoundError):
        ac.post("/v1/messages/nothing", cast_to=object, body={})
    with pytest.raises(anthropic.BadRequestError, match="context"):
        ac.messages.create(model="x", max_tokens=4, messages=_user("word " * 1500))
    assert ac.messages.create(model="x", max_tokens=2, messages=_user("Hi")).usage.output_tokens == 2


def test_openai_and_anthropic_clients_share_one_queue(server):
    refs = {p: _openai(server, p) for p in PROMPTS}
    before = server.metrics()
    results: list[tuple[str, str, int]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def openai_client(i: int) -> None:
        try:
            for j in range(2):
                p = PROMPTS[(i + j) % 2]
                text, _, usage = _openai(server, p)
                with lock:
                    results.append((p, text, usage.completion_tokens))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def anthropic_client(i: int) -> None:
        ac = _client(server)
        try:
            for j in range(2):
                p = PROMPTS[(i + j) % 2]
                if j % 2:
                    with ac.messages.stream(model="x", max_tokens=N_PREDICT, messages=_user(p), extra_body=GREEDY) as s:
                        m = s.get_final_message()
                else:
                    m = ac.messages.create(model="x", max_tokens=N_PREDICT, messages=_user(p), extra_body=GREEDY)
                with lock:
                    results.append((p, m.content[0].text, m.usage.output_tokens))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=f, args=(i,)) for i in range(3) for f in (openai_client, anthropic_client)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    assert len(results) == 12
    for p, text, n in results:
        assert (text, n) == (refs[p][0], refs[p][2].completion_tokens), p
    after = server.metrics()
    assert after["spark:requests_total"] - before["spark:requests_total"] == 12
    assert after["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"] == sum(
        n for *_, n in results)


def test_disconnect_cancels_then_next_is_served(server):
    ac = _client(server)
    before = server.metrics()["llamacpp:tokens_predicted_total"]
    with ac.messages.create(model="x", max_tokens=150, messages=_user(COUNT_UP), stream=True,
                            extra_body=GREEDY) as stream:
        for i, _ in enumerate(stream):
            if i == 5:
                break  # leaving the block closes the connection
    m = ac.messages.create(model="x", max_tokens=3, messages=_user(COUNT_UP), extra_body=GREEDY)
    assert m.usage.output_tokens == 3 and m.stop_reason == "max_tokens"
    cancelled = server.metrics()["llamacpp:tokens_predicted_total"] - before - 3
    assert 2 <= cancelled < 75, cancelled  # stopped soon after the client left, far from 150


def _tool_use(m) -> "anthropic.types.ToolUseBlock":
    assert m.stop_reason == "tool_use", m
    calls = [b for b in m.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].id.startswith("toolu_"), m.content
    assert validate(calls[0].input, WEATHER_SCHEMA) == [], calls[0].input
    return calls[0]


def test_forced_tool_use_streamed_and_not(server):
    ac = _client(server)
    kw = dict(model="x", max_tokens=N_TOOL, messages=ASK, tools=[WEATHER, CLOCK], tool_choice=FORCED,
              extra_body=GREEDY)
    call = _tool_use(ac.messages.create(**kw))
    events = list(ac.messages.create(**kw, stream=True))
    starts = [e for e in events if e.type == "content_block_start" and e.content_block.type == "tool_use"]
    assert len(starts) == 1 and starts[0].content_block.name == "get_weather"
    joined = "".join(e.delta.partial_json for e in events
                     if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    assert json.loads(joined) == call.input
    assert [e.delta.stop_reason for e in events if e.type == "message_delta"] == ["tool_use"]
    with ac.messages.stream(**kw) as s:
        assert _tool_use(s.get_final_message()).input == call.input
    # the counted prompt is the generated one: tools rendered into both
    counted = ac.messages.count_tokens(model="x", messages=ASK, tools=[WEATHER, CLOCK], tool_choice=FORCED)
    assert counted.input_tokens == ac.messages.create(**kw).usage.input_tokens
    assert counted.input_tokens > ac.messages.count_tokens(model="x", messages=ASK).input_tokens


def test_any_tool_choice_calls_one_of_the_tools(server):
    m = _client(server).messages.create(model="x", max_tokens=N_TOOL, messages=ASK, tools=[WEATHER, CLOCK],
                                        tool_choice={"type": "any"}, extra_body=GREEDY)
    assert m.stop_reason == "tool_use" and [b.name for b in m.content if b.type == "tool_use"][0] in (
        "get_weather", "get_time")
    odd = {"name": "f", "input_schema": {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 0}}}}
    with pytest.raises(anthropic.BadRequestError) as e:  # not JSON Schema: named by Anthropic's path
        _client(server).messages.create(model="x", max_tokens=4, messages=ASK, tools=[WEATHER, odd],
                                        tool_choice={"type": "any"})
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert e.value.body["error"]["message"].startswith("tools.1.input_schema: not valid JSON Schema: 0 is less "
                                                       "than or equal to the minimum of 0 (at properties.n.multipleOf)")


def test_tool_result_round_trip(server):
    ac = _client(server)
    t0 = time.perf_counter()
    first = ac.messages.create(model="x", max_tokens=N_TOOL, messages=ASK, tools=[WEATHER], tool_choice=FORCED,
                               extra_body=GREEDY)
    call = _tool_use(first)
    t1 = time.perf_counter()
    history = ASK + [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                   "content": "18 degrees and sunny"}]}]
    second = ac.messages.create(model="x", max_tokens=8, messages=history, tools=[WEATHER],
                                tool_choice={"type": "none"}, extra_body=GREEDY)
    t2 = time.perf_counter()
    assert second.stop_reason in ("end_turn", "max_tokens") and second.content[0].type == "text"
    assert second.content[0].text and not [b for b in second.content if b.type == "tool_use"]
    counted = ac.messages.count_tokens(model="x", messages=history, tools=[WEATHER], tool_choice={"type": "none"})
    assert counted.input_tokens == second.usage.input_tokens  # tool_choice none: rendered without the tools
    print(f"\nforced tool use: {first.usage.output_tokens} tokens in {t1 - t0:.1f} s; the answer to its "
          f"tool_result: {second.usage.output_tokens} tokens in {t2 - t1:.1f} s; round trip {t2 - t0:.1f} s")


@pytest.fixture(scope="module")
def thinking_server(model, tmp_path_factory):  # noqa: F811 - test_serve's fixture
    """The demo model with a thinking template (Qwen3.6's: the answer starts inside <think>)."""
    srv_rpc = RpcServer(threads=1).start()
    srv = _start(model, srv_rpc, tmp_path_factory.mktemp("thinking"), "--api-key", KEY, "--learn-every", "0",
                 "--no-learn", "--chat-template-file", str(TEMPLATES / "qwen3.6.jinja"))
    yield srv
    _stop(srv)
    srv_rpc.stop()


def test_thinking_blocks(thinking_server):
    ac = _client(thinking_server)
    kw = dict(model="x", max_tokens=N_PREDICT, messages=_user(PROMPTS[0]), extra_body=GREEDY)
    m = ac.messages.create(**kw, thinking={"type": "enabled", "budget_tokens": 1024})
    assert m.content[0].type == "thinking" and m.content[0].thinking, m.content
    events = list(ac.messages.create(**kw, thinking={"type": "enabled", "budget_tokens": 1024}, stream=True))
    assert [e.content_block.type for e in events if e.type == "content_block_start"][0] == "thinking"
    streamed = "".join(e.delta.thinking for e in events
                       if e.type == "content_block_delta" and e.delta.type == "thinking_delta")
    assert streamed == m.content[0].thinking
    off = ac.messages.create(**kw, thinking={"type": "disabled"})  # the template closes <think> itself
    assert [b.type for b in off.content] == ["text"], off.content


def test_sigterm_folds_the_counts_of_anthropic_requests(server):
    """Last: it stops the module's server."""
    ac = _client(server)
    ac.messages.create(model="x", max_tokens=4, messages=_user(PROMPTS[1]), extra_body=GREEDY)
    served = server.metrics()["llamacpp:tokens_predicted_total"]
    assert not profile_path_for(server.model).exists()  # --learn-every 0: nothing folded before exit
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=60) == 0, server.log.read_text()
    g = load_geometry(server.model)
    prof = RoutingProfile.load(profile_path_for(server.model))
    assert prof.tokens_decode == served and prof.sources == ["spark serve"]
    assert prof.decode.sum() == served * g.n_expert_used * len(g.moe_layers)
