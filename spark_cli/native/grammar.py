"""GBNF grammars that constrain sampling: JSON Schema answers and forced tool calls.

llama-cpp-python's `SchemaConverter` writes the JSON rules; the grammar sampler
(`llama_sampler_init_grammar`, first in the chain: native/engine.make_sampler) keeps every
sampled token inside them. Schemas are checked first against the keywords the converter
honours, so a schema it would silently loosen is refused with the keyword named.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..core.tool_calls import ToolFormat
from ..errors import SparkError

# keywords the converter turns into rules, and annotations that do not constrain
CONSTRAINING = {"type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems",
                "maxItems", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "pattern", "format", "minLength",
                "maxLength", "$defs", "definitions"}
ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "readOnly",
               "writeOnly", "deprecated", "strict", "name"}


class GrammarError(SparkError):
    """A schema the grammar converter cannot honour."""

    exit_code = 2


def check_schema(schema: Any, where: str) -> None:
    """GrammarError naming the first keyword (and where) that the converter cannot honour."""
    todo: list[tuple[Any, str]] = [(schema, where)]
    while todo:
        s, at = todo.pop()
        if isinstance(s, bool):
            continue
        if not isinstance(s, dict):
            raise GrammarError(f"{at}: a schema must be an object, got {type(s).__name__}")
        for k, v in s.items():
            if k not in CONSTRAINING and k not in ANNOTATIONS:
                raise GrammarError(f"{at}: the JSON Schema keyword {k!r} is not supported by the grammar converter",
                                   hint=f"drop {k!r} or express it with: {', '.join(sorted(CONSTRAINING))}")
            if k in ("properties", "$defs", "definitions") and isinstance(v, dict):
                todo.extend((x, f"{at}.{k}.{n}") for n, x in v.items())
            elif k in ("items", "additionalProperties") and isinstance(v, (dict, bool)):
                todo.append((v, f"{at}.{k}"))
            elif k in ("prefixItems", "anyOf", "oneOf", "allOf") and isinstance(v, list):
                todo.extend((x, f"{at}.{k}.{i}") for i, x in enumerate(v))


def _converter():
    from llama_cpp.llama_grammar import SchemaConverter

    return SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)


def _visit(conv, schema: Mapping[str, Any], name: str, where: str) -> str:
    try:
        return conv.visit(conv.resolve_refs(dict(schema), ""), name)
    except Exception as e:  # noqa: BLE001 - the converter raises bare exceptions with the schema in the text
        raise GrammarError(f"{where}: the grammar converter cannot handle this schema ({e})") from None


def json_schema_gbnf(schema: Mapping[str, Any], where: str = "response_format.json_schema.schema") -> str:
    """A grammar whose root is one JSON value valid against `schema`."""
    check_schema(schema, where)
    conv = _converter()
    _visit(conv, schema, "", where)
    return conv.format_grammar()


def tool_call_gbnf(fmt: ToolFormat, tools: Sequence[Mapping[str, Any]]) -> str:
    """A grammar whose root is one call, in `fmt`, of one of `tools` (OpenAI tool objects)."""
    conv = _converter()
    alts = []
    for i, t in enumerate(tools):
        fn = t["function"]
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        where = f"tools.{i}.function.parameters"
        check_schema(params, where)
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
    return conv.format_grammar().rstrip("\n") + "\nroot ::= " + " | ".join(f"( {a} )" for a in alts) + "\n"
