"""The one place chat messages become prompt text: the GGUF's own Jinja chat template.

Rendered as Hugging Face and llama-server (`--jinja`) do: a sandboxed Jinja environment
(jinja2's `ImmutableSandboxedEnvironment`, trim_blocks, lstrip_blocks, loop controls) with
`messages`, `tools`, `add_generation_prompt`, `bos_token`, `eos_token`, the helpers HF templates
call (`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII), llama-server's
`date_string` and `datetime` (the local date, or SPARK_TEMPLATE_DATE's), and extras such as
`enable_thinking` or gpt-oss's `reasoning_effort`. A GGUF may carry named templates
(`tokenizer.chat_template.tool_use`); a request with tools takes that one when present.

Templates that never mention tools get them as Hermes-style text (a system paragraph, calls
written as `<tool_call>` JSON), so any template can carry a tool round trip.
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import os
import re
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..errors import SparkError, UsageError
from ..files.regular import read_regular
from .reasoning import close_thinking

DEFAULT_NAME = "tokenizer.chat_template"
TOOL_USE_NAME = "tokenizer.chat_template.tool_use"
MAX_TEMPLATE_BYTES = 1 << 20
BUNDLED_DIR = Path(__file__).resolve().parent.parent / "data" / "templates"  # vendors' templates, written out


class TemplateError(SparkError):
    """A chat template that does not compile or raised while rendering."""

    exit_code = 2


def _raise(message: str) -> None:
    raise TemplateError(str(message))


DATE_ENV = "SPARK_TEMPLATE_DATE"  # YYYY-MM-DD: the date every template sees (reproducible prompts)


def template_now() -> _dt.datetime:
    """The local time templates see: now, or the day SPARK_TEMPLATE_DATE fixes (at midnight).
    TemplateError for a value that is not a date."""
    fixed = os.environ.get(DATE_ENV, "").strip()
    if not fixed:
        return _dt.datetime.now()
    try:
        return _dt.datetime.combine(_dt.date.fromisoformat(fixed), _dt.time())
    except ValueError:
        raise TemplateError(f"{DATE_ENV}={fixed}: not a date (YYYY-MM-DD)",
                            hint=f"unset {DATE_ENV} for today's date") from None


def _strftime_now(fmt: str) -> str:
    return template_now().strftime(fmt)


def date_variables() -> dict[str, str]:
    """The date as llama-server gives it to every template besides strftime_now: `date_string`
    (Llama 3.x: "06 Dec 2026") and `datetime` (firefunction: "Dec 06 2026")."""
    now = template_now()
    return {"date_string": now.strftime("%d %b %Y"), "datetime": now.strftime("%b %d %Y")}


def _tojson(value: Any, indent: int | None = None, separators=None, sort_keys: bool = False,
            ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, separators=tuple(separators) if separators else None,
                      sort_keys=sort_keys, ensure_ascii=ensure_ascii)


RENDER_SECONDS = 5.0  # a render may take (real templates take milliseconds, even for long agent chats)
# NOTE: a 131,072-token context of 32-byte pieces: a longer prompt cannot fit any context
RENDER_MAX_BYTES = 4 * 1024 * 1024
_budget = threading.local()  # the running render's deadline, per thread (the engine's, the HTTP pool's)


class _Over(Exception):
    """A render past its time or size bound (turned into a TemplateError by _render)."""


def _check_time() -> None:
    deadline = getattr(_budget, "deadline", None)
    if deadline is not None and time.monotonic() > deadline:
        raise _Over(f"took longer than {RENDER_SECONDS:g} s")


def _check_size(n: int) -> None:
    if n > RENDER_MAX_BYTES:
        raise _Over(f"builds a text of {n} characters, past the {RENDER_MAX_BYTES} bytes a prompt may have "
                    "(it exceeds the available context size)")


def _bounded_args(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    _check_time()
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > RENDER_MAX_BYTES:
            _check_size(abs(a))  # a width or a count that would build that much


def _bounded_filter(f):
    @functools.wraps(f)
    def run(*args, **kwargs):
        _bounded_args(args, kwargs)
        out = f(*args, **kwargs)
        if isinstance(out, str):
            _check_size(len(out))
        return out
    return run


def _bounded_range(*args: int):
    from jinja2.sandbox import safe_range

    for i in safe_range(*args):
        _check_time()
        yield i


def _bounded_join(seq) -> str:
    parts = [str(x) for x in seq]
    _check_size(sum(map(len, parts)))
    return "".join(parts)


def _null(v: Any) -> bool:
    from jinja2 import Undefined

    return v is None or isinstance(v, Undefined)


def _environment():
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Bounded(ImmutableSandboxedEnvironment):
        """The sandbox, with every call, attribute, operator and loop step under the render's
        deadline, and no value built past RENDER_MAX_BYTES (`"x" * n`, `s ~ s`, `ljust(n)`)."""

        intercepted_binops = frozenset({"*", "**", "+"})

        def call_binop(self, context, operator, left, right):
            _check_time()
            if operator == "*" and isinstance(right, int) and isinstance(left, (str, list, tuple)):
                _check_size(len(left) * right)
            if operator == "*" and isinstance(left, int) and isinstance(right, (str, list, tuple)):
                _check_size(len(right) * left)
            if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
                _check_size(right * abs(left).bit_length() // 8)
            if operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                _check_size(len(left) + len(right))
            if operator == "+" and (_null(left) and isinstance(right, str) or _null(right) and isinstance(left, str)):
                # NOTE: llama.cpp's Jinja (so llama-server) reads null or undefined as "" beside a string
                return (left if isinstance(left, str) else "") + (right if isinstance(right, str) else "")
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's own signature
            _bounded_args(args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

        def getattr(self, obj, attribute):
            _check_time()
            return super().getattr(obj, attribute)

        def getitem(self, obj, argument):
            _check_time()
            return super().getitem(obj, argument)

    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters.update({name: _bounded_filter(f) for name, f in env.filters.items()})
    env.globals.update(raise_exception=_raise, strftime_now=_strftime_now, range=_bounded_range)
    return env


@functools.lru_cache(maxsize=16)
def _compile(source: str):
    from jinja2 import TemplateError as JinjaError

    try:
        tmpl = _environment().from_string(source)
    except JinjaError as e:
        raise TemplateError(f"does not compile: {e}") from None
    # NOTE: `a ~ b` compiles to the template module's own str_join: bound it there
    tmpl.root_render_func.__globals__["str_join"] = _bounded_join
    return tmpl


def _generate(tmpl, ctx: Mapping[str, Any]) -> str:
    """The template's text, streamed, under the deadline and the size bound."""
    _budget.deadline = time.monotonic() + RENDER_SECONDS
    try:
        parts, size = [], 0
        for chunk in tmpl.generate(**ctx):
            size += len(chunk)
            _check_size(size)
            _check_time()
            parts.append(chunk)
        return "".join(parts)
    finally:
        _budget.deadline = None


