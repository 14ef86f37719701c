"""The OpenAI wire format: request validation, response and chunk bodies, error bodies.

Pure: no web framework, no llama_cpp. Errors follow llama-server (and OpenAI's shape):
`{"error": {"message", "type", "code", "param"}}` with `code` the HTTP status.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

MAX_STOP = 4
FINISH = {"eog": "stop", "stop": "stop", "length": "length", "context": "length", "interrupted": "stop"}


class ApiError(Exception):
    """An error answered as OpenAI-shaped JSON with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.status, "param": self.param}}


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, "unavailable_error")


# ---------------------------------------------------------------- requests


class _Strict(BaseModel):
    # NOTE: unknown fields are ignored as llama-server does (clients send many); known ones are typed strictly
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """Clients send `"temperature": null` for "not set": take the default."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str = Field(min_length=1)
    arguments: Union[str, dict] = "{}"

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, v: Union[str, dict]) -> dict:
        if isinstance(v, dict):
            return v
        try:
            obj = json.loads(v or "{}")
        except json.JSONDecodeError as e:
            raise ValueError(f"not JSON ({e})") from None
        if not isinstance(obj, dict):
            raise ValueError("must be a JSON object")
        return obj


class ToolCallIn(_Strict):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def for_template(self) -> dict[str, Any]:
        """As chat templates read a message: text content, call arguments as objects."""
        d: dict[str, Any] = {"role": self.role, "content": self.text()}
        for k in ("name", "tool_call_id", "reasoning_content"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        if self.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": c.function.arguments}}
                               for c in self.tool_calls]
        return d


class FunctionDef(_Strict):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None

    @field_validator("parameters", mode="before")
    @classmethod
    def _object_schema(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            raise ValueError(f"must be a JSON Schema object, got {type(v).__name__}")
        if v.get("type", "object") != "object":
            raise ValueError(f"must be a JSON Schema of type object (the arguments are an object), got {v['type']!r}")
        return v


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class JsonSchemaSpec(_Strict):
    name: str = "response"
    schema_: dict = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None
    schema_: dict | None = Field(None, alias="schema")  # llama-server also takes the schema here

    @model_validator(mode="after")
    def _needs_schema(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None and self.schema_ is None:
            raise ValueError("json_schema is required when type is json_schema")
        return self

    def schema(self) -> dict | None:
        if self.type == "json_object":
            return self.schema_ or {"type": "object"}
        if self.type == "json_schema":
            return self.json_schema.schema_ if self.json_schema is not None else self.schema_
        return None


TOOL_CHOICES = ("auto", "none", "required")
REASONING = ("auto", "deepseek", "none")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=(1 << 31) - 1)
    temperature: float = Field(0.8, ge=0.0, le=2.0)
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    top_k: int = Field(40, ge=0, le=(1 << 31) - 1)
    seed: int | None = Field(None, ge=-1, le=(1 << 32) - 1)  # -1: random, as llama-server
    stop: Union[str, list[str], None] = None
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=0.0, le=0.0)  # NOTE: not implemented: only 0 is accepted
    frequency_penalty: float = Field(0.0, ge=0.0, le=0.0)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: Union[str, list[str], None]) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    @property
    def stops(self) -> list[str]:
        return list(self.stop or [])

    @property
    def limit(self) -> int:
        return self.max_tokens if self.max_tokens is not None else -1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=(1 << 31) - 1)
    tools: list[Tool] | None = None
    tool_choice: Union[str, dict, None] = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    reasoning_format: str | None = None
    chat_template_kwargs: dict | None = None

    @field_validator("reasoning_format")
    @classmethod
    def _reasoning(cls, v: str | None) -> str | None:
        if v is not None and v not in REASONING:
            raise ValueError(f"must be one of {', '.join(REASONING)}, got {v!r}")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _choice(cls, c: Union[str, dict, None], info: ValidationInfo) -> Union[str, dict, None]:
        """auto | none | required | {"type": "function", "function": {"name": NAME}}, of the tools given."""
        names = [t.function.name for t in info.data.get("tools") or []]
        if isinstance(c, str) and c not in TOOL_CHOICES:
            raise ValueError(f"must be one of {', '.join(TOOL_CHOICES)} or a named function, got {c!r}")
        if isinstance(c, dict):
            fn = c.get("function")
            name = fn.get("name") if isinstance(fn, dict) else None
            if c.get("type") != "function" or not isinstance(name, str):
                raise ValueError('a named choice is {"type": "function", "function": {"name": NAME}}')
            if name not in names:
                raise ValueError(f"no tool named {name!r} in tools" + (f" (tools: {', '.join(names)})" if names else ""))
        if c == "required" and not names:
            raise ValueError("required needs tools")
        return c

    @property
    def choice(self) -> str:
        """auto | none | required | the forced function's name."""
        c = self.tool_choice
        if isinstance(c, dict):
            return c["function"]["name"]
        return c or "auto"

    def tool_dicts(self) -> list[dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    @property
    def limit(self) -> int:
        n = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return n if n is not None else -1

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]


