"""The one chat path behind every chat API (OpenAI's /v1/chat/completions; an Anthropic adapter).

In: a `protocol.ChatRequest`, OpenAI-shaped: messages (assistant `tool_calls`, `role: "tool"`
with `tool_call_id`), `tools`, `tool_choice` (auto, none, required, a named function),
`response_format`, `reasoning_format`, `chat_template_kwargs`.

1. `prepare(req, config) -> PreparedChat` checks what the template cannot (a schema the grammar
   converter cannot honour: ApiError 400) and decides the template inputs (tool_choice none:
   rendered without tools, never parsed), the GBNF grammar (`required` or a named function:
   one call in the model's format; `response_format`: JSON valid against the schema) and the
   output parser (core/chat_output.py: the model's tool-call format, `--reasoning-format`).
2. `app.open_chat(request, req) -> ChatRun` queues it on the engine worker, which renders the
   prompt with the model's template (Engine.chat_prompt: ApiError 400 if the template raises)
   and generates.
3. `async for delta in run.deltas()` yields `core.chat_output.ChatDelta`s: `content`,
   `reasoning_content`, or `tool_call` (index, id and name first, then argument text). Then
   `run.output` (ChatOutput: content, reasoning_content, tool_calls) is their sum,
   `run.finish_reason` is OpenAI's (stop, length, tool_calls) and `run.usage` the token counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

from ..core.chat_output import THINK_OPEN, ChatDelta, ChatOutput, OutputParser
from ..core.chat_template import TemplateSet
from ..core.tool_calls import HERMES, ToolFormat, format_for, param_types
from ..native.grammar import GrammarError, json_schema_gbnf, tool_call_gbnf
from .protocol import FINISH, ApiError, ChatRequest, Usage
from .worker import Done, Failed, Text


@dataclass(frozen=True)
class ChatConfig:
    """What a server knows before any request: the model's tool-call format, --reasoning-format."""

    fmt: ToolFormat = HERMES
    reasoning: str = "auto"

    @classmethod
    def for_model(cls, templates: TemplateSet, arch: str, reasoning: str = "auto") -> "ChatConfig":
        tmpl = templates.pick(with_tools=True)
        return cls(format_for(tmpl.source if tmpl else "", arch), reasoning)


@dataclass(frozen=True)
class PreparedChat:
    messages: list[dict[str, Any]]  # as templates read them
    tools: list[dict[str, Any]] | None  # what the template renders (None: no tools, or tool_choice none)
    extras: dict[str, Any]  # chat_template_kwargs (enable_thinking, reasoning_effort, ...)
    grammar: str | None
    fmt: ToolFormat
    parse_tools: bool
    reasoning: str
    types: dict[str, dict[str, str]] = field(default_factory=dict)

    def parser(self, prompt: str) -> OutputParser:
        """A prompt that ends by opening <think> (Qwen3 thinking) starts the answer inside reasoning."""
        return OutputParser(self.fmt, self.parse_tools, self.reasoning, prompt.rstrip().endswith(THINK_OPEN),
                            self.types)


def prepare(req: ChatRequest, config: ChatConfig) -> PreparedChat:
    choice, tools = req.choice, req.tool_dicts()
    grammar = None
    try:
        if tools and choice not in ("auto", "none"):
            forced = tools if choice == "required" else [t for t in tools if t["function"]["name"] == choice]
            grammar = tool_call_gbnf(config.fmt, forced)
        elif req.response_format is not None and req.response_format.schema() is not None:
            grammar = json_schema_gbnf(req.response_format.schema())
    except GrammarError as e:
        raise ApiError(400, e.message, param=e.message.split(":", 1)[0]) from None
    on = bool(tools) and choice != "none"
    return PreparedChat(req.message_dicts(), tools if on else None, dict(req.chat_template_kwargs or {}), grammar,
                        config.fmt, on, req.reasoning_format or config.reasoning, param_types(tools) if on else {})


class ChatRun:
    """One queued chat: iterate `deltas()` once; then `output`, `finish_reason`, `usage`."""

    def __init__(self, prepared: PreparedChat, prompt: str, next_event: Callable[[], Awaitable[Any]]):
        self.parser = prepared.parser(prompt)
        self._next = next_event
        self.finish_reason: str | None = None
        self.usage = Usage()

    @property
    def output(self) -> ChatOutput:
        return self.parser.result()

    async def deltas(self) -> AsyncIterator[ChatDelta]:
        while True:
            ev = await self._next()
            if isinstance(ev, Text):
                for d in self.parser.feed(ev.text):
                    yield d
            elif isinstance(ev, Done):
                for d in self.parser.finish():
                    yield d
                self.usage = ev.usage
                self.finish_reason = "tool_calls" if self.parser.result().tool_calls else FINISH[ev.finish]
                return
            elif isinstance(ev, Failed):
                raise ev.error
