"""Anthropic's Messages API as a translation to and from the OpenAI chat shape (pure: no web
framework, no engine).

Requests: `parse(MessagesRequest | CountRequest, raw)` (protocol.parse: `field: problem`), then
`to_chat(req)`: the OpenAI chat request body that `protocol.ChatRequest` validates (system ->
a system message; text blocks -> text parts; `tool_use` -> assistant `tool_calls`; `tool_result`
-> `role: "tool"` messages; thinking -> `reasoning_content`; tools, tool_choice, stop).

Results, read from the OpenAI side (the only fields this module reads): `choices[0].message`
.content / .reasoning_content / .tool_calls[].{id, function.name, function.arguments} and
`finish_reason`, `usage.prompt_tokens/completion_tokens`; in chunks the same under `delta`,
tool calls with their `index`. `to_message(body, stop_sequence)` is the Message;
`EventStream` turns chunks into the event sequence (message_start, content_block_start /
_delta / _stop, message_delta, message_stop). Errors: `error_body`, `error_status`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Union

from pydantic import Field, ValidationInfo, field_validator, model_validator

from .protocol import MAX_STOP, ApiError, Strict, new_id, warn

MESSAGES_PATH = "/v1/messages"

# ---------------------------------------------------------------- requests


class TextBlock(Strict):
    type: Literal["text"]
    text: str


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: Union[str, list[TextBlock], None] = None
    is_error: bool = False


class ThinkingBlock(Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(Strict):
    type: Literal["redacted_thinking"]
    data: str = ""


Block = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock],
                  Field(discriminator="type")]
ALLOWED_BLOCKS = {"user": ("text", "tool_result"), "system": ("text",),
                  "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}


class Message(Strict):
    # NOTE: a system message inside messages (Claude Code's mid-conversation-system beta) stands
    # where it is sent, as llama-server passes it to the template
    role: Literal["user", "assistant", "system"]
    content: Union[str, list[Block]]

    @model_validator(mode="after")
    def _blocks_fit_the_role(self) -> "Message":
        allowed = ALLOWED_BLOCKS[self.role]
        for i, b in enumerate(self.content if isinstance(self.content, list) else ()):
            if b.type not in allowed:
                raise ValueError(f"content.{i}: a {b.type} block is not allowed in a {self.role} message")
        return self


class Tool(Strict):
    type: str | None = None  # None or "custom": a client tool; any other: a server tool (web_search_..., skipped)
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _client_tool_has_a_schema(self) -> "Tool":
        if self.is_client and self.input_schema is None:
            raise ValueError("input_schema: required (a client tool's arguments are an object)")
        return self

    @property
    def is_client(self) -> bool:
        """A tool the client runs (the model's calls come back to it); the others run on Anthropic's servers."""
        return self.type in (None, "custom")


class ToolChoice(Strict):
    type: Literal["auto", "any", "none", "tool"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named(self) -> "ToolChoice":
        if self.type == "tool" and not self.name:
            raise ValueError('name: required when type is "tool"')
        return self


class Thinking(Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=0, le=(1 << 31) - 1)


class OutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


EFFORTS = ("low", "medium", "high")  # what templates read as reasoning_effort (gpt-oss); others are not passed


class OutputConfig(Strict):
    effort: str | None = None
    format: OutputFormat | None = None


class CountRequest(Strict):
    """The body of /v1/messages/count_tokens (and what a message request has besides). Fields
    not named here are accepted and ignored (metadata, context_management, service_tier,
    cache_control on blocks, ...), as llama-server ignores what it does not use."""

    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    system: Union[str, list[TextBlock], None] = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None

    @field_validator("messages")
    @classmethod
    def _with_content(cls, v: list[Message]) -> list[Message]:
        """No message without content, but a last assistant one (an empty prefill), as Anthropic's."""
        for i, m in enumerate(v):
            if m.content == [] and not (i == len(v) - 1 and m.role == "assistant"):
                raise ApiError(400, f"messages.{i}.content: empty; a message needs at least one content block "
                                    "or a text", param=f"messages.{i}.content")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _any_needs_tools(cls, c: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
        if c is not None and c.type == "any" and not any(t.is_client for t in info.data.get("tools") or ()):
            raise ValueError('"any" needs tools the model can call (the request has none)')
        return c

    def client_tools(self) -> list[tuple[int, Tool]]:
        """The tools the model may call, with their index in `tools`: server tools (web search,
        code execution, ...) are skipped, as llama-server skips what is not a function, unless
        tool_choice names one (then it is refused: spark serve runs none)."""
        named = self.tool_choice.name if self.tool_choice and self.tool_choice.type == "tool" else None
        kept = []
        for i, t in enumerate(self.tools or ()):
            if t.is_client:
                kept.append((i, t))
            elif t.name == named:
                raise ApiError(400, f"tools.{i}.type: {t.type!r} is a server tool, which spark serve does not run "
                                    "(tool_choice names it)", param=f"tools.{i}.type")
            else:
                warn(f"tools.{i}: {t.name!r} ({t.type}) skipped: spark serve runs no server tools")
        return kept


class MessagesRequest(CountRequest):
    max_tokens: int = Field(ge=1, le=(1 << 31) - 1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=(1 << 31) - 1)
    stream: bool = False
    metadata: dict[str, Any] | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, v: list[str] | None) -> list[str] | None:
        if v and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if v and any(not s for s in v):
            raise ValueError("stop sequences must not be empty")
        return v


def _parts(content: Union[str, list[TextBlock], None]) -> Union[str, list[dict[str, str]]]:
    if content is None:
        return ""
    return content if isinstance(content, str) else [{"type": "text", "text": b.text} for b in content]


def _tool_message(b: ToolResultBlock) -> dict[str, Any]:
    content = _parts(b.content)
    if b.is_error:  # NOTE: OpenAI has no error flag: the model reads it
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        parts = parts or [{"type": "text", "text": ""}]
        content = [{"type": "text", "text": "Error: " + parts[0]["text"]}, *parts[1:]]
    return {"role": "tool", "tool_call_id": b.tool_use_id, "content": content}


def _user(m: Message) -> list[dict[str, Any]]:
    if isinstance(m.content, str):
        return [{"role": "user", "content": m.content}]
    out: list[dict[str, Any]] = []
    for b in m.content:
        if isinstance(b, ToolResultBlock):
            out.append(_tool_message(b))
        elif out and out[-1]["role"] == "user":  # consecutive text blocks: one message
            out[-1]["content"].append({"type": "text", "text": b.text})
        else:
            out.append({"role": "user", "content": [{"type": "text", "text": b.text}]})
    return out


def _assistant(m: Message) -> list[dict[str, Any]]:
    if isinstance(m.content, str):
        return [{"role": "assistant", "content": m.content}]
    msg: dict[str, Any] = {"role": "assistant", "content": [{"type": "text", "text": b.text}
                                                            for b in m.content if isinstance(b, TextBlock)]}
    thinking = "".join(b.thinking for b in m.content if isinstance(b, ThinkingBlock))
    if thinking:
        msg["reasoning_content"] = thinking
    calls = [{"id": b.id, "type": "function",
              "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
             for b in m.content if isinstance(b, ToolUseBlock)]
    if calls:
        msg["tool_calls"] = calls
        if not msg["content"]:
            msg["content"] = None
    return [msg]


def _system(m: Message) -> dict[str, Any]:
    text = m.content if isinstance(m.content, str) else "".join(b.text for b in m.content)
    return {"role": "system", "content": text}


def _translate(m: Message) -> list[dict[str, Any]]:
    """The OpenAI messages one Anthropic message becomes."""
    return {"user": _user, "assistant": _assistant, "system": lambda x: [_system(x)]}[m.role](m)


def _tool_choice(c: ToolChoice) -> Union[str, dict[str, Any]]:
    if c.type == "tool":
        return {"type": "function", "function": {"name": c.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[c.type]


def to_chat(req: CountRequest) -> dict[str, Any]:
    """The OpenAI chat request body that asks the same of the model."""
    messages: list[dict[str, Any]] = []
    if req.system:
        # NOTE: llama-server joins the system blocks as they are (a message's parts join with newlines)
        system = req.system if isinstance(req.system, str) else "".join(b.text for b in req.system)
        messages.append({"role": "system", "content": system})
    for m in req.messages:
        messages += _translate(m)
    body: dict[str, Any] = {"messages": messages, "model": req.model}
    tools = req.client_tools()
    if tools:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, **({"description": t.description} if t.description else {}),
            "parameters": t.input_schema}} for _, t in tools]
    if req.tool_choice and (tools or req.tool_choice.type not in ("auto", "none")):
        body["tool_choice"] = _tool_choice(req.tool_choice)
        if req.tool_choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    if req.thinking:
        body["chat_template_kwargs"] = {"enable_thinking": req.thinking.type != "disabled"}
    out = req.output_config
    if out is not None and out.effort in EFFORTS:
        body["reasoning_effort"] = out.effort
    if out is not None and out.format is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"schema": out.format.schema_}}
    if isinstance(req, MessagesRequest):
        body.update(max_tokens=req.max_tokens, stop=req.stop_sequences, temperature=req.temperature,
                    top_p=req.top_p, top_k=req.top_k)
    return {k: v for k, v in body.items() if v is not None}


