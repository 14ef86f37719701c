"""Hostile grammars, schemas and templates (round three): bounds before llama.cpp parses or
jinja renders, no grammar that stalls the sampler, and a server that stops on SIGTERM."""

from __future__ import annotations

import json
import resource
import signal
import threading
import time
from pathlib import Path

import pytest

from test_serve_hostile import served  # noqa: F401 - a fixture

from spark_cli.core import gbnf
from spark_cli.core.chat_template import ChatTemplate, TemplateError
from spark_cli.core.tool_calls import HERMES
from spark_cli.native.grammar import GrammarError, json_schema_gbnf, tool_call_gbnf

httpx = pytest.importorskip("httpx")

CLIENTS = Path(__file__).parent / "data" / "clients"
DEEP = "root ::= " + "(" * 20000 + '"a"' + ")" * 20000
OPTIONALS = "root ::= " + " ".join(["[a-b]?"] * 200)
HELLO = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant"
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}" + HELLO
HUGE = "{% for i in range(100000) %}{{ 'x' * 500 }}{% endfor %}" + HELLO


# ---------------------------------------------------------------- the checks themselves

@pytest.mark.parametrize("text, words", [
    (DEEP, "nested 20000 deep"),
    ("\x00\x01", "NUL"),
    ('root ::= "a"\x00 ((((', "NUL"),
    (OPTIONALS, "--grammar-max-width"),
    ("root ::= " + " ".join(["[^x]?"] * 9), "--grammar-max-width"),  # wide: each counts 2
    ("root ::= " + " ".join(['" "?'] * 17), "--grammar-max-width"),  # vocabularies hold long runs of spaces
    ("root ::= r r r r r\nr ::= [a-b]? [a-b]? [a-b]? [a-b]?", "--grammar-max-width"),  # through rules
    ("root ::= " + "x" * 300_000, "over the limit"),
    ('root ::= "a" (', "expecting"),
    ("root ::= undefined-rule", "undefined rule"),
    ('item ::= "a"', "no rule named root"),
    ('root ::= x "a" | "a"\nx ::= "b"? root', "left recursion"),
])
def test_a_grammar_past_a_bound_or_broken_is_refused_before_llama_cpp(text, words):
    t0 = time.monotonic()
    with pytest.raises(GrammarError, match=words):
        gbnf.check(text)
    assert time.monotonic() - t0 < 1.0


@pytest.mark.parametrize("text", [
    "root ::= " + " ".join(["[a-b]?"] * 16),
    "root ::= [a-z]{0,300}",                          # llama.cpp nests x{0,n}: one position
    "root ::= " + "( [a-b] " * 40 + ")?" * 40,        # nested optionals
    "root ::= " + " ".join(['"hello"?'] * 80),        # a token rarely spans two of them
    "root ::= " + " | ".join(f'"x{i}"' for i in range(2000)),
])
def test_grammars_that_stay_cheap_pass(text):
    gbnf.check(text)


def test_the_width_counts_what_a_run_opens():
    def w(text: str) -> int:
        return gbnf.width(gbnf.parse(text), 1000)
    assert w(OPTIONALS) == 200
    assert w("root ::= " + " ".join(["[^x]?"] * 8)) == 16
    assert w("root ::= r r r\nr ::= [a-b]? [a-b]?") == 6
    assert w("root ::= [a-b]{0,300}") == 1


def test_schemas_and_the_agents_tools_make_grammars_within_the_bounds():
    objects = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(200)}}
    gbnf.check(json_schema_gbnf(objects))
    checked = 0
    for path in sorted(CLIENTS.glob("*.json")):
        tools = json.loads(path.read_text())["body"].get("tools") or []
        fns = [(i, {"function": {"name": t["name"], "parameters": t.get("input_schema") or t.get("parameters")}})
               for i, t in enumerate(tools) if t.get("name") and (t.get("input_schema") or t.get("parameters"))]
        if fns:
            gbnf.check(tool_call_gbnf(HERMES, fns))  # the agents' recorded tools still pass
            checked += len(fns)
    assert checked > 10


def test_a_deep_pattern_is_refused_by_name_not_by_recursion():
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": "(" * 5000 + "a" + ")" * 5000}}}
    with pytest.raises(GrammarError, match=r"properties\.code\.pattern: groups nested 5000 deep"):
        json_schema_gbnf(schema, "json_schema")


def test_a_pattern_of_optionals_is_refused_as_its_grammar():
    with pytest.raises(GrammarError, match="its grammar.*--grammar-max-width"):
        json_schema_gbnf({"type": "string", "pattern": "^" + "a?" * 100 + "$"})


