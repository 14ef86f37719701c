"""A chat request made ready for the engine (serve/chat.prepare): the messages and tools as the
template reads them, the grammar a forced output needs, and how the output is parsed and checked.
The worker (serve/worker.Job) carries it to the engine thread.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterable

from ..core.chat_output import THINK_OPEN, OutputParser
from ..core.json_schema import violation
from ..core.tool_calls import ToolCall, ToolFormat


@dataclass(frozen=True)
class OutputSchemas:
    """The schemas a forced grammar was built from (the tools' parameters by name, the answer's
    JSON Schema): the grammar may be looser (core/json_schema.relax), so the output is checked
    against them once generated, and what breaks them is a warning in the log."""

    tools: dict[str, Any] = field(default_factory=dict)
    answer: Any = None

    def problems(self, content: str, calls: Iterable[ToolCall], complete: bool = True) -> list[str]:
        """How the output breaks the schemas (a call is parsed only once whole; the answer is
        checked only when `complete`: not cut by max_tokens)."""
        out = []
        for call in calls:
            schema = self.tools.get(call.name)
            problem = schema is not None and violation(_json_or_text(call.arguments), schema)
            if problem:
                out.append(f"the arguments of the forced call to {call.name!r} break its schema: {problem}")
        if self.answer is not None and complete:
            problem = violation(_json_or_text(content), self.answer)
            if problem:
                out.append(f"the answer breaks its JSON Schema: {problem}")
        return out


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


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
    parallel: bool = True  # parallel_tool_calls: False keeps the first call only
    prefill: bool = False  # the last message is the assistant's: continue it
    schemas: OutputSchemas = OutputSchemas()  # what a forced grammar's output is checked against
    add_generation_prompt: bool = True  # False: the prompt ends after the last message (/apply-template)

    def parser(self, prompt: str) -> OutputParser:
        """A prompt that ends by opening <think> (Qwen3 thinking) starts the answer inside reasoning."""
        return OutputParser(self.fmt, self.parse_tools, self.reasoning, prompt.rstrip().endswith(THINK_OPEN),
                            self.types, max_calls=None if self.parallel else 1)
