"""JSON Schema for forced grammars (issue 39): integer bounds as digit grammars (every integer in
a span checked against the grammar, read as a regular expression), a number's nearest
expressible range, keywords the grammar cannot express relaxed (and checked after), a 400 only
for what is not JSON Schema, and the recorded clients' tool schemas all convert."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from spark_cli.core.json_schema import (MAX_DIGITS, Bound, EmptyRange, bounds, integer_gbnf, integer_range, invalid,
                                        number_gbnf, relax, violation)
from spark_cli.core.tool_calls import HERMES
from spark_cli.native.grammar import GrammarError, json_schema_gbnf, tool_call_gbnf

CLIENTS = Path(__file__).parent / "data" / "clients"


def as_regex(expr: str) -> re.Pattern:
    """A GBNF expression of literals, classes, groups, alternatives and repetitions as a regex."""
    out, i = [], 0
    while i < len(expr):
        if expr[i] == '"':
            j = expr.index('"', i + 1)
            out.append(re.escape(expr[i + 1:j]))
            i = j + 1
        else:
            out.append("" if expr[i] == " " else expr[i])
            i += 1
    return re.compile("(?:" + "".join(out) + r")\Z")


def _admits(low: int | None, high: int | None, n: int) -> bool:
    return (low is None or n >= low) and (high is None or n <= high) and abs(n) < 10 ** MAX_DIGITS


SPANS = [(0, None), (1, None), (None, 0), (None, -1), (-7, 7), (-1000, -3), (5, 1234), (17, 17), (-5, None),
         (None, 42), (100, 999), (99, 1000), (0, 0), (-1, -1), (123, 987), (0, 9007199254740991)]


@pytest.mark.parametrize("low,high", SPANS + [tuple(sorted(random.Random(i).randint(-1300, 1300) for _ in "ab"))
                                              for i in range(40)])
def test_an_integer_range_admits_exactly_its_integers(low, high):
    rx = as_regex(integer_gbnf(low, high))
    edges = [x + d for x in (low, high) if x is not None for d in (-1, 0, 1)]
    for n in [*range(-1300, 1300), *edges, 10 ** 15, -10 ** 15, 10 ** 16]:
        assert bool(rx.match(str(n))) == _admits(low, high, n), (low, high, n)
    for numeral in ("-0", "01", "00", "-01", "", "1.0", "1e3"):  # JSON integers only
        assert not rx.match(numeral), numeral


def test_bounds_read_every_spelling():
    assert integer_range(*bounds({"exclusiveMinimum": 0, "maximum": 9007199254740991})) == (1, 9007199254740991)
    assert integer_range(*bounds({"minimum": 2.5, "exclusiveMaximum": 10})) == (3, 9)
    assert integer_range(*bounds({"minimum": 3, "exclusiveMinimum": 3})) == (4, None)  # the tighter
    assert integer_range(*bounds({"minimum": 3, "exclusiveMinimum": True})) == (4, None)  # draft 4
    with pytest.raises(EmptyRange):
        integer_gbnf(*integer_range(*bounds({"exclusiveMinimum": 1, "exclusiveMaximum": 2})))


@pytest.mark.parametrize("schema", [{"minimum": 0}, {"exclusiveMinimum": 0}, {"minimum": 1.5, "maximum": 20},
                                    {"minimum": -2.5, "exclusiveMaximum": 3}, {"maximum": -4},
                                    {"minimum": -100, "maximum": -0.5}])
def test_a_numbers_grammar_admits_every_value_in_range_and_is_near_it(schema):
    lo, hi = bounds(schema)
    rx = as_regex(number_gbnf(lo, hi))
    values = [v / 4 for v in range(-500, 500)]
    inside = [v for v in values if violation(v, {"type": "number", **schema}) is None]
    assert inside and all(rx.match(repr(v)) for v in inside), schema
    # outside: only values within one of an integral bound get through (the check after catches them)
    for v in values:
        if rx.match(repr(v)) and v not in inside:
            assert any(abs(v - b.value) < 1 for b in (lo, hi) if b is not None), (schema, v)
    assert not rx.match("1e3")


def test_relax_drops_what_the_grammar_cannot_express_and_keeps_the_rest():
    schema = {"type": "object", "properties": {
        "n": {"type": "integer", "multipleOf": 3, "minimum": 1, "description": "d"},
        "tags": {"type": "array", "uniqueItems": True, "items": {"type": "string", "maxLength": 1000000}},
        "x": {"not": {"type": "null"}}}, "required": ["n"], "patternProperties": {"^a": {}}}
    assert relax(schema) == {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 1, "description": "d"},
        "tags": {"type": "array", "items": {"type": "string"}}, "x": {}}, "required": ["n"]}


def test_only_a_schema_that_is_not_json_schema_is_refused():
    assert invalid({"type": "object", "properties": {"n": {"type": "integer", "exclusiveMinimum": 0}}}) is None
    assert invalid({"type": "integer", "multipleOf": 3, "uniqueItems": True, "if": {}, "then": {}}) is None
    assert invalid({"type": "integer", "minimum": "x"}) == "not valid JSON Schema: 'x' is not of type 'number' " \
                                                         "(at minimum)"
    assert "not valid JSON Schema" in invalid({"type": "wat"})
    with pytest.raises(GrammarError, match=r"^response_format.json_schema.schema: not valid JSON Schema"):
        json_schema_gbnf({"type": "object", "required": "a"})
    # still converted: a keyword the grammar cannot express is checked after generation
    assert "root ::=" in json_schema_gbnf({"type": "object", "properties": {"n": {"type": "number", "multipleOf": 2}}})


def test_a_list_of_items_is_draft_7s_tuple_as_llama_servers():
    # llama-server's converter reads it (its suite: response_format {"items": [{"type": "integer"}]})
    tup = {"items": [{"type": "integer"}, {"type": "string", "maxLength": 1000000}]}
    assert invalid(tup) is None
    assert relax(tup) == {"items": [{"type": "integer"}, {"type": "string"}]}
    assert violation([1, "a"], tup) is None and violation(["a", "b"], tup) == "0: 'a' is not of type 'integer'"
    g = json_schema_gbnf({"items": [{"type": "integer"}, {"type": "integer"}]})
    assert 'root ::= "[" space integer "," space integer "]" space' in g.splitlines()  # exactly two
    # a schema that names 2020-12 is read as 2020-12, where items is one schema
    assert "not valid JSON Schema" in invalid({"$schema": "https://json-schema.org/draft/2020-12/schema", **tup})


def test_violation_names_where():
    schema = {"type": "object", "properties": {"limit": {"type": "integer", "exclusiveMinimum": 0}}}
    assert violation({"limit": 3}, schema) is None
    assert violation({"limit": 0}, schema) == "limit: 0 is less than or equal to the minimum of 0"


def test_the_bounded_integers_are_rules_of_the_grammar():
    g = json_schema_gbnf({"type": "object", "properties": {"limit": {"type": "integer", "exclusiveMinimum": 0,
                                                                     "maximum": 50}}, "required": ["limit"]})
    rule = next(line for line in g.splitlines() if line.startswith("limit ::="))
    expr = rule.removeprefix("limit ::= ").removesuffix(" space")
    assert [n for n in range(-60, 60) if as_regex(expr).match(str(n))] == list(range(1, 51))
    # a list of types keeps the bounds on its integer member; {} and annotations only are any value
    g = json_schema_gbnf({"type": ["integer", "null"], "minimum": 3, "maximum": 12})
    assert "root ::= integer- | null" in g and 'integer- ::= ([3-9] | ("1" [0-2])) space' in g
    assert "root ::= value" in json_schema_gbnf({"description": "anything"})


def _function_tools(path: Path) -> list[dict]:
    body = json.loads(path.read_text())["body"]
    return [{"type": "function", "function": {"name": t["name"], "parameters": t.get("input_schema",
                                                                                   t.get("parameters"))}}
            for t in body.get("tools") or () if t.get("type", "function") in ("function", "custom")]


@pytest.mark.parametrize("name", sorted(p.name for p in CLIENTS.glob("*.json") if _function_tools(p)))
def test_every_recorded_clients_tools_convert_to_a_small_grammar(name):
    tools = _function_tools(CLIENTS / name)
    grammar = tool_call_gbnf(HERMES, list(enumerate(tools)))
    assert len(grammar) < 100_000 and grammar.count("root ::=") == 1
