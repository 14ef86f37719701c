"""JSON Schema for constrained output: what the grammar can express, and the check after it.

A forced grammar (tool_choice `required` or a named tool, response_format json_schema) is
built from a schema by native/grammar.py. What the grammar cannot express exactly is relaxed
to the nearest constraint it can (`relax`), and the output is then checked against the
original schema (`violation`), as llama.cpp's converter relaxes what it does not implement.
Only a schema that is not valid JSON Schema is refused (`invalid`).

Numeric bounds become digit grammars here (Spark's own construction; llama.cpp's converter
does the same for integers): an integer range exactly (`integer_gbnf`), a number's bounds as
its sign and the range of its integral part (`number_gbnf`, then checked).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jsonschema

# what the converter reads (the bounds through integer_gbnf / number_gbnf); any other keyword is dropped
KEPT = {"type", "required", "minItems", "maxItems", "enum", "const", "$ref", "pattern", "format", "minLength",
        "maxLength", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "title", "description"}
# a length or item count past this is left to the check after generation: the grammar spells a
# repetition out one element at a time (a maxLength of 10^6 would be a grammar of megabytes)
COUNTS = {"minLength", "maxLength", "minItems", "maxItems"}
MAX_REPETITION = 100
SUBSCHEMAS = {"properties": "map", "$defs": "map", "definitions": "map", "items": "one", "additionalProperties": "one",
              "prefixItems": "list", "anyOf": "list", "oneOf": "list", "allOf": "list"}
MAX_DIGITS = 16  # an unbounded side of a range: integers of at most this many digits (llama.cpp's cap)


def draft(schema: Any) -> Any:
    """The validator class of `schema`: its $schema's draft; naming none, 2020-12, or draft 7 for a
    schema only draft 7 takes (a list of `items`, the tuple form llama-server's converter reads)."""
    if not isinstance(schema, dict):
        return jsonschema.Draft202012Validator
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    if "$schema" in schema or cls(cls.META_SCHEMA).is_valid(schema):
        return cls
    seven = jsonschema.Draft7Validator
    return seven if seven(seven.META_SCHEMA).is_valid(schema) else cls


def invalid(schema: Any) -> str | None:
    """Why `schema` is not valid JSON Schema (its draft's metaschema: `draft`), or None."""
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, dict):
        return f"a schema must be an object, got {type(schema).__name__}"
    try:
        draft(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = ".".join(str(p) for p in e.absolute_path)
        return f"not valid JSON Schema: {e.message}" + (f" (at {where})" if where else "")
    except RecursionError:
        return "nested too deep to check"
    return None


def violation(value: Any, schema: Any) -> str | None:
    """How `value` breaks `schema` (the first error, with where), or None when it satisfies it."""
    error = jsonschema.exceptions.best_match(draft(schema)(schema).iter_errors(value))
    if error is None:
        return None
    where = ".".join(str(p) for p in error.absolute_path)
    return (f"{where}: " if where else "") + error.message


def relax(schema: Any) -> Any:
    """The nearest schema the grammar expresses: keywords it cannot express dropped (multipleOf,
    uniqueItems, not, if/then/else, patternProperties, ...); bounds kept (integer_gbnf and
    number_gbnf read them); oneOf and allOf kept as the converter reads them (as anyOf, and as
    the union of the objects' properties)."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k in SUBSCHEMAS:
            out[k] = _relax_sub(v, SUBSCHEMAS[k])
        elif k in KEPT and not (k in COUNTS and isinstance(v, int) and v > MAX_REPETITION):
            out[k] = v
    return out


def _relax_sub(v: Any, shape: str) -> Any:
    if shape == "map" and isinstance(v, dict):
        return {n: relax(x) for n, x in v.items()}
    if shape != "map" and isinstance(v, list):  # NOTE: `items` too, draft 7's tuple form
        return [relax(x) for x in v]
    return relax(v)


# ---------------------------------------------------------------- bounds


@dataclass(frozen=True)
class Bound:
    value: float
    exclusive: bool


def bounds(schema: dict) -> tuple[Bound | None, Bound | None]:
    """The lower and upper bounds a schema puts on a number (the tighter of minimum and
    exclusiveMinimum; draft 4's boolean exclusiveMinimum too)."""
    def pick(inclusive: str, exclusive: str, tighter) -> Bound | None:
        found: list[Bound] = []
        ex = schema.get(exclusive)
        if _is_number(schema.get(inclusive)):
            found.append(Bound(schema[inclusive], ex is True))
        if _is_number(ex):
            found.append(Bound(ex, True))
        if not found:
            return None
        return min(found, key=lambda b: (tighter(b.value), not b.exclusive))

    return (pick("minimum", "exclusiveMinimum", lambda v: -v), pick("maximum", "exclusiveMaximum", lambda v: v))


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def integer_range(lo: Bound | None, hi: Bound | None) -> tuple[int | None, int | None]:
    """The smallest and largest integers within the bounds (None: unbounded)."""
    low = None if lo is None else (math.floor(lo.value) + 1 if lo.exclusive else math.ceil(lo.value))
    high = None if hi is None else (math.ceil(hi.value) - 1 if hi.exclusive else math.floor(hi.value))
    return low, high


class EmptyRange(ValueError):
    """No value lies within the bounds."""


def integer_gbnf(low: int | None, high: int | None) -> str:
    """A GBNF expression of the JSON integers from `low` to `high` (None: unbounded, up to
    MAX_DIGITS digits), without leading zeros and without -0."""
    if low is not None and high is not None and low > high:
        raise EmptyRange(f"no integer is at least {low} and at most {high}")
    alts = []
    if low is None or low < 0:  # the negatives -1 .. low: "-" and their magnitudes
        top = None if low is None else -low
        bottom = 1 if high is None or high >= 0 else -high
        alts.append('"-" ' + _paren(_magnitudes(bottom, top)))
    if high is None or high >= 0:
        alts.append(_magnitudes(max(low or 0, 0), high))
    return " | ".join(_paren(a) if len(alts) > 1 else a for a in alts)


def _paren(expr: str) -> str:
    return expr if " " not in expr or expr.startswith("(") and _balanced_outer(expr) else f"({expr})"


def _balanced_outer(expr: str) -> bool:
    """Whether expr's first "(" closes at its very end (then it needs no more parentheses)."""
    depth = 0
    for i, c in enumerate(expr):
        depth += {"(": 1, ")": -1}.get(c, 0)
        if depth == 0:
            return i == len(expr) - 1
    return False


def _magnitudes(low: int, high: int | None) -> str:
    """The decimal numerals from `low` to `high` (>= 0), by their number of digits."""
    top = high if high is not None else 10 ** MAX_DIGITS - 1
    alts = []
    full: list[int] = []  # lengths whose every numeral is in range (n >= 2): one rule for a run of them
    for n in range(len(str(low)), len(str(top)) + 1):
        first = low if n == len(str(low)) else 10 ** (n - 1)
        last = top if n == len(str(top)) else 10 ** n - 1
        if n >= 2 and (first, last) == (10 ** (n - 1), 10 ** n - 1):
            full.append(n)
            continue
        alts.append(_same_length(str(first), str(last)))
    if full:
        span = f"{{{full[0] - 1}}}" if len(full) == 1 else f"{{{full[0] - 1},{full[-1] - 1}}}"
        alts.insert(1 if alts and len(str(low)) < full[0] else 0, f"[1-9] [0-9]{span}")
    return " | ".join(_paren(a) for a in alts) if len(alts) > 1 else alts[0]


def _same_length(a: str, b: str) -> str:
    """The numerals of len(a) == len(b) digits from a to b (a <= b), digit by digit."""
    if a == "0" * len(a) and b == "9" * len(b):
        return _any_digits(len(a))
    i = next((k for k in range(len(a)) if a[k] != b[k]), len(a))
    prefix = f'"{a[:i]}"' if i else ""
    if i == len(a):
        return prefix
    rest = len(a) - i - 1
    lo_rest, hi_rest = a[i + 1:], b[i + 1:]
    any_rest = _any_digits(rest)
    alts = []
    if lo_rest == "0" * rest and hi_rest == "9" * rest:  # every tail: one class for the digit
        alts.append(_join(_digit_class(a[i], b[i]), any_rest))
    else:
        alts.append(_join(f'"{a[i]}"', _paren(_same_length(lo_rest, "9" * rest)) if rest else ""))
        if int(b[i]) - int(a[i]) > 1:
            alts.append(_join(_digit_class(chr(ord(a[i]) + 1), chr(ord(b[i]) - 1)), any_rest))
        alts.append(_join(f'"{b[i]}"', _paren(_same_length("0" * rest, hi_rest)) if rest else ""))
    body = " | ".join(_paren(x) for x in alts) if len(alts) > 1 else alts[0]
    return _join(prefix, _paren(body) if prefix and len(alts) > 1 else body)


def _digit_class(a: str, b: str) -> str:
    return f"[{a}]" if a == b else f"[{a}-{b}]"


def _any_digits(n: int) -> str:
    return "" if n == 0 else "[0-9]" if n == 1 else f"[0-9]{{{n}}}"


def _join(*parts: str) -> str:
    return " ".join(p for p in parts if p)


def number_gbnf(lo: Bound | None, hi: Bound | None) -> str:
    """A GBNF expression of the JSON numbers nearest to the bounds that a grammar expresses: the
    sign and the integral part's range, then any decimals (no exponent). It admits a few values
    at the edges (0.0 for exclusiveMinimum 0, 2.5 for maximum 2): the output is checked after."""
    frac = '("." [0-9]+)?'
    low = None if lo is None else lo.value
    high = None if hi is None else hi.value
    if low is not None and high is not None and (low > high or low == high and (lo.exclusive or hi.exclusive)):
        raise EmptyRange(f"no number lies between {low} and {high}")
    alts = []
    if low is None or low < 0:  # negative: magnitude from -high (or 0) to -low
        top = None if low is None else math.floor(-low)
        bottom = 0 if high is None or high >= 0 else math.floor(-high)
        alts.append('"-" ' + _paren(_magnitudes(bottom, top)) + " " + frac)
    if high is None or high >= 0:
        bottom = 0 if low is None or low < 0 else math.floor(low)
        alts.append(_paren(_magnitudes(bottom, None if high is None else math.floor(high))) + " " + frac)
    return " | ".join(f"({a})" for a in alts) if len(alts) > 1 else alts[0]
