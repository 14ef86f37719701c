"""The agents' own CLIs against `spark serve` (issue 39), without npm: the request bodies Claude
Code 2.1.197 and Codex CLI 0.171.0 sent (recorded into tests/data/clients/ by a local recorder;
`scripts/test_clients` runs the CLIs themselves) replayed as they are. Each gets a 200 and a
well-formed answer or stream, with the tools rendered into the prompt: on the fake engine whole
(fast tier), and trimmed to a short prompt on the demo model (model tier).

What they carry: Claude Code a system message inside `messages` (after the user's), metadata,
thinking, context_management, output_config (effort, and a json_schema format for its title
request), a Read tool with `exclusiveMinimum`; Codex `include: ["reasoning.encrypted_content"]`,
`reasoning.summary`, a `namespace` tool and a `web_search` tool, store, prompt_cache_key,
client_metadata, and a function_call / function_call_output round trip.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_serve import KEY, _start, _stop, model, rpc  # noqa: F401 - fixtures
from test_serve_parity import _Engine

from _serve_client import fake_client

httpx = pytest.importorskip("httpx")

CLIENTS = Path(__file__).parent / "data" / "clients"
RECORDED = sorted(p.name for p in CLIENTS.glob("*.json"))
SENT_HEADERS = ("anthropic-beta", "anthropic-version", "user-agent", "x-app", "originator", "accept")


def recorded(name: str) -> dict:
    return json.loads((CLIENTS / name).read_text())


def sse_events(text: str) -> list[dict]:
    """The data of each server-sent event (each checked to name its type as `event:` says)."""
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        data = json.loads(lines["data"])
        assert lines.get("event", data["type"]) == data["type"], block
        out.append(data)
    return out


def check_anthropic(r: httpx.Response, stream: bool) -> list[dict]:
    """A well-formed Message (or its event stream); its content blocks."""
    assert r.status_code == 200, r.text
    if not stream:
        m = r.json()
        assert m["type"] == "message" and m["stop_reason"] in ("end_turn", "max_tokens", "tool_use", "stop_sequence")
        return m["content"]
    events = sse_events(r.text)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    starts = [e["index"] for e in events if e["type"] == "content_block_start"]
    assert starts == [e["index"] for e in events if e["type"] == "content_block_stop"] == list(range(len(starts)))
    assert events[-2]["delta"]["stop_reason"] in ("end_turn", "max_tokens", "tool_use", "stop_sequence")
    return [e["content_block"] for e in events if e["type"] == "content_block_start"]


def check_responses(r: httpx.Response, stream: bool) -> list[dict]:
    """A well-formed response (or its event stream); its output items."""
    assert r.status_code == 200, r.text
    if not stream:
        body = r.json()
        assert body["object"] == "response" and body["status"] == "completed"
        return body["output"]
    events = sse_events(r.text)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed", kinds
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    done = events[-1]["response"]["output"]
    assert [i["id"] for i in added] == [i["id"] for i in done]
    assert all(a["name"] == d["name"] for a, d in zip(added, done) if a["type"] == "function_call")
    return done


def replay(post, rec: dict, body: dict | None = None) -> list:
    """POST the recorded request (its body, or `body`) with the headers the client sent; the
    answer's content blocks or output items, checked well-formed."""
    body = rec["body"] if body is None else body
    headers = {k: v for k, v in rec["headers"].items() if k in SENT_HEADERS}
    r = post(rec["path"], json=body, headers={**headers, "x-api-key": KEY, "Authorization": f"Bearer {KEY}"})
    check = check_anthropic if rec["path"].startswith("/v1/messages") else check_responses
    return check(r, bool(body.get("stream")))


def tool_names(body: dict) -> set[str]:
    """The function tools a recorded body gives the model (server and hosted tools are skipped)."""
    return {t["name"] for t in body.get("tools") or () if t.get("type") in (None, "custom", "function")}


# ---------------------------------------------------------------- whole bodies, fake engine


class _Recording(_Engine):
    """Remembers the tools each prompt was rendered with."""

    rendered: list[list[str]] = []

    def chat_prompt(self, messages, add_generation_prompt=True, tools=None, extras=None):
        _Recording.rendered.append(sorted(t["function"]["name"] for t in tools or ()))
        return super().chat_prompt(messages, add_generation_prompt, tools, extras)


