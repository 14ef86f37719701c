"""OpenAI's Responses API (`POST /v1/responses`) as a translation to and from the OpenAI chat
shape, as llama-server serves it (pure: no web framework, no engine).

Requests: `parse(ResponsesRequest, raw)`, then `chat_request(req)`: the `protocol.ChatRequest` that
asks the same of the model (`to_chat` builds its body). `instructions` is a system message first;
`input` a string is one user message, a list is items: messages (user, system, developer with
`input_text` parts; assistant with `output_text` / `refusal` parts), `function_call` (the
assistant's tool_calls), `function_call_output` (role tool), `reasoning` (reasoning_content);
consecutive assistant items are one assistant message, as llama-server merges them. Function
`tools` (the others: namespace, web_search, file search, MCP, ... skipped with a warning, as
llama-server skips them, unless tool_choice names one); `tool_choice` (auto, none, required,
{"type": "function", "name"}); `text.format` -> response_format; `reasoning.effort` ->
reasoning_effort (`reasoning.summary` accepted: Spark writes no summaries); `max_output_tokens` ->
max_tokens; `include` accepted (the reasoning is its own item whenever the model reasons;
encrypted_content and the other extras are left out); every other field goes on as it is
(temperature, top_p, stream, and llama-server's own: top_k, seed, timings_per_token, ...), so the
chat endpoint's checks and refusals apply, and what it ignores is ignored (store,
prompt_cache_key, client_metadata, ...). What Spark cannot do is a 400 naming it: STATEFUL
(previous_response_id, conversation: nothing is stored), REFUSED (background, logprobs,
truncation, ...), images and files, text verbosity, item references. A reasoning item sent back
without its text (only a summary or encrypted_content) is left out of the prompt.

Results, read from the OpenAI chat side: `to_response(body, ids)` is the `response` object (output:
a `reasoning` item, a `message` item with one `output_text` part, a `function_call` item per call;
usage in input/output tokens), `EventStream` turns chat chunks into the Responses events
(response.created, response.in_progress, response.output_item.added, response.content_part.added,
response.output_text.delta / response.reasoning_text.delta / response.function_call_arguments.delta,
then each item's .done events and response.completed with `timings` beside the response, as
llama-server's). The events carry OpenAI's sequence_number, output_index and content_index too
(the official client's stream helper needs them). As llama-server's, status is "completed" also
when max_output_tokens cut the answer (OpenAI says "incomplete"), and nothing is stored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from pydantic import ConfigDict, Field, field_validator, model_validator

from .protocol import ApiError, ChatRequest, Strict, new_id, parse, refuse_unsupported, warn

RESPONSES_PATHS = ("/v1/responses", "/responses")

# Fields of a Responses request that Spark does not implement, with the values that ask for
# nothing (accepted); any other value is a 400 naming the field. `logprobs` is the chat field: the
# Responses output here carries none.
REFUSED: dict[str, tuple[Any, ...]] = {
    "background": (False,), "truncation": ("disabled",), "max_tool_calls": (), "prompt": (), "top_logprobs": (0,),
    "logprobs": (False,),
}
# `include` asks for extras: the reasoning is its own item whenever the model reasons (its text:
# reasoning.encrypted_content is left out, Spark encrypts nothing); the others are left out too
INCLUDE = "include"
STATEFUL = ("previous_response_id", "conversation")  # refused: nothing is stored
NO_STATE = "spark serve stores no responses (send the whole conversation in input)"


def _bad(where: str, problem: str) -> ApiError:
    return ApiError(400, f"{where}: {problem}", param=where)


# ---------------------------------------------------------------- requests


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None

    @model_validator(mode="after")
    def _needs_schema(self) -> "TextFormat":
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("schema is required when type is json_schema")
        return self

    def response_format(self) -> dict[str, Any] | None:
        """The chat request's response_format (None: plain text)."""
        if self.type == "json_schema":
            return {"type": "json_schema", "json_schema": {"name": self.name, "schema": self.schema_,
                                                           "strict": self.strict}}
        return {"type": "json_object"} if self.type == "json_object" else None


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: str | None = None

    @field_validator("verbosity")
    @classmethod
    def _verbosity(cls, v: str | None) -> str | None:
        if v is not None:
            raise ValueError("not supported by spark serve (the model answers at its own length)")
        return v


