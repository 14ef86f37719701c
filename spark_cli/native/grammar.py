"""GBNF grammars that constrain sampling: JSON Schema answers and forced tool calls.

llama-cpp-python's `SchemaConverter` writes the JSON rules, with Spark's numeric bounds
(core/json_schema: integer ranges as digit grammars, a number's nearest expressible range);
the grammar sampler (`llama_sampler_init_grammar`, first in the chain: native/engine.make_sampler)
keeps every sampled token inside them. A schema that is not valid JSON Schema is refused; the
keywords the grammar cannot express are relaxed (core/json_schema.relax) and the output checked
after generation against the original schema (serve/chat.py).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from llama_cpp.llama_grammar import PRIMITIVE_RULES, RESERVED_NAMES, SchemaConverter

from ..core.gbnf import GrammarError, GrammarLimits, check, check_patterns
from ..core.json_schema import EmptyRange, bounds, integer_gbnf, integer_range, invalid, number_gbnf, relax
from ..core.tool_calls import ToolFormat

__all__ = ["GrammarError", "GrammarLimits", "check_schema", "json_schema_gbnf", "tool_call_gbnf"]


def check_schema(schema: Any, where: str, limits: GrammarLimits = GrammarLimits()) -> None:
    """GrammarError when `schema` is not valid JSON Schema or a pattern of it is nested past
    the grammar's bound (checked first: Python's regex parser recurses per group), naming where."""
    try:
        check_patterns(schema, limits)
    except GrammarError as e:
        raise GrammarError(f"{where}.{e.message}") from None
    problem = invalid(schema)
    if problem:
        raise GrammarError(f"{where}: {problem}", hint="fix the schema (JSON Schema 2020-12 unless $schema names a "
                                                       "draft)")


# keywords that make a schema without a type more than "any value"
SHAPING = {"properties", "additionalProperties", "items", "prefixItems", "$ref", "anyOf", "oneOf", "allOf", "enum",
           "const", "pattern", "minLength", "maxLength", "format"}


class _Converter(SchemaConverter):
    """llama-cpp-python's converter, with bounded integers and numbers, a list of types read as
    the union of the schema with each type (the bounds kept), and a schema that says nothing of
    its value's shape ({}, or annotations only) read as any JSON value, as llama.cpp's converter
    reads it (the Python port reads {} as an object and fails on annotations)."""

    def visit(self, schema, name):
        t = schema.get("type") if isinstance(schema, dict) else None
        rule_name = name + "-" if name in RESERVED_NAMES else name or "root"
        if isinstance(schema, dict) and t is None and not SHAPING & schema.keys():
            return self._add_rule(rule_name, self._add_primitive("value", PRIMITIVE_RULES["value"]))
        if isinstance(t, list) and len(t) > 1:
            alts = [self.visit({**schema, "type": one}, f"{name}{'-' if name else ''}{one}") for one in t]
            return self._add_rule(rule_name, " | ".join(alts))
        if isinstance(t, list) and t:
            return self.visit({**schema, "type": t[0]}, name)
        if t in ("integer", "number") and any(k in schema for k in ("minimum", "maximum", "exclusiveMinimum",
                                                                  "exclusiveMaximum")):
            lo, hi = bounds(schema)
            if lo is not None or hi is not None:
                expr = integer_gbnf(*integer_range(lo, hi)) if t == "integer" else number_gbnf(lo, hi)
                return self._add_rule(rule_name, f"({expr}) space")
        return super().visit(schema, name)


def _converter() -> _Converter:
    return _Converter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)


def _visit(conv, schema: Mapping[str, Any], name: str, where: str) -> str:
    try:
        return conv.visit(conv.resolve_refs(relax(dict(schema)), ""), name)
    except RecursionError:
        raise GrammarError(f"{where}: nested too deep for the grammar converter") from None
    except EmptyRange as e:
        raise GrammarError(f"{where}: {e}") from None
    except Exception as e:  # noqa: BLE001 - the converter raises bare exceptions with the schema in the text
        raise GrammarError(f"{where}: the grammar converter cannot handle this schema ({e})") from None


def json_schema_gbnf(schema: Mapping[str, Any], where: str = "response_format.json_schema.schema",
                     limits: GrammarLimits = GrammarLimits()) -> str:
    """A grammar whose root is one JSON value valid against `schema`, within `limits`."""
    check_schema(schema, where, limits)
    conv = _converter()
    _visit(conv, schema, "", where)
    return _bounded(conv.format_grammar(), where, limits)


def _bounded(gbnf: str, where: str, limits: GrammarLimits) -> str:
    """`gbnf` when it is within `limits`; GrammarError naming where the schema came from."""
    try:
        check(gbnf, limits)
    except GrammarError as e:
        raise GrammarError(f"{where}: its grammar: {e.message}") from None
    return gbnf


def tool_call_gbnf(fmt: ToolFormat, tools: Sequence[tuple[int, Mapping[str, Any]]],
                   limits: GrammarLimits = GrammarLimits()) -> str:
    """A grammar whose root is one call, in `fmt`, of one of `tools` (OpenAI tool objects, each
    with its index in the request's tools: the errors name it)."""
    conv = _converter()
    alts = []
    for i, t in tools:
        fn = t["function"]
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        where = f"tools.{i}.function.parameters"
        check_schema(params, where, limits)
        args = _visit(conv, params, f"args{i}", where)
        per_param = []
        if fmt.args != "json":  # xml / glm: one element per parameter; text values stay raw
            props = params.get("properties") or {}
            for j, p in enumerate(params.get("required") or list(props)):
                ps = props.get(p, {})
                rule = (conv._add_rule(f"raw{i}-{j}", "[^<]*") if ps.get("type") == "string"
                        else _visit(conv, ps, f"p{i}-{j}", f"{where}.properties.{p}"))
                per_param.append((p, rule))
        alts.append(fmt.gbnf_call(fn["name"], args, per_param))
    gbnf = conv.format_grammar().rstrip("\n") + "\nroot ::= " + " | ".join(f"( {a} )" for a in alts) + "\n"
    return _bounded(gbnf, "tools", limits)