# the chat request's fields as a Messages request spells them
CHAT_NAMES = {"stop": "stop_sequences", "response_format": "output_config.format",
              "reasoning_effort": "output_config.effort", "chat_template_kwargs": "thinking"}


def anthropic_param(param: str, req: CountRequest) -> str:
    """Where in the Messages request a chat request's field came from: `tools.2.function.parameters.x`
    is `tools.N.input_schema.x` (N counting the skipped server tools), `messages.3.content` the
    Anthropic message (or `system`) it was translated from."""
    head, _, rest = param.partition(".")
    index, _, rest = rest.partition(".")
    if head == "tools" and index.isdigit():
        kept = req.client_tools()
        where = f"tools.{kept[int(index)][0]}" if int(index) < len(kept) else "tools"
        fields = {"function.parameters": "input_schema", "function.name": "name",
                  "function.description": "description", "function": ""}
        for old, new in fields.items():
            if rest == old or rest.startswith(old + "."):
                return ".".join(p for p in (where, new + rest[len(old):]) if p)
        return where
    if head == "messages" and index.isdigit():
        origins = (["system"] if req.system else []) + [f"messages.{i}" for i, m in enumerate(req.messages)
                                                        for _ in _translate(m)]
        return origins[int(index)] if int(index) < len(origins) else "messages"
    return CHAT_NAMES.get(head, head) + (f".{index}" if index else "") + (f".{rest}" if rest else "")