class CompletionRequest(_Common):
    prompt: Union[str, list[str]]
    max_tokens: int | None = Field(16, ge=1, le=(1 << 31) - 1)  # OpenAI's default for completions

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Union[str, list[str]]) -> str:
        if isinstance(v, list):
            if len(v) != 1:
                raise ValueError("one prompt per request")
            v = v[0]
        if not v:
            raise ValueError("the prompt is empty")
        return v


def _is_type_tag(part: object) -> bool:
    """pydantic names the union member it tried (`content.str`, `content.list[TextPart]`)."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none") or "[" in part)


MAX_DEPTH = 64  # JSON nesting a request may have (messages[i].content[j].text is 5)
MAX_INT = (1 << 63) - 1


def _check_values(data: Any) -> None:
    """ApiError(400) for what json.loads accepts but nothing downstream can take: nesting past
    MAX_DEPTH, integers past 64 bits, strings with lone surrogates (not UTF-8)."""
    todo: list[tuple[Any, str, int]] = [(data, "body", 0)]
    while todo:
        v, where, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise ApiError(400, f"the body is nested deeper than {MAX_DEPTH} levels")
        if isinstance(v, dict):
            todo.extend((x, f"{k}" if where == "body" else f"{where}.{k}", depth + 1) for k, x in v.items())
            keys = v.keys()
        elif isinstance(v, list):
            todo.extend((x, f"{where}.{i}", depth + 1) for i, x in enumerate(v))
            keys = ()
        else:
            keys = ()
            if isinstance(v, int) and not isinstance(v, bool) and not -MAX_INT - 1 <= v <= MAX_INT:
                raise ApiError(400, f"{where}: integer out of range", param=where)
            if isinstance(v, str):
                keys = (v,)
        for text in keys:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise ApiError(400, f"{where}: a lone surrogate (an unpaired \\ud800-\\udfff escape) is not text",
                               param=where) from None


def parse(model: type[BaseModel], raw: bytes) -> Any:
    """Validate a JSON body; ApiError(400) names the first problem as `field: problem`."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, f"the body is not valid JSON: nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:  # an integer of more digits than Python converts
        raise ApiError(400, "the body is not valid JSON: an integer of more digits than it can convert "
                            f"({str(e).split(' for ', 1)[0]})") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object")
    _check_values(data)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        # NOTE: a union reports every member it tried: the deepest error is the one that names the problem
        where = [[str(p) for p in err["loc"] if not _is_type_tag(p)] for err in e.errors(include_url=False)]
        i = max(range(len(where)), key=lambda k: len(where[k]))
        err, loc = e.errors(include_url=False)[i], ".".join(where[i]) or "body"
        msg = err["msg"].removeprefix("Value error, ")
        raise ApiError(400, f"{loc}: {msg}", param=loc) from None


# ---------------------------------------------------------------- responses


@dataclass
class Usage:
    prompt_tokens: int = 0  # the whole prompt
    cached_tokens: int = 0  # of which reused from the KV cache
    completion_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


@dataclass
class Envelope:
    """What every body and chunk of one response shares."""

    chat: bool
    model: str
    id: str = ""
    created: int = 0

    def __post_init__(self) -> None:
        self.id = self.id or ("chatcmpl-" if self.chat else "cmpl-") + secrets.token_hex(12)
        self.created = self.created or int(time.time())

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, finish: str, usage: Usage) -> dict[str, Any]:
        """A whole completion (a chat's is `message`)."""
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        return {**self._base("text_completion"), "choices": [choice], "usage": usage.to_dict()}

    def message(self, content: str, reasoning: str, tool_calls: list[dict[str, Any]], finish: str,
                usage: Usage) -> dict[str, Any]:
        """A whole chat answer: content (null when only calls), reasoning_content, tool_calls."""
        msg: dict[str, Any] = {"role": "assistant", "content": content if content or not tool_calls else None}
        if reasoning:
            msg["reasoning_content"] = reasoning
        if tool_calls:
            msg["tool_calls"] = tool_calls
        choice = {"index": 0, "message": msg, "finish_reason": finish, "logprobs": None}
        return {**self._base("chat.completion"), "choices": [choice], "usage": usage.to_dict()}

    def delta(self, content: str = "", reasoning: str = "", tool_call: dict[str, Any] | None = None) -> dict[str, Any]:
        """One chat stream chunk of content, reasoning_content or a tool_calls fragment."""
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if reasoning:
            delta["reasoning_content"] = reasoning
        if tool_call is not None:
            delta["tool_calls"] = [tool_call]
        choice = {"index": 0, "delta": delta, "finish_reason": None, "logprobs": None}
        return {**self._base("chat.completion.chunk"), "choices": [choice], "usage": None}

    def chunk(self, text: str | None = None, finish: str | None = None, role: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            return {**self._base("chat.completion.chunk"), "choices": [choice], "usage": None}
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        return {**self._base("text_completion"), "choices": [choice], "usage": None}

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._base(obj), "choices": [], "usage": usage.to_dict()}


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode()