@dataclass(frozen=True)
class ChatTemplate:
    """One Jinja chat template (`name`: the GGUF key or the file it came from)."""

    source: str
    name: str = DEFAULT_NAME
    bos_token: str = ""
    eos_token: str = ""

    @property
    def knows_tools(self) -> bool:
        return "tools" in self.source or "tool_calls" in self.source

    def render(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool = True, extras: Mapping[str, Any] | None = None) -> str:
        """The prompt text; TemplateError names this template and what it raised. A system message
        after the first is rendered where it stands; a template that refuses it or leaves it out
        (one system slot) gets it joined into the first system message instead."""
        later = [m.get("content") for m in list(messages)[1:] if m.get("role") == "system"]
        try:
            text = self._render(messages, tools, add_generation_prompt, extras)
        except TemplateError:
            if not later:
                raise
            return self._render(joined_system(messages), tools, add_generation_prompt, extras)
        if any(isinstance(c, str) and c.strip() and c not in text for c in later):
            return self._render(joined_system(messages), tools, add_generation_prompt, extras)
        return text

    def _render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
                add_generation_prompt: bool, extras: Mapping[str, Any] | None) -> str:
        msgs = [dict(m) for m in messages]
        if not self.knows_tools:
            msgs, tools = hermes_polyfill(msgs, tools or ()), None
        ctx = {**date_variables(), "messages": msgs, "tools": list(tools) if tools else None,
               "add_generation_prompt": add_generation_prompt, "bos_token": self.bos_token,
               "eos_token": self.eos_token, **dict(extras or {})}
        try:
            text = _generate(_compile(self.source), ctx)
            return close_thinking(self.source, text, ctx) if add_generation_prompt else text
        except _Over as e:
            raise TemplateError(f"chat template {self.name}: the render {e}",
                                hint="fix the template or pass another with --chat-template-file") from None
        except TemplateError as e:
            raise TemplateError(f"chat template {self.name}: {e.message}",
                                hint="fix the template or pass another with --chat-template-file") from None
        except Exception as e:  # noqa: BLE001 - a template is user data: any failure is its message
            raise TemplateError(f"chat template {self.name}: {type(e).__name__}: {e}",
                                hint="fix the template or pass another with --chat-template-file") from None


