"""Thinking on or off, as llama-server decides it (`--reasoning on|off|auto`, a request's
`chat_template_kwargs.enable_thinking`, `reasoning_effort: "none"`), and how each template family
renders "off". Pure: no jinja, no llama_cpp.

llama-server's rule: the server's default is on when `--reasoning` is not `off` and the template
can think (`auto`), forced on or off by `--reasoning on|off`; a request's
`chat_template_kwargs.enable_thinking` (a boolean) overrides it, and `reasoning_effort: "none"`
turns it off. Every render gets the outcome as `enable_thinking`, which Qwen3.x, GLM-4.5 and
llama.cpp's DeepSeek-R1 templates read. The families that do not read it get their own form of
"off" (`close_thinking`): a generation prompt that opens `<think>` (DeepSeek-R1) is closed at
once, DeepSeek-V3.1's `thinking` variable is set, and gpt-oss gets an empty analysis message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

MODES = ("on", "off", "auto")
THINK_OPEN_TAGS = ("<think>\n", "<think>")
HARMONY_ASSISTANT = "<|start|>assistant"
HARMONY_NO_ANALYSIS = "<|channel|>analysis<|message|><|end|><|start|>assistant"
# what shows a template can think (llama-server's analysis finds a reasoning block; these are its markers)
THINKING_MARKERS = ("enable_thinking", "<think>", "<|START_THINKING|>", "<|channel|>", "reasoning_content")
_THINKING_VAR = re.compile(r"\bthinking\s+is\s+defined\b")  # DeepSeek-V3.1's `thinking` switch


class ReasoningError(ValueError):
    """A request's reasoning field of the wrong type or value (a 400 naming it)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def can_think(source: str) -> bool:
    """Whether a chat template has a thinking form (what `--reasoning auto` turns on)."""
    return any(m in source for m in THINKING_MARKERS)


@dataclass(frozen=True)
class ReasoningDefault:
    """The server's side: `--reasoning` and `--reasoning-budget` (-1: no limit; 0: end at once)."""

    mode: str = "auto"
    budget: int = -1

    def thinking(self, source: str) -> bool:
        """The server's enable_thinking for a template (llama-server's: not off, and it can think)."""
        if self.mode == "on":
            return True
        return self.mode != "off" and can_think(source) and self.budget != 0

    @property
    def explicit(self) -> bool:
        """Whether the server forces the choice (`on`/`off`, or a budget of 0) rather than leaving the template's default."""
        return self.mode != "auto" or self.budget == 0


def template_kwargs(default: ReasoningDefault, source: str, kwargs: Mapping[str, Any],
                    budget: int | None = None) -> dict[str, Any]:
    """A request's chat_template_kwargs with `enable_thinking` decided (the request's boolean, else
    the server's); `budget`: the request's reasoning_budget_tokens (0: off). The template's
    `thinking` (DeepSeek-V3.1) follows it when the choice was made explicitly.
    ReasoningError: enable_thinking that is not a boolean."""
    kw = dict(kwargs)
    given = kw.get("enable_thinking")
    if given is not None and not isinstance(given, bool):
        raise ReasoningError(f'invalid type for "enable_thinking" (expected boolean, got '
                             f'{type(given).__name__})', "chat_template_kwargs.enable_thinking")
    explicit = given is not None or default.explicit or budget == 0
    on = given if given is not None else default.thinking(source)
    if budget == 0:
        on = False
    kw["enable_thinking"] = on
    if explicit and "thinking" not in kw and _THINKING_VAR.search(source):
        kw["thinking"] = on
    return kw


def close_thinking(source: str, prompt: str, extras: Mapping[str, Any]) -> str:
    """A rendered prompt (with its generation prompt) in the template family's "off" form when
    enable_thinking is False and the template did not render one itself: a `<think>` it opened is
    closed (DeepSeek-R1), gpt-oss gets an empty analysis message before its answer."""
    if extras.get("enable_thinking") is not False:
        return prompt
    if prompt.endswith(THINK_OPEN_TAGS):
        return prompt + "</think>"
    if "<|channel|>" in source and prompt.endswith(HARMONY_ASSISTANT):
        return prompt + HARMONY_NO_ANALYSIS
    return prompt


def check_budget(value: Any, param: str) -> int | None:
    """A reasoning budget in tokens: -1 (no limit) or 0 (no thinking); None when not given.
    ReasoningError for a positive budget (Spark cannot stop thinking midway) or another value."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise ReasoningError(f"{param}: expected -1 (no limit), 0 (no thinking) or a positive count, got {value!r}",
                             param)
    if value > 0:
        raise ReasoningError(f"{param}: {value}: spark serve cannot end thinking after a number of tokens; "
                             "give -1 (no limit) or 0 (no thinking)", param)
    return value