class ReasoningConfig(Strict):
    effort: str | None = Field(None, min_length=1)
    # NOTE: accepted, as llama-server accepts them: Spark writes no summaries (the reasoning itself
    # is the reasoning item's content)
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(Strict):
    """The Responses fields translated here; the others are kept (model_extra) for the chat request."""

    model_config = ConfigDict(extra="allow", strict=True)

    input: Union[str, list[dict]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=(1 << 31) - 1)
    tools: list[dict] | None = None
    tool_choice: Union[str, dict, None] = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, data: Any) -> Any:
        for name in STATEFUL:
            if isinstance(data, dict) and data.get(name):  # NOTE: "" or null asks for nothing
                raise _bad(name, NO_STATE)
        refuse_unsupported(data, REFUSED)
        if isinstance(data, dict) and "messages" in data:
            raise _bad("messages", "/v1/responses takes input (messages is /v1/chat/completions' field)")
        return data


def _string(item: dict, key: str, where: str) -> str:
    v = item.get(key)
    if not isinstance(v, str):
        raise _bad(f"{where}.{key}", "required, a string")
    return v


UNREAD_INPUT = {"input_image": "spark serve serves no vision model", "input_file": "spark serve reads no files"}


def _input_parts(content: Any, where: str) -> Union[str, list[dict[str, str]]]:
    """A user, system or developer message's content (or a tool's output): text or input_text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, "a string or a list of input_text parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in UNREAD_INPUT:
            raise _bad(f"{where}.{j}.type", f"{kind}: {UNREAD_INPUT[kind]}")
        if kind != "input_text":
            raise _bad(f"{where}.{j}.type", "must be one of input_text, input_image, input_file")
        parts.append({"type": "text", "text": _string(part, "text", f"{where}.{j}")})
    return parts


def _output_parts(content: Any, where: str) -> list[dict[str, str]]:
    """An assistant message's content: output_text (or input_text) and refusal parts, as text."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _bad(where, "a string or a list of output_text parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("output_text", "input_text", "refusal"):
            raise _bad(f"{where}.{j}.type", "must be one of output_text, refusal")
        key = "refusal" if kind == "refusal" else "text"
        parts.append({"type": "text", "text": _string(part, key, f"{where}.{j}")})
    return parts


