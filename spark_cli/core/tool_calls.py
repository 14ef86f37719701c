"""Tool calls in model text, per model family: one table row per format, pure parsers.

llama.cpp's chat parser is C++ in libcommon (not in the shared library Spark loads), so Spark
parses the formats itself. `FORMATS` holds each family's row: the marker that opens its calls,
whether the markers are control tokens (the text must then be rendered with them), a parser from
the call region to `ToolCall`s, and the GBNF shape of one call (native/grammar.py fills in the
argument rules when `tool_choice` forces a call). `format_for(template, arch)` picks the row.

A parser returns the calls it could read and the text it could not (content); `final=False`
(streaming) reads only complete calls.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

ParamTypes = Mapping[str, Mapping[str, str]]  # tool name -> parameter -> JSON Schema type ("" if none)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object, as OpenAI sends it
    id: str = ""

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _lit(s: str) -> str:
    """A GBNF string literal."""
    return json.dumps(s, ensure_ascii=False)


def _args_json(obj: Any) -> str | None:
    if isinstance(obj, str):
        try:
            obj = json.loads(obj)
        except json.JSONDecodeError:
            return None
    return json.dumps(obj, ensure_ascii=False) if isinstance(obj, dict) else None


def _typed(value: str, kind: str) -> Any:
    """An XML-style parameter value as its schema type: strings stay text, the rest is JSON when it parses."""
    if kind == "string":
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _blocks(text: str, open_: str, close: str, final: bool) -> tuple[list[str], list[str]]:
    """Bodies of open..close blocks and the text around them; an unclosed last block counts only
    when final (the model ended there)."""
    bodies, outside, i = [], [], 0
    while True:
        j = text.find(open_, i)
        if j < 0:
            outside.append(text[i:])
            break
        outside.append(text[i:j])
        k = text.find(close, j + len(open_))
        if k < 0:
            if final:
                bodies.append(text[j + len(open_):])
            break
        bodies.append(text[j + len(open_):k])
        i = k + len(close)
    return bodies, outside


Parser = Callable[[str, bool, ParamTypes], tuple[list[ToolCall], str]]


def _tagged(open_: str, close: str, body: Callable[[str, ParamTypes], ToolCall | None]) -> Parser:
    def parse(region: str, final: bool, types: ParamTypes) -> tuple[list[ToolCall], str]:
        bodies, outside = _blocks(region, open_, close, final)
        calls, rest = [], [o for o in outside if o.strip()]
        for b in bodies:
            call = body(b.strip(), types)
            if call is not None:
                calls.append(call)
            elif final:
                rest.append(open_ + b + close)
        return calls, "".join(rest)
    return parse


def _hermes_body(body: str, types: ParamTypes) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = _args_json(obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args) if args is not None else None


_FUNCTION_RE = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
_PARAM_RE = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


def _xml_body(body: str, types: ParamTypes) -> ToolCall | None:
    m = _FUNCTION_RE.search(body)
    if not m:
        return None
    name = m.group(1).strip()
    kinds = types.get(name, {})
    args = {p.strip(): _typed(v, kinds.get(p.strip(), "")) for p, v in _PARAM_RE.findall(m.group(2))}
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


_GLM_ARG_RE = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def _glm_body(body: str, types: ParamTypes) -> ToolCall | None:
    name = body.split("<arg_key>", 1)[0].strip()
    if not name or "<" in name:
        return None
    kinds = types.get(name, {})
    args = {k.strip(): _typed(v, kinds.get(k.strip(), "")) for k, v in _GLM_ARG_RE.findall(body)}
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_FENCE_RE = re.compile(r"^\s*```(?:json)?\s*(.*?)\s*```\s*$", re.S)


def _deepseek_body(body: str, types: ParamTypes) -> ToolCall | None:
    head, sep, args = body.partition(DS_SEP)
    if not sep:
        return None
    if head.strip() == "function" and "\n" in args:  # V3/R1: function<sep>NAME\n```json\n{...}\n```
        name, _, args = args.partition("\n")
        m = _FENCE_RE.match(args)
        args = m.group(1) if m else args
    else:  # V3.1: NAME<sep>{...}
        name = head
    parsed = _args_json(args.strip())
    return ToolCall(name.strip(), parsed) if parsed is not None and name.strip() else None


def _deepseek(region: str, final: bool, types: ParamTypes) -> tuple[list[ToolCall], str]:
    calls, rest = _tagged(DS_CALL_BEGIN, DS_CALL_END, _deepseek_body)(region.replace(DS_CALLS_BEGIN, "", 1),
                                                                      final, types)
    return calls, rest.replace(DS_CALLS_END, "").strip()


MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"


def _mistral(region: str, final: bool, types: ParamTypes) -> tuple[list[ToolCall], str]:
    """`[TOOL_CALLS][{"name", "arguments"}, ...]` (v3) or `[TOOL_CALLS]NAME[ARGS]{...}` (v11+)."""
    calls: list[ToolCall] = []
    dec = json.JSONDecoder()
    for part in region.split(MISTRAL_CALLS)[1:]:
        part = part.strip()
        try:
            if part.startswith("["):
                arr, _ = dec.raw_decode(part)
                items = arr if isinstance(arr, list) else []
                for obj in items:
                    call = _hermes_body(json.dumps(obj), types) if isinstance(obj, dict) else None
                    if call is None:
                        raise ValueError
                    calls.append(call)
            else:
                name, sep, args = part.partition(MISTRAL_ARGS)
                obj, _ = dec.raw_decode(args.strip()) if sep else (None, 0)
                if not isinstance(obj, dict) or not name.strip():
                    raise ValueError
                calls.append(ToolCall(name.strip(), json.dumps(obj, ensure_ascii=False)))
        except ValueError:  # incomplete (streaming) or not a call
            return calls, (region if final and not calls else "")
    return calls, ""


# -- gpt-oss harmony: messages with channels, read by core/chat_output.py -----------------

H_START, H_CHANNEL, H_MESSAGE, H_CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
H_ENDS = ("<|end|>", "<|call|>", "<|return|>")
_H_RECIPIENT_RE = re.compile(r"to=functions\.([^\s<]+)")
_H_CHANNEL_RE = re.compile(r"<\|channel\|>(\w+)")


@dataclass(frozen=True)
class HarmonyMessage:
    channel: str  # analysis | commentary | final | "" (plain text outside any header)
    recipient: str  # a function name, or ""
    body: str
    closed: bool


def harmony_messages(text: str) -> list[HarmonyMessage]:
    """The messages of gpt-oss output; an unfinished header yields nothing (yet)."""
    out: list[HarmonyMessage] = []
    first = text.find(H_CHANNEL)
    starts = [i for i in (text.find(H_START), first) if i >= 0]
    if not starts:
        return [HarmonyMessage("", "", text, True)] if text else []
    i0 = min(starts)
    if text[:i0]:
        out.append(HarmonyMessage("", "", text[:i0], True))
    for seg in text[i0:].split(H_START):
        head, sep, body = seg.partition(H_MESSAGE)
        if not sep:
            continue
        ends = [(body.find(e), e) for e in H_ENDS if e in body]
        closed = bool(ends)
        if closed:
            body = body[:min(ends)[0]]
        ch = _H_CHANNEL_RE.search(head)
        rcpt = _H_RECIPIENT_RE.search(head)
        out.append(HarmonyMessage(ch.group(1) if ch else "", rcpt.group(1) if rcpt else "", body, closed))
    return out


def _harmony(region: str, final: bool, types: ParamTypes) -> tuple[list[ToolCall], str]:
    calls = []
    for m in harmony_messages(region):
        args = _args_json(m.body.strip()) if m.recipient and (m.closed or final) else None
        if args is not None:
            calls.append(ToolCall(m.recipient, args))
    return calls, ""


# -- the table ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolFormat:
    name: str
    start: str  # the text that opens the call region
    parse: Parser
    call_prefix: Callable[[str], str]  # GBNF literal text before one call's arguments (name given)
    call_suffix: str  # GBNF literal text after them
    args: str = "json"  # json: one JSON object; xml / glm: one element per parameter
    special: bool = False  # the markers are control tokens: render them in the output text

    def gbnf_call(self, name: str, args_rule: str, params: Sequence[tuple[str, str]] = ()) -> str:
        """A GBNF expression of one call: `args_rule` names the rule of the arguments object,
        `params` (parameter, value rule) the per-parameter rules of xml/glm formats."""
        if self.args == "xml":
            body = " ".join(f'{_lit(f"<parameter={p}>" + chr(10))} {r} {_lit(chr(10) + "</parameter>" + chr(10))}'
                            for p, r in params)
        elif self.args == "glm":
            body = " ".join(f'{_lit(f"<arg_key>{p}</arg_key>" + chr(10) + "<arg_value>")} {r} '
                            f'{_lit("</arg_value>" + chr(10))}' for p, r in params)
        else:
            body = args_rule
        return f"{_lit(self.call_prefix(name))} {body or chr(34) * 2} {_lit(self.call_suffix)}"


HERMES = ToolFormat("hermes", "<tool_call>", _tagged("<tool_call>", "</tool_call>", _hermes_body),
                    lambda n: f'<tool_call>\n{{"name": {json.dumps(n)}, "arguments": ', "}\n</tool_call>")
FORMATS: dict[str, ToolFormat] = {f.name: f for f in (
    HERMES,
    ToolFormat("qwen3_coder", "<tool_call>", _tagged("<tool_call>", "</tool_call>", _xml_body),
               lambda n: f"<tool_call>\n<function={n}>\n", "</function>\n</tool_call>", args="xml"),
    ToolFormat("glm45", "<tool_call>", _tagged("<tool_call>", "</tool_call>", _glm_body),
               lambda n: f"<tool_call>{n}\n", "</tool_call>", args="glm"),
    ToolFormat("deepseek", DS_CALLS_BEGIN, _deepseek,
               lambda n: f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}{n}\n```json\n",
               f"\n```{DS_CALL_END}{DS_CALLS_END}", special=True),
    ToolFormat("mistral", MISTRAL_CALLS, _mistral, lambda n: f'{MISTRAL_CALLS}[{{"name": {json.dumps(n)}, '
               '"arguments": ', "}]", special=True),
    ToolFormat("harmony", H_CHANNEL, _harmony,
               lambda n: f"{H_CHANNEL}commentary to=functions.{n} {H_CONSTRAIN}json{H_MESSAGE}", "",
               special=True),
)}


def format_for(template: str, arch: str = "") -> ToolFormat:
    """The tool-call format a chat template (or else the architecture) speaks; Hermes by default."""
    if H_CHANNEL in template or arch == "gpt-oss":
        return FORMATS["harmony"]
    if "tool▁calls▁begin" in template or "tool▁call▁begin" in template:
        return FORMATS["deepseek"]
    if "<arg_key>" in template:
        return FORMATS["glm45"]
    if "<function=" in template and "<parameter=" in template:
        return FORMATS["qwen3_coder"]
    if MISTRAL_CALLS in template:
        return FORMATS["mistral"]
    return HERMES


def param_types(tools: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, str]]:
    """Parameter types per tool (OpenAI tool objects), for formats whose values are untyped text."""
    out: dict[str, dict[str, str]] = {}
    for t in tools:
        fn = t.get("function", {})
        props = (fn.get("parameters") or {}).get("properties") or {}
        out[fn.get("name", "")] = {p: (s.get("type") if isinstance(s.get("type"), str) else "")
                                   for p, s in props.items() if isinstance(s, dict)}
    return out
