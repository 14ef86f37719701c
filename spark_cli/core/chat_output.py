"""Model text -> an OpenAI assistant message: content, reasoning_content, tool_calls.

`OutputParser` takes the generated text piece by piece and returns `ChatDelta`s (what a
stream sends); `result()` is the sum of those deltas, so a streamed answer and a whole one are
the same by construction. Each piece re-reads the whole text (answers are short) and sends
what grew: text that may begin a marker (`</think>`, a tool-call opener) is held back until it
is sure, and a tool call goes out once it is complete.

Reasoning follows llama-server's `--reasoning-format`: `auto`/`deepseek` move `<think>...</think>`
(and gpt-oss's analysis channel) to reasoning_content, `none` leaves the text as generated.
`in_reasoning`: the prompt already opened `<think>` (Qwen3 with thinking).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from .tool_calls import H_CHANNEL, H_ENDS, H_START, ParamTypes, ToolCall, ToolFormat, harmony_messages

REASONING_FORMATS = ("auto", "deepseek", "none")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ToolCallDelta:
    index: int
    id: str | None = None  # set on a call's first delta, with its name
    name: str | None = None
    arguments: str = ""  # a fragment of the JSON text

    def to_openai(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"arguments": self.arguments}
        if self.name is not None:
            fn["name"] = self.name
        d: dict[str, Any] = {"index": self.index, "function": fn}
        if self.id is not None:
            d.update(id=self.id, type="function")
        return d


@dataclass(frozen=True)
class ChatDelta:
    content: str = ""
    reasoning_content: str = ""
    tool_call: ToolCallDelta | None = None


@dataclass
class ChatOutput:
    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


def _hold(text: str, markers: tuple[str, ...]) -> str:
    """`text` without a tail that may begin one of `markers`."""
    for n in range(min(len(text), max((len(m) for m in markers), default=0) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return text[:-n]
    return text


def split_think(text: str, final: bool, in_reasoning: bool) -> tuple[str, str]:
    """(reasoning, rest) of `<think>` output."""
    if not in_reasoning:
        lead = text.lstrip()
        if lead.startswith(THINK_OPEN):
            text = lead[len(THINK_OPEN):]
        elif not final and lead and THINK_OPEN.startswith(lead):
            return "", ""
        else:
            return "", text
    k = text.find(THINK_CLOSE)
    if k < 0:
        return (text if final else _hold(text, (THINK_CLOSE,))).lstrip(), ""
    return text[:k].lstrip(), text[k + len(THINK_CLOSE):].lstrip()


@dataclass
class OutputParser:
    """`fmt`: the model's format (gpt-oss's harmony also carries its reasoning); `tools` False:
    no tool parsing (no tools, or tool_choice none); `max_calls`: the calls kept at most (1:
    parallel_tool_calls false; None: all)."""

    fmt: ToolFormat | None = None
    tools: bool = True
    reasoning: str = "auto"
    in_reasoning: bool = False
    types: ParamTypes = field(default_factory=dict)
    max_calls: int | None = None
    text: str = ""
    _out: ChatOutput = field(default_factory=ChatOutput)

    def parse(self, text: str, final: bool) -> ChatOutput:
        if self.fmt is not None and self.fmt.name == "harmony":
            return self._parse_harmony(text, final)
        reasoning, rest = ("", text) if self.reasoning == "none" else split_think(text, final, self.in_reasoning)
        if self.fmt is None or not self.tools:
            return ChatOutput(rest, reasoning)
        j = rest.find(self.fmt.start)
        if j < 0:
            return ChatOutput(rest if final else _hold(rest, (self.fmt.start,)), reasoning)
        calls, leftover = self.fmt.parse(rest[j:], final, self.types)
        return ChatOutput(rest[:j] + (leftover if final else ""), reasoning, calls)

    def _parse_harmony(self, text: str, final: bool) -> ChatOutput:
        out = ChatOutput()
        msgs = harmony_messages(text)
        for m in msgs:
            body = m.body if final or m is not msgs[-1] else _hold(m.body, (*H_ENDS, H_START, H_CHANNEL))
            if m.recipient and self.tools:
                continue
            if m.channel == "analysis" and self.reasoning != "none":
                out.reasoning_content += body
            else:
                out.content += body
        if self.tools and self.fmt is not None:
            out.tool_calls = self.fmt.parse(text, final, self.types)[0]
        return out

    # -- streaming -------------------------------------------------------------------------

    def feed(self, piece: str) -> list[ChatDelta]:
        self.text += piece
        return self._grow(self.parse(self.text, final=False))

    def finish(self) -> list[ChatDelta]:
        return self._grow(self.parse(self.text, final=True))

    def result(self) -> ChatOutput:
        return ChatOutput(self._out.content, self._out.reasoning_content, list(self._out.tool_calls))

    def _grow(self, now: ChatOutput) -> list[ChatDelta]:
        out, sent = [], self._out
        if len(now.reasoning_content) > len(sent.reasoning_content) and now.reasoning_content.startswith(
                sent.reasoning_content):
            out.append(ChatDelta(reasoning_content=now.reasoning_content[len(sent.reasoning_content):]))
            sent.reasoning_content = now.reasoning_content
        if len(now.content) > len(sent.content) and now.content.startswith(sent.content):
            out.append(ChatDelta(content=now.content[len(sent.content):]))
            sent.content = now.content
        n_calls = len(now.tool_calls) if self.max_calls is None else min(self.max_calls, len(now.tool_calls))
        for i in range(len(sent.tool_calls), n_calls):
            c = now.tool_calls[i]
            call = ToolCall(c.name, c.arguments, "call_" + secrets.token_hex(12))
            sent.tool_calls.append(call)
            out.append(ChatDelta(tool_call=ToolCallDelta(i, call.id, call.name, "")))
            out.append(ChatDelta(tool_call=ToolCallDelta(i, arguments=call.arguments)))
        return out


def join(deltas: list[ChatDelta]) -> ChatOutput:
    """What a client assembles from a stream's deltas."""
    out = ChatOutput()
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        out.content += d.content
        out.reasoning_content += d.reasoning_content
        if d.tool_call is not None:
            c = calls.setdefault(d.tool_call.index, {"id": "", "name": "", "arguments": ""})
            c["id"] = d.tool_call.id or c["id"]
            c["name"] = d.tool_call.name or c["name"]
            c["arguments"] += d.tool_call.arguments
    out.tool_calls = [ToolCall(c["name"], c["arguments"], c["id"]) for _, c in sorted(calls.items())]
    return out