def matched_stop(stop_word: str | None, req: MessagesRequest) -> str | None:
    """The client's stop sequence that ended the answer (not one the server added)."""
    return stop_word if stop_word is not None and stop_word in (req.stop_sequences or ()) else None


# ---------------------------------------------------------------- results


def tool_use_id(openai_id: str | None) -> str:
    """Anthropic's `toolu_` ids; the same OpenAI id maps to the same one (streamed or not)."""
    if not openai_id:
        return new_id("toolu_")
    return openai_id if openai_id.startswith("toolu_") else "toolu_" + openai_id


def tool_input(arguments: str | None) -> dict[str, Any]:
    """A tool call's arguments (a JSON string) as the block's input object ({} if not an object)."""
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_reason(finish: str | None, stop_sequence: str | None) -> str:
    if finish == "tool_calls":
        return "tool_use"
    if finish == "length":
        return "max_tokens"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def _usage(input_tokens: int, output_tokens: int) -> dict[str, int]:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens}


def to_message(body: dict[str, Any], stop_sequence: str | None = None, id: str | None = None) -> dict[str, Any]:
    """An OpenAI `chat.completion` body as an Anthropic Message."""
    choice = body["choices"][0]
    msg = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    if msg.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""})
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for call in msg.get("tool_calls") or ():
        fn = call.get("function") or {}
        content.append({"type": "tool_use", "id": tool_use_id(call.get("id")), "name": fn.get("name", ""),
                        "input": tool_input(fn.get("arguments"))})
    usage = body.get("usage") or {}
    return {"id": id or new_id("msg_"), "type": "message", "role": "assistant", "model": body.get("model", ""),
            "content": content, "stop_reason": stop_reason(choice.get("finish_reason"), stop_sequence),
            "stop_sequence": stop_sequence,
            "usage": _usage(usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0))}


_EMPTY = {"text": {"type": "text", "text": ""}, "thinking": {"type": "thinking", "thinking": "", "signature": ""}}


@dataclass
class EventStream:
    """OpenAI chunks in, Anthropic events out: `start()`, `feed(chunk)` for each, `end(stop_sequence)`."""

    model: str
    input_tokens: int
    id: str = field(default_factory=lambda: new_id("msg_"))
    finish: str | None = None
    output_tokens: int = 0
    _index: int = -1
    _open: str | None = None  # the open block's kind: text | thinking | tool_use
    _tool: int | None = None  # the OpenAI index of the open tool call

    def start(self) -> list[dict[str, Any]]:
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": _usage(self.input_tokens, 0)}
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def _close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        self._open, self._tool = None, None
        return [{"type": "content_block_stop", "index": self._index}]

    def _block(self, kind: str, block: dict[str, Any]) -> list[dict[str, Any]]:
        out = self._close()
        self._index += 1
        self._open = kind
        return out + [{"type": "content_block_start", "index": self._index, "content_block": block}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self._index, "delta": delta}

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if chunk.get("usage"):
            self.output_tokens = chunk["usage"].get("completion_tokens", 0)
        for choice in chunk.get("choices") or ():
            d = choice.get("delta") or {}
            for kind, key, delta_type in (("thinking", "reasoning_content", "thinking_delta"),
                                          ("text", "content", "text_delta")):
                if d.get(key):
                    if self._open != kind:
                        out += self._block(kind, dict(_EMPTY[kind]))
                    out.append(self._delta({"type": delta_type, kind: d[key]}))
            for call in d.get("tool_calls") or ():
                fn = call.get("function") or {}
                index = call.get("index", 0)
                if self._open != "tool_use" or self._tool != index:
                    out += self._block("tool_use", {"type": "tool_use", "id": tool_use_id(call.get("id")),
                                                    "name": fn.get("name", ""), "input": {}})
                    self._tool = index
                if fn.get("arguments"):
                    out.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return out

    def end(self, stop_sequence: str | None = None) -> list[dict[str, Any]]:
        delta = {"stop_reason": stop_reason(self.finish, stop_sequence), "stop_sequence": stop_sequence}
        return self._close() + [{"type": "message_delta", "delta": delta, "usage": {"output_tokens": self.output_tokens}},
                                {"type": "message_stop"}]


# ---------------------------------------------------------------- errors

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}
OVERLOADED = 529  # Anthropic's status for overloaded_error: Spark's 503s (loading, queue full, shutting down)


def is_messages_path(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def error_status(status: int) -> int:
    return OVERLOADED if status == 503 else status


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape; `status` is Spark's (503 becomes overloaded_error)."""
    status = error_status(status)
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}