def _assistant(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message an assistant item adds to: the last one, or a new one."""
    if not messages or messages[-1]["role"] != "assistant":
        messages.append({"role": "assistant", "content": []})
    return messages[-1]


def _call(item: dict, where: str) -> dict[str, Any]:
    arguments = _string(item, "arguments", where)
    try:
        ok = isinstance(json.loads(arguments or "{}"), dict)
    except json.JSONDecodeError:
        ok = False
    if not ok:
        raise _bad(f"{where}.arguments", "must be the JSON text of an object")
    return {"id": _string(item, "call_id", where), "type": "function",
            "function": {"name": _string(item, "name", where), "arguments": arguments}}


def _reasoning_text(item: dict) -> str:
    """A reasoning item's text ("" when it has only a summary or encrypted_content, which a
    client sends back as it got it: the model's past reasoning is then left out)."""
    content = item.get("content")
    texts = [p.get("text") for p in content if isinstance(p, dict)] if isinstance(content, list) else []
    return "".join(t for t in texts if isinstance(t, str))


def _add_item(messages: list[dict[str, Any]], item: Any, where: str) -> None:
    if not isinstance(item, dict):
        raise _bad(where, "an item is an object")
    kind, role = item.get("type"), item.get("role")
    if kind in (None, "message") and role in ("user", "system", "developer"):
        messages.append({"role": role, "content": _input_parts(item.get("content"), where + ".content")})
    elif kind in (None, "message") and role == "assistant":
        _assistant(messages)["content"] += _output_parts(item.get("content"), where + ".content")
    elif kind == "function_call":
        _assistant(messages).setdefault("tool_calls", []).append(_call(item, where))
    elif kind == "function_call_output":
        messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                         "content": _input_parts(item.get("output"), where + ".output")})
    elif kind == "reasoning" and _reasoning_text(item):
        msg = _assistant(messages)
        msg["reasoning_content"] = msg.get("reasoning_content", "") + _reasoning_text(item)
    elif kind == "reasoning":
        pass
    elif kind == "item_reference":
        raise _bad(f"{where}.type", f"item_reference: {NO_STATE}")
    elif kind is not None:
        raise _bad(f"{where}.type", f"{kind!r} items are not supported by spark serve (messages, function_call, "
                                    "function_call_output and reasoning are)")
    elif role is not None:
        raise _bad(f"{where}.role", "must be one of user, system, developer, assistant")
    else:
        raise _bad(where, "cannot tell the item's kind (a message has a role and content; other items a type)")


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if req.instructions is not None:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
    for i, item in enumerate(req.input if isinstance(req.input, list) else ()):
        _add_item(messages, item, f"input.{i}")
    if not messages:
        raise _bad("input", "empty (give a message, or instructions)")
    return messages


def function_tools(req: "ResponsesRequest") -> list[tuple[int, dict]]:
    """The function tools, with their index in `tools`: the others (namespace, web_search, file
    search, MCP, ...) are skipped with a warning, as llama-server skips them, unless tool_choice
    names one (then a 400: spark serve runs no hosted tools)."""
    choice = req.tool_choice if isinstance(req.tool_choice, dict) else {}
    kept = []
    for i, tool in enumerate(req.tools or ()):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            kept.append((i, tool))
        elif choice and (choice.get("type") == kind or choice.get("name") == tool.get("name")):
            raise _bad(f"tools.{i}.type", f"{kind!r} tools are not supported by spark serve (tool_choice names it; "
                                          "it runs no hosted tools: function tools are answered as calls)")
        else:
            warn(f"tools.{i}: a {kind!r} tool skipped: spark serve runs no hosted tools")
    return kept


def _tool(tool: dict) -> dict[str, Any]:
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def _tool_choice(choice: Union[str, dict]) -> Union[str, dict[str, Any]]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad("tool_choice", 'one of auto, none, required or {"type": "function", "name": NAME} (spark serve '
                              "runs no hosted tools)")


def to_chat(req: ResponsesRequest) -> dict[str, Any]:
    """The OpenAI chat request body that asks the same of the model."""
    extra = {k: v for k, v in (req.model_extra or {}).items() if k != INCLUDE}
    body: dict[str, Any] = {**extra, "messages": _messages(req), "stream": req.stream}
    tools = function_tools(req)
    if tools:
        body["tools"] = [_tool(t) for _, t in tools]
    if req.tool_choice is not None:
        body["tool_choice"] = _tool_choice(req.tool_choice)
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.response_format() is not None:
        body["response_format"] = fmt.response_format()
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["reasoning_effort"] = req.reasoning.effort
    return body


def responses_name(param: str, req: ResponsesRequest) -> str:
    """A chat field's name as the Responses request spells it (`tools.N` counting the skipped tools)."""
    head, _, rest = param.partition(".")
    index, _, tail = rest.partition(".")
    if head == "tools" and index.isdigit():
        kept = function_tools(req)
        where = f"tools.{kept[int(index)][0]}" if int(index) < len(kept) else "tools"
        tail = tail.removeprefix("function").removeprefix(".")
        return where + (f".{tail}" if tail else "")
    renamed = {"max_tokens": "max_output_tokens" if req.max_output_tokens is not None else "max_tokens",
               "response_format": "text.format", "reasoning_effort": "reasoning.effort"}.get(head, head)
    return renamed + ("." + rest if rest else "")