def test_the_recordings_carry_what_the_issue_describes():
    cc, codex = recorded("claude-code-2.1.197-plain.json")["body"], recorded("codex-0.171.0-plain.json")["body"]
    assert [m["role"] for m in cc["messages"]] == ["user", "system"]
    assert {"metadata", "thinking", "context_management", "output_config"} <= cc.keys()
    read = next(t for t in cc["tools"] if t["name"] == "Read")["input_schema"]["properties"]
    assert read["limit"]["exclusiveMinimum"] == 0
    assert codex["include"] == ["reasoning.encrypted_content"] and codex["reasoning"] == {"summary": "auto"}
    assert {t["type"] for t in codex["tools"]} == {"function", "namespace", "web_search"}
    turn2 = recorded("codex-0.171.0-tool-result.json")["body"]["input"]
    assert [i.get("type") for i in turn2[-2:]] == ["function_call", "function_call_output"]


@pytest.mark.parametrize("name", RECORDED)
def test_a_recorded_request_is_answered_whole(name):
    rec = recorded(name)
    _Recording.rendered = []
    with fake_client(lambda: _Recording(n_ctx=1 << 16), api_key=KEY) as tc:
        replay(tc.post, rec)
        replay(tc.post, rec, {**rec["body"], "stream": not rec["body"].get("stream", False)})
    assert _Recording.rendered == [sorted(tool_names(rec["body"]))] * 2


# ---------------------------------------------------------------- trimmed bodies, demo model

KEPT_TOOLS = {"Read", "Bash", "exec_command"}  # with the skipped namespace and web_search tools
TEXT = 160  # characters kept of each text


def _short(text: str) -> str:
    return text[:TEXT]


def _trim_content(content):
    if isinstance(content, str):
        return _short(content)
    return [{**p, **{k: _short(p[k]) for k in ("text", "content") if isinstance(p.get(k), str)},
             **({"content": _trim_content(p["content"])} if isinstance(p.get("content"), list) else {})}
            for p in content]


def trimmed(body: dict) -> dict:
    """The same request with a prompt the demo model reads in seconds: texts cut short, the
    function tools but Read / Bash / exec_command dropped (their schemas kept whole; the other
    tools kept, being skipped by the server), few tokens to generate."""
    out = dict(body)
    tools = [t for t in body.get("tools") or () if t.get("name") in KEPT_TOOLS
             or t.get("type") not in (None, "custom", "function")]
    out["tools"] = [{**t, "description": _short(t.get("description", ""))} if "description" in t else t
                    for t in tools]
    if isinstance(body.get("system"), list):
        out["system"] = [{**b, "text": _short(b["text"])} for b in body["system"]]
    if "messages" in body:
        out["messages"] = [{**m, "content": _trim_content(m["content"])} for m in body["messages"]]
        out["max_tokens"] = 12
    else:
        out["input"] = [{**i, **({"content": _trim_content(i["content"])} if "content" in i else {}),
                         **({"output": _short(i["output"])} if isinstance(i.get("output"), str) else {})}
                        for i in body["input"]]
        out["max_output_tokens"] = 12
    return {k: v for k, v in out.items() if k != "tools" or v}


@pytest.fixture(scope="module")
def server(model, rpc, tmp_path_factory):  # noqa: F811 - test_serve's fixtures
    srv = _start(model, rpc, tmp_path_factory.mktemp("clients"), "--api-key", KEY, "--learn-every", "0",
                 "--no-learn", "-c", "2048")
    yield srv
    _stop(srv)


@pytest.mark.model
@pytest.mark.parametrize("name", [n for n in RECORDED if tool_names(recorded(n)["body"])])
def test_a_recorded_request_trimmed_is_answered_by_the_demo_model(server, name):
    rec = recorded(name)
    body = trimmed(rec["body"])
    assert tool_names(body) and tool_names(body) <= KEPT_TOOLS
    with server.http() as h:
        items = replay(h.post, rec, body)
        counted = "/v1/messages/count_tokens" if "messages" in body else "/v1/responses/input_tokens"
        with_tools = h.post(counted, json=body).json()["input_tokens"]
        without = h.post(counted, json={**body, "tools": []}).json()["input_tokens"]
    assert items and with_tools > without  # an answer, and the tools were in the prompt