# ---------------------------------------------------------------- templates

@pytest.mark.parametrize("source, words, seconds", [
    (LOOP, "took longer than", 8.0),
    (HUGE, "exceeds the available context size", 1.0),
    ("{{ 'x' * 10**10 }}", "exceeds the available context size", 1.0),
    ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
     "exceeds the available context size", 1.0),
    ("{{ 'x'.ljust(10**10) }}{{ 'x'|center(10**10) }}", "exceeds the available context size", 1.0),
])
def test_a_template_render_is_bounded_in_time_and_size(source, words, seconds):
    """The same code renders a GGUF's template (tokenizer.chat_template) and a file's."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    with pytest.raises(TemplateError, match=words):
        ChatTemplate(source, "tokenizer.chat_template").render([{"role": "user", "content": "hi"}])
    assert time.monotonic() - t0 < seconds
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 * 1024  # KiB: under 200 MiB more


def test_a_normal_template_renders_as_before():
    text = ChatTemplate(HELLO).render([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant"  # jinja drops a last newline


# ---------------------------------------------------------------- the server

def _post(port: int, body: dict, path: str = "/completion", timeout: float = 60) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{port}{path}", json=body, timeout=timeout)


@pytest.mark.model
def test_hostile_grammars_get_a_400_and_the_server_keeps_serving(served):  # noqa: F811 - the fixture
    port, log = served("-np", "2")
    size = log.stat().st_size
    cases = {"deep": DEEP, "optionals": OPTIONALS, "nul": "\x00\x01", "nul-cut": 'root ::= "a"\x00 ((((',
             "broken": 'root ::= "a" (' + "x" * 200_000}
    answers: dict[str, httpx.Response] = {}
    other: list[httpx.Response] = []
    beside = threading.Thread(target=lambda: other.append(_post(port, {"prompt": "hi", "n_predict": 2})))
    beside.start()
    for name, grammar in cases.items():
        t0 = time.monotonic()
        answers[name] = _post(port, {"prompt": "hi", "n_predict": 1, "grammar": grammar})
        assert time.monotonic() - t0 < 5, name
    beside.join(60)
    for name, r in answers.items():
        assert r.status_code == 400, (name, r.text)
        assert r.json()["error"]["message"].startswith("grammar: "), (name, r.text)
    schema = {"type": "string", "pattern": "(" * 5000 + "a" + ")" * 5000}
    r = _post(port, {"prompt": "hi", "n_predict": 1, "json_schema": schema})
    assert r.status_code == 400 and "nested 5000 deep" in r.text, r.text
    assert other and other[0].status_code == 200, other
    assert _post(port, {"prompt": "hi", "n_predict": 1}).status_code == 200
    assert log.stat().st_size - size < 8192, log.read_text()[-2000:]  # no grammar written whole to the log


@pytest.mark.model
def test_sigterm_ends_a_server_stuck_in_a_slow_grammar(served, tmp_path):  # noqa: F811
    # NOTE: a raised width lets a grammar through that takes seconds a token (60 narrow optionals)
    port, log = served("--grammar-max-width", "200")
    proc = next(p for p in _procs(served))
    slow = "root ::= " + " ".join(["[a-b]?"] * 60)
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(_try_post(port, {"prompt": "hi", "n_predict": 20,
                                                                     "grammar": slow})))
    t.start()
    time.sleep(2.0)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=15)
    assert time.monotonic() - t0 < 10, log.read_text()[-2000:]
    assert "Traceback" not in log.read_text()
    t.join(30)


def _procs(fixture):
    # the `served` fixture keeps its processes in its closure
    cells = [c.cell_contents for c in fixture.__closure__ or () if isinstance(c.cell_contents, list)]
    return cells[0]


def _try_post(port: int, body: dict) -> int:
    try:
        return _post(port, body, timeout=30).status_code
    except httpx.TransportError:
        return -1


@pytest.mark.model
def test_a_template_file_that_loops_is_an_error_and_health_answers_meanwhile(served, tmp_path):  # noqa: F811
    loop = tmp_path / "loop.jinja"
    loop.write_text(LOOP)
    port, log = served("--chat-template-file", str(loop))
    got: list[httpx.Response] = []
    t = threading.Thread(target=lambda: got.append(_post(port, {"messages": [{"role": "user", "content": "hi"}],
                                                                "max_tokens": 1}, "/v1/chat/completions")))
    t.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    assert time.monotonic() - t0 < 1.0
    t.join(60)
    assert got and 400 <= got[0].status_code < 600 and "took longer than" in got[0].text, got
    assert "Traceback" not in log.read_text()