def chat_request(req: ResponsesRequest) -> ChatRequest:
    """The chat request; its refusals name the Responses fields they came from."""
    try:
        return parse(ChatRequest, json.dumps(to_chat(req)).encode())
    except ApiError as e:
        raise e.renamed(lambda param: responses_name(param, req)) from None


# ---------------------------------------------------------------- results


@dataclass(frozen=True)
class Ids:
    """One response's ids: the response's, its message item's and its reasoning item's."""

    response: str = field(default_factory=lambda: new_id("resp_"))
    message: str = field(default_factory=lambda: new_id("msg_"))
    reasoning: str = field(default_factory=lambda: new_id("rs_"))


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "annotations": [], "logprobs": [], "text": text}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [output_text(text)] if status == "completed" else []
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    """A function_call item: its call_id is the chat call's id (call_...), its id fc_ and the same digits."""
    return {"id": "fc_" + call_id.removeprefix("call_"), "type": "function_call", "status": status,
            "call_id": call_id, "name": name, "arguments": arguments}


def usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    n_in, n_out = chat_usage.get("prompt_tokens", 0), chat_usage.get("completion_tokens", 0)
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": n_in, "output_tokens": n_out, "total_tokens": n_in + n_out,
            "input_tokens_details": {"cached_tokens": cached}}


def response_object(ids: Ids, model: str, created: int, status: str, output: list[dict[str, Any]],
                    used: dict[str, Any] | None = None, completed: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"id": ids.response, "object": "response", "created_at": created, "status": status,
                            "model": model, "output": output, "usage": used}
    if completed is not None:
        body["completed_at"] = completed
    return body


def to_response(body: dict[str, Any], ids: Ids, completed: int) -> dict[str, Any]:
    """An OpenAI `chat.completion` body as a Responses `response`."""
    msg = body["choices"][0].get("message") or {}
    output = []
    if msg.get("reasoning_content"):
        output.append(reasoning_item(ids.reasoning, msg["reasoning_content"]))
    if msg.get("content"):
        output.append(message_item(ids.message, msg["content"]))
    for call in msg.get("tool_calls") or ():
        fn = call.get("function") or {}
        output.append(call_item(call.get("id") or new_id("call_"), fn.get("name", ""), fn.get("arguments", "")))
    return response_object(ids, body.get("model", ""), body.get("created", completed), "completed", output,
                           usage(body.get("usage") or {}), completed)


@dataclass
class _Item:
    """An output item being streamed: reasoning | message | function_call, and its text so far
    (the reasoning, the content or the arguments)."""

    kind: str
    id: str
    index: int
    text: str = ""
    name: str = ""  # a call's
    call_id: str = ""  # a call's: the chat call's id

    def json(self, status: str) -> dict[str, Any]:
        if self.kind == "message":
            return message_item(self.id, self.text, status)
        if self.kind == "reasoning":
            return reasoning_item(self.id, self.text, status)
        return call_item(self.call_id, self.name, self.text if status == "completed" else "", status)