@dataclass(frozen=True)
class TemplateSet:
    """The GGUF's templates by name (or one from --chat-template-file, which replaces them)."""

    templates: Mapping[str, str] = field(default_factory=dict)
    builtin: str = ""  # llama.cpp's built-in template by name (--chat-template NAME), for prompts without Jinja

    def pick(self, with_tools: bool) -> ChatTemplate | None:
        name = TOOL_USE_NAME if with_tools and TOOL_USE_NAME in self.templates else DEFAULT_NAME
        src = self.templates.get(name)
        return ChatTemplate(src, name) if src else None

    def with_tokens(self, bos: str, eos: str) -> "BoundTemplates":
        return BoundTemplates(self, bos, eos)

    @property
    def default_source(self) -> str:
        return self.templates.get(DEFAULT_NAME, "")


@dataclass(frozen=True)
class BoundTemplates:
    """A TemplateSet with the model's BOS and EOS text: what an engine renders with."""

    set: TemplateSet
    bos_token: str = ""
    eos_token: str = ""

    def pick(self, with_tools: bool) -> ChatTemplate | None:
        t = self.set.pick(with_tools)
        return replace(t, bos_token=self.bos_token, eos_token=self.eos_token) if t else None


def bundled(name: str) -> str:
    """A template Spark carries (spark_cli/data/templates/NAME.jinja): the tiny models' and the tests'."""
    return (BUNDLED_DIR / f"{name}.jinja").read_text(encoding="utf-8")


def from_file(path: Path | str, flag: str = "--chat-template-file") -> TemplateSet:
    """A template file replaces every template of the GGUF."""
    p = Path(path).expanduser()
    try:
        text = read_regular(p, MAX_TEMPLATE_BYTES).decode("utf-8")
    except OSError as e:
        raise UsageError(f"{flag} {p}: {e.strerror or e}", hint="pass a Jinja chat template file") from None
    except UnicodeDecodeError:
        raise UsageError(f"{flag} {p}: not UTF-8 text", hint="pass a Jinja chat template file") from None
    if not text.strip():
        raise UsageError(f"{flag} {p}: the file is empty", hint="pass a Jinja chat template file")
    try:
        _compile(text)
    except TemplateError as e:
        raise UsageError(f"{flag} {p}: {e.message}", hint="fix the template") from None
    return TemplateSet({DEFAULT_NAME: text})


BUILTIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # llama.cpp's built-in template names (chatml, llama3, ...)


def from_flag(value: str) -> TemplateSet:
    """--chat-template: llama.cpp's built-in template by name (checked when the model loads), or
    a Jinja template's text (checked now)."""
    if BUILTIN_NAME.fullmatch(value):
        return TemplateSet({}, builtin=value)
    try:
        _compile(value)
    except TemplateError as e:
        raise UsageError(f"--chat-template: {e.message}", hint="give a built-in template's name (chatml, "
                         "llama3, ...) or a Jinja chat template") from None
    return TemplateSet({DEFAULT_NAME: value})


def joined_system(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    """The messages with every system message after the first joined into the first (a new one
    when the conversation does not start with one), for templates with one system slot."""
    out = [dict(m) for m in messages]
    first = out[0] if out and out[0].get("role") == "system" else None
    later = [m for m in out[1:] if m.get("role") == "system"]
    texts = [str(m.get("content") or "") for m in ([first] if first else []) + later]
    rest = [m for m in out[1 if first else 0:] if m.get("role") != "system"]
    return [{**(first or {}), "role": "system", "content": "\n\n".join(t for t in texts if t)}, *rest]


def hermes_polyfill(messages: list[dict], tools: Sequence[Mapping[str, Any]]) -> list[dict]:
    """Tools for a template that has no tool syntax: a system paragraph listing them (if any),
    assistant calls as `<tool_call>` JSON text; tool results stay `tool` messages."""
    out = [dict(m) for m in messages]
    for m in out:
        calls = m.pop("tool_calls", None)
        if calls:
            text = "".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                          "arguments": c["function"]["arguments"]},
                                                         ensure_ascii=False) + "\n</tool_call>" for c in calls)
            m["content"] = (m.get("content") or "") + text
    if not tools:
        return out
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    intro = ("You may call one or more functions. The function signatures are within <tools></tools>:\n"
             f"<tools>\n{listing}\n</tools>\nFor each call, return a JSON object with the function name and "
             'arguments within <tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, '
             '"arguments": <args-json-object>}\n</tool_call>')
    if out and out[0].get("role") == "system":
        out[0]["content"] = f"{out[0].get('content') or ''}\n\n{intro}".lstrip()
    else:
        out.insert(0, {"role": "system", "content": intro})
    return out