@dataclass
class EventStream:
    """OpenAI chat chunks in, Responses events out: `start()`, `feed(chunk)` for each (the chunks of
    `Run.chunks(include_usage=True)`), `end()`; `error(e)` when the run fails."""

    model: str
    created: int
    ids: Ids = field(default_factory=Ids)
    items: list[_Item] = field(default_factory=list)
    used: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, Any] | None = None  # the final timings, beside response.completed
    _seq: int = 0
    _calls: dict[int, _Item] = field(default_factory=dict)  # by the chat call's index

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return ev

    def _response(self, status: str, completed: int | None = None) -> dict[str, Any]:
        output = [i.json(status) for i in self.items] if status == "completed" else []
        return response_object(self.ids, self.model, self.created, status, output,
                               usage(self.used) if status == "completed" else None, completed)

    def start(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self._response("in_progress")),
                self._event("response.in_progress", response=self._response("in_progress"))]

    def progress(self, prompt_progress: dict[str, Any]) -> dict[str, Any]:
        """The hook for llama-server's `return_progress`: a chunk that reports how far the prompt is
        (its `prompt_progress`: total, cache, processed, time_ms) is a response.in_progress event
        carrying it (and the chunk's timings, which feed() puts on it)."""
        return {**self._event("response.in_progress", response=self._response("in_progress")),
                "prompt_progress": prompt_progress}

    def _open(self, kind: str, item_id: str, call_id: str = "", name: str = "") -> tuple[_Item, list[dict[str, Any]]]:
        item = _Item(kind, item_id, len(self.items), name=name, call_id=call_id)
        self.items.append(item)
        out = [self._event("response.output_item.added", output_index=item.index, item=item.json("in_progress"))]
        if kind == "message":
            out.append(self._event("response.content_part.added", item_id=item.id, output_index=item.index,
                                   content_index=0, part=output_text("")))
        return item, out

    def _text(self, kind: str, delta: str) -> list[dict[str, Any]]:
        item = next((i for i in self.items if i.kind == kind), None)
        out: list[dict[str, Any]] = []
        if item is None:
            item, out = self._open(kind, self.ids.message if kind == "message" else self.ids.reasoning)
        item.text += delta
        extra = {"logprobs": []} if kind == "message" else {}
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        return out + [self._event(name, item_id=item.id, output_index=item.index, content_index=0, delta=delta,
                                  **extra)]

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        fn = call.get("function") or {}
        out: list[dict[str, Any]] = []
        item = self._calls.get(call.get("index", 0))
        if item is None:
            call_id = call.get("id") or new_id("call_")
            item, out = self._open("function_call", call_item(call_id, "", "")["id"], call_id, fn.get("name", ""))
            self._calls[call.get("index", 0)] = item
        if fn.get("arguments"):
            item.text += fn["arguments"]
            out.append(self._event("response.function_call_arguments.delta", item_id=item.id, output_index=item.index,
                                   delta=fn["arguments"]))
        return out

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        out = [self.progress(chunk["prompt_progress"])] if "prompt_progress" in chunk else []
        for choice in chunk.get("choices") or ():
            d = choice.get("delta") or {}
            if d.get("reasoning_content"):
                out += self._text("reasoning", d["reasoning_content"])
            if d.get("content"):
                out += self._text("message", d["content"])
            for call in d.get("tool_calls") or ():
                out += self._call(call)
        if chunk.get("usage"):
            self.used, self.timings = chunk["usage"], chunk.get("timings", self.timings)
        elif "timings" in chunk and out:  # timings_per_token: on the last event, as llama-server's
            out[-1]["timings"] = chunk["timings"]
        return out

    def _done(self, item: _Item) -> list[dict[str, Any]]:
        where = {"item_id": item.id, "output_index": item.index}
        if item.kind == "message":
            out = [self._event("response.output_text.done", **where, content_index=0, text=item.text, logprobs=[]),
                   self._event("response.content_part.done", **where, content_index=0, part=output_text(item.text))]
        elif item.kind == "reasoning":
            out = [self._event("response.reasoning_text.done", **where, content_index=0, text=item.text)]
        else:
            out = [self._event("response.function_call_arguments.done", **where, name=item.name,
                               arguments=item.text)]
        return out + [self._event("response.output_item.done", output_index=item.index, item=item.json("completed"))]

    def end(self, completed: int) -> list[dict[str, Any]]:
        out = [ev for item in self.items for ev in self._done(item)]
        done = self._event("response.completed", response=self._response("completed", completed))
        if self.timings is not None:
            done["timings"] = self.timings
        return out + [done]

    def error(self, e: ApiError) -> dict[str, Any]:
        """OpenAI's stream error event."""
        return self._event("error", code=e.type, message=e.message, param=e.param)
