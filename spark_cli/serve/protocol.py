"""The OpenAI wire format: request validation, response and chunk bodies, error bodies.

Pure: no web framework, no llama_cpp. Errors follow llama-server (and OpenAI's shape):
`{"error": {"message", "type", "code", "param"}}` with `code` the HTTP status.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import time
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Literal, Union

from pydantic import (AliasChoices, BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator,
                      model_validator)

MAX_STOP = 4
MAX_CHOICES = 128  # n at most (OpenAI's bound)
FINISH = {"eog": "stop", "stop": "stop", "length": "length", "context": "length", "interrupted": "stop"}


class ApiError(Exception):
    """An error answered as OpenAI-shaped JSON with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 extra: dict[str, Any] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.extra = dict(extra or {})  # more fields of the error object (n_prompt_tokens, n_ctx)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.status, "param": self.param,
                          **self.extra}}

    def renamed(self, rename: Callable[[str], str]) -> "ApiError":
        """The same error with its field named as another API spells it (`rename(param)`), in the
        message too (which starts with the param); itself when it names no field."""
        if self.param is None:
            return self
        name = rename(self.param)
        message = name + self.message[len(self.param):] if self.message.startswith(self.param) else self.message
        return ApiError(self.status, message, self.type, name, self.extra)


LOG = logging.getLogger("spark.serve")  # server.py writes it as `spark serve: warning: ...`


def warn(message: str) -> None:
    """A warning in the server's log: what a request asked that is skipped or not honoured."""
    LOG.warning(message)


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, "unavailable_error")


def build_fingerprint() -> str:
    """Spark's version and the llama.cpp bindings it runs on (llama-server sends its build info)."""
    from importlib.metadata import PackageNotFoundError, version

    from .. import __version__

    try:
        bindings = version("llama_cpp_python")
    except PackageNotFoundError:
        bindings = "unknown"
    return f"spark-{__version__}-llama-cpp-python-{bindings}"


# ---------------------------------------------------------------- requests


class Strict(BaseModel):
    # NOTE: unknown fields are ignored as llama-server does (clients send many); known ones are typed strictly
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """Clients send `"temperature": null` for "not set": take the default."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
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


class ToolCallIn(Strict):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Strict):
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
        return "\n".join(p.text for p in self.content)  # NOTE: llama-server's join (templates read one string)

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


class FunctionDef(Strict):
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


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class JsonSchemaSpec(Strict):
    name: str = "response"
    schema_: dict = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
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


# NOTE: the variables every render passes the template itself (core/chat_template.ChatTemplate._render's
# context and the helpers of its environment): a chat_template_kwargs key of these would replace them
TEMPLATE_VARIABLES = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception",
                      "strftime_now")
TOOL_CHOICES = ("auto", "none", "required")
REASONING = ("auto", "deepseek", "none")


class StreamOptions(Strict):
    include_usage: bool = False


# Fields a client may send that spark serve does not implement, with the values that mean "off"
# (those are accepted: they ask for nothing). Any other value is a 400 naming the field. Fields
# in neither this table nor the models are ignored, as llama-server ignores them (`user`,
# `store`, `metadata`, ...).
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "mirostat": (0,), "dynatemp_range": (0, 0.0), "top_n_sigma": (-1, -1.0), "xtc_probability": (0, 0.0),
    "dry_multiplier": (0, 0.0), "lora": ([],),
    "min_keep": (0,), "n_indent": (0,), "n_cache_reuse": (0,),
    "return_tokens": (False,), "t_max_predict_ms": (0,),
    "functions": (), "function_call": (), "audio": (), "prediction": (),
    "web_search_options": (), "modalities": (["text"],),
}
MAX_LOGIT_BIAS = 1024  # entries at most

# llama-server's `samplers`: names or its one-letter codes. Spark's chain has a fixed order; a
# list in that order picks which run (the others are off); dry, top_n_sigma and xtc may be named
# (they are off: their fields are refused above).
SAMPLER_CODES = {"penalties": "e", "dry": "d", "top_n_sigma": "s", "top_k": "k", "top-k": "k", "typ_p": "y",
                 "typical_p": "y", "typical-p": "y", "typical": "y", "top_p": "p", "top-p": "p", "nucleus": "p",
                 "min_p": "m", "min-p": "m", "xtc": "x", "temperature": "t", "temp": "t"}
SAMPLER_ORDER = "ekypmt"  # penalties, top_k, typ_p, top_p, min_p, temperature
INERT_SAMPLERS = "dsx"


def _sampler_codes(v: Union[str, list[str]]) -> str:
    """The samplers asked for, as codes in Spark's order; ValueError when unknown or out of order."""
    given = v if isinstance(v, list) else list(v)
    codes = [SAMPLER_CODES.get(n.lower(), "?") if isinstance(v, list) else n for n in given]
    unknown = [n for n, c in zip(given, codes) if c not in SAMPLER_ORDER + INERT_SAMPLERS]
    if unknown:
        raise ValueError(f"unknown sampler {unknown[0]!r} (names: {', '.join(sorted(SAMPLER_CODES))}; or "
                         f"the letters {SAMPLER_ORDER + INERT_SAMPLERS})")
    kept = "".join(c for c in codes if c not in INERT_SAMPLERS)
    if len(set(kept)) != len(kept) or kept != "".join(c for c in SAMPLER_ORDER if c in kept):
        raise ValueError("spark serve runs its samplers in one order: penalties, top_k, typ_p, top_p, min_p, "
                         "temperature (leave any out to turn it off)")
    return kept


def refuse_unsupported(data: Any, extra: dict[str, tuple[Any, ...]], own: frozenset[str] = frozenset()) -> None:
    """A 400 naming the first field of UNSUPPORTED or `extra` (not in `own`: the endpoint's) that asks for something."""
    if not isinstance(data, dict):
        return
    for name, neutral in {**UNSUPPORTED, **extra}.items():
        if name in own:
            continue
        v = data.get(name)
        if v is not None and not any(v == n and isinstance(v, bool) == isinstance(n, bool) for n in neutral):
            only = f" (only {json.dumps(neutral[0])}, which asks for nothing)" if neutral else ""
            raise ApiError(400, f"{name}: not supported by spark serve{only}", param=name)


def _bias_pairs(v: Any) -> tuple[tuple[int | str, float], ...]:
    """OpenAI's {"token id": bias} or llama-server's [[token id, bias], ...]; a bias of false bans the token.
    A text in place of a token id stays text: each of its tokens gets the bias (llama-server's; the
    engine thread tokenizes it, worker.resolve_bias)."""
    items = list(v.items()) if isinstance(v, dict) else v
    if not isinstance(items, list) or len(items) > MAX_LOGIT_BIAS:
        raise ValueError(f"must be an object of token id: bias (at most {MAX_LOGIT_BIAS})")
    out = []
    for item in items:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise ValueError("each entry is a token id and a bias")
        tok, bias = item
        if isinstance(tok, str) and tok.strip().lstrip("-").isdigit():
            tok = int(tok)
        if not isinstance(tok, (int, str)) or isinstance(tok, bool) or isinstance(tok, int) and tok < 0:
            raise ValueError(f"{tok!r} is not a token id")
        if bias is False:
            out.append((tok, float("-inf")))
            continue
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise ValueError(f"token {tok}: the bias must be a finite number, or false to ban the token")
        out.append((tok, float(bias)))
    return tuple(out)


class GenerationRequest(Strict):
    """What chat and completion bodies share: OpenAI's fields and llama-server's sampling ones."""

    REFUSED: ClassVar[dict[str, tuple[Any, ...]]] = {}  # per endpoint, beside UNSUPPORTED
    OWN: ClassVar[frozenset[str]] = frozenset()  # fields of UNSUPPORTED this endpoint implements
    NATIVE: ClassVar[bool] = False  # the answer is llama-server's native body (its `prompt`: Job.show_prompt)

    model: str | None = None  # NOTE: one model is served; the name is echoed back, as llama-server does
    max_tokens: int | None = Field(None, ge=1, le=(1 << 31) - 1)
    n_predict: int | None = Field(None, ge=-1, le=(1 << 31) - 1)  # llama-server's: over max_tokens
    temperature: float | None = Field(None, ge=0.0, le=2.0)  # None: the server's --temp
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    top_k: int = Field(40, ge=0, le=(1 << 31) - 1)
    min_p: float = Field(0.05, ge=0.0, le=1.0)
    typical_p: float = Field(1.0, gt=0.0, le=1.0)
    repeat_penalty: float = Field(1.0, ge=0.0, le=10.0)
    repeat_last_n: int = Field(64, ge=-1, le=(1 << 31) - 1)  # -1: the whole context
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: Union[dict, list, None] = None
    seed: int | None = Field(None, ge=-1, le=(1 << 32) - 1)  # -1: random, as llama-server; None: --seed
    stop: Union[str, list[str], None] = None
    # choices (llama-server's n_cmpl, n its alias): each samples with seed + its index
    n: int = Field(1, ge=1, le=MAX_CHOICES, validation_alias=AliasChoices("n_cmpl", "n"))
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_prompt: bool = True  # False: evaluate the whole prompt, reuse nothing from the KV cache
    ignore_eos: bool = False  # never sample an end-of-generation token (llama-server's: they get -inf)
    samplers: Union[str, list[str], None] = None  # llama-server's: which samplers run (SAMPLER_ORDER)
    grammar: str | None = Field(None, min_length=1)  # llama-server's: GBNF the output must match
    json_schema: dict | None = None  # llama-server's: JSON the output must match
    timings_per_token: bool = False  # llama-server's: every streamed chunk carries the timings so far
    # llama-server's: a stream sends chunks with `prompt_progress` while the prompt is evaluated
    # (without stream it asks for nothing, as llama-server's)
    return_progress: bool = False
    # llama-server's context shift (spark serve --context-shift): the prompt tokens a shift keeps
    # (-1: all of them; a BOS is kept too) and the tokens it drops (0: half of those after n_keep)
    n_keep: int = Field(0, ge=-(1 << 31), le=(1 << 31) - 1)
    n_discard: int = Field(0, ge=-(1 << 31), le=(1 << 31) - 1)
    post_sampling_probs: bool = False  # llama-server's: probabilities after the sampler chain (n_probs set)
    # llama-server's: the sampler chain run on the device; Spark runs the same chain on the CPU (same tokens)
    backend_sampling: bool = False
    return_tokens: bool = False  # llama-server's: the final body's `tokens` (/completion's; UNSUPPORTED elsewhere)
    response_fields: list[str] = Field(default_factory=list)  # llama-server's: the native body's fields kept
    verbose: bool | None = None  # llama-server's: `__verbose`, the native body, beside the answer (None: --verbose)
    id_slot: int = -1  # llama-server's: the slot that serves it, waited for while busy; -1: any (range: worker.submit)

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        refuse_unsupported(data, cls.REFUSED, cls.OWN)
        return data

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: Union[dict, list, None]) -> Union[dict, list, None]:
        _bias_pairs(v)
        return v

    @field_validator("samplers")
    @classmethod
    def _samplers(cls, v: Union[str, list[str], None]) -> str | None:
        return None if v is None else _sampler_codes(v)

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
    def bias(self) -> tuple[tuple[int | str, float], ...]:
        return _bias_pairs(self.logit_bias) if self.logit_bias is not None else ()

    def _asked_limit(self) -> int | None:
        return self.max_tokens

    @property
    def asked_limit(self) -> int | None:
        """Tokens at most that the request asks for (n_predict over max_tokens); None: the server's."""
        return self.n_predict if self.n_predict is not None else self._asked_limit()

    @property
    def n_probs(self) -> int | None:
        """Top tokens to report with each token's probability; None: no probabilities."""
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(GenerationRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=(1 << 31) - 1)
    tools: list[Tool] | None = None
    tool_choice: Union[str, dict, None] = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    reasoning_format: str | None = None
    chat_template_kwargs: dict | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    reasoning_effort: str | None = Field(None, min_length=1)  # a template kwarg; "none": no thinking
    add_generation_prompt: bool = True  # False: the prompt opens no assistant turn (llama-server's)
    continue_final_message: Union[bool, str, None] = None  # vLLM's: continue the last (assistant) message
    reasoning_budget_tokens: int | None = Field(None, ge=-1)  # llama-server's: -1 no limit, 0 no thinking
    thinking_budget_tokens: int | None = Field(None, ge=-1)  # its other spelling

    @model_validator(mode="after")
    def _shape(self) -> "ChatRequest":
        # NOTE: llama-server's refusals, in its words
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs requires logprobs to be set to true", param="top_logprobs")
        if self.logprobs and self.stream and self.tools:
            raise ApiError(400, "logprobs is not supported with tools + stream", param="logprobs")
        if [m.role for m in self.messages][-2:] == ["assistant", "assistant"]:
            raise ApiError(400, "Cannot have 2 or more assistant messages at the end of the list.", param="messages")
        if self.continue_final_message not in (None, False) and self.add_generation_prompt:
            raise ApiError(400, "Cannot set both add_generation_prompt and continue_final_message to true.",
                           param="continue_final_message")
        if self.prefill and self.messages[-1].tool_calls:
            raise ApiError(400, "Cannot continue an assistant message that contains tool calls.", param="messages")
        if self.tools and self.choice != "none" and (self.grammar is not None or self.json_schema is not None):
            raise ApiError(400, "Cannot use custom grammar constraints with tools.", param="grammar")
        return self

    @property
    def prefill(self) -> bool:
        """A last assistant message is continued (llama-server's prefill), not answered."""
        return self.messages[-1].role == "assistant"

    @property
    def reasoning_budget(self) -> int | None:
        """The thinking budget asked for, in tokens (reasoning_budget_tokens over thinking_budget_tokens)."""
        return self.reasoning_budget_tokens if self.reasoning_budget_tokens is not None else self.thinking_budget_tokens

    def template_kwargs(self) -> dict[str, Any]:
        """chat_template_kwargs, with reasoning_effort as llama-server passes it ("none": enable_thinking off)."""
        kw = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort == "none":
            kw["enable_thinking"] = False
            kw.pop("reasoning_effort", None)
        elif self.reasoning_effort is not None:
            kw["reasoning_effort"] = self.reasoning_effort
        return kw

    @property
    def n_probs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs if self.top_logprobs is not None else 20  # llama-server's default

    @field_validator("chat_template_kwargs")
    @classmethod
    def _own_variables(cls, v: dict | None) -> dict | None:
        """Extras only: a key the render passes itself (the validated messages, tools...) is refused."""
        for key in v or {}:
            if key in TEMPLATE_VARIABLES:
                raise ApiError(400, f"chat_template_kwargs.{key}: spark serve sets {key} from the request itself "
                                    f"(chat_template_kwargs adds variables; it may not replace "
                                    f"{', '.join(TEMPLATE_VARIABLES)})", param=f"chat_template_kwargs.{key}")
        return v

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

    def _asked_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def message_dicts(self) -> list[dict[str, Any]]:
        out = [m.for_template() for m in self.messages]
        last = self.messages[-1]
        if self.prefill and isinstance(last.content, list):
            # NOTE: a continued message's parts join with a blank line, as llama-server's
            # (common_chat_msg::render_content), where the template joins every other message's with "\n"
            out[-1]["content"] = "\n\n".join(p.text for p in last.content)
        return out


class CompletionRequest(GenerationRequest):
    REFUSED: ClassVar[dict[str, tuple[Any, ...]]] = {"echo": (False,), "best_of": (1,), "suffix": ()}

    prompt: Union[str, list[str]]
    logprobs: int | None = Field(None, ge=0, le=20)  # the top tokens to report with each token's

    @property
    def n_probs(self) -> int | None:
        return self.logprobs

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


class TokenizeRequest(Strict):
    """llama-server's POST /tokenize (its defaults: no BOS, special tokens parsed)."""

    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(Strict):
    tokens: list[int] = Field(default_factory=list)

    @field_validator("tokens")
    @classmethod
    def _ids(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("token ids are >= 0")
        return v


def piece_json(piece: bytes) -> str | list[int]:
    """A token's text, or its bytes when they are not UTF-8 on their own (llama-server's /tokenize)."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return list(piece)


# the request fields' defaults that /props reports (temperature, seed, n_predict: the server's)
SAMPLING_DEFAULTS = {name: GenerationRequest.model_fields[name].default for name in (
    "top_k", "top_p", "min_p", "typical_p", "repeat_penalty", "repeat_last_n", "presence_penalty",
    "frequency_penalty")}


def _is_type_tag(part: object) -> bool:
    """pydantic names the union member it tried (`content.str`, `content.list[TextPart]`)."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none") or "[" in part)


MAX_DEPTH = 64  # JSON nesting a request may have (messages[i].content[j].text is 5)
MAX_INT = (1 << 63) - 1


def _check_values(data: Any) -> None:
    """ApiError(400) for what json.loads accepts but nothing downstream can take: nesting past
    MAX_DEPTH, integers past 64 bits, NaN (not JSON; every bound compares false with it), strings
    with lone surrogates (not UTF-8)."""
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
            if isinstance(v, float) and math.isnan(v):
                raise ApiError(400, f"{where}: not a number (NaN, which JSON does not have)", param=where)
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


LOWEST_LOGPROB = -3.4028234663852886e38  # for a probability of 0 (JSON has no -inf): llama-server's


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability, as llama-server writes it: id, text, bytes, logprob, and the
    most probable tokens of the same distribution (`top`, those of a sampled token only). `post`:
    a probability after the sampler chain (post_sampling_probs), written as `prob` and `top_probs`."""

    id: int
    piece: bytes
    prob: float
    top: tuple["TokenLogprob", ...] = ()
    post: bool = False

    @property
    def logprob(self) -> float:
        return math.log(self.prob) if self.prob > 0 else LOWEST_LOGPROB

    def _base(self) -> dict[str, Any]:
        # NOTE: a piece that ends inside a UTF-8 character (byte tokens) shows the complete part; bytes has all
        return {"id": self.id, "token": self.piece.decode("utf-8", errors="ignore"), "bytes": list(self.piece),
                **({"prob": self.prob} if self.post else {"logprob": self.logprob})}

    def to_dict(self) -> dict[str, Any]:
        return {**self._base(), "top_probs" if self.post else "top_logprobs": [t._base() for t in self.top]}


def logprobs_body(probs: list[TokenLogprob] | None) -> dict[str, Any] | None:
    """A choice's `logprobs`: null unless asked for."""
    return None if probs is None else {"content": [p.to_dict() for p in probs]}


@dataclass(frozen=True)
class Timings:
    """llama-server's `timings` of one response (the KV-reused prompt tokens are cache_n)."""

    cache_n: int = 0
    prompt_n: int = 0
    prompt_seconds: float = 0.0
    predicted_n: int = 0
    predicted_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        def per_token_ms(n: int, s: float) -> float:
            return s * 1e3 / n if n else 0.0

        def per_second(n: int, s: float) -> float:
            return n / s if s > 0 else 0.0

        p, ps, g, gs = self.prompt_n, self.prompt_seconds, self.predicted_n, self.predicted_seconds
        return {"cache_n": self.cache_n, "prompt_n": p, "prompt_ms": ps * 1e3,
                "prompt_per_token_ms": per_token_ms(p, ps), "prompt_per_second": per_second(p, ps),
                "predicted_n": g, "predicted_ms": gs * 1e3, "predicted_per_token_ms": per_token_ms(g, gs),
                "predicted_per_second": per_second(g, gs)}


@dataclass
class Envelope:
    """What every body and chunk of one response shares; `fingerprint` is the build
    (system_fingerprint, as llama-server sends its build info); `index`: the choice (n > 1)."""

    chat: bool
    model: str
    fingerprint: str = ""
    id: str = ""
    created: int = 0
    index: int = 0

    def __post_init__(self) -> None:
        self.id = self.id or ("chatcmpl-" if self.chat else "cmpl-") + secrets.token_hex(12)
        self.created = self.created or int(time.time())

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}

    def full(self, text: str, finish: str, usage: Usage, probs: list[TokenLogprob] | None = None,
             timings: Timings | None = None) -> dict[str, Any]:
        """A whole completion (a chat's is `message`)."""
        choice = {"index": self.index, "text": text, "finish_reason": finish, "logprobs": logprobs_body(probs)}
        return _timed({**self._base("text_completion"), "choices": [choice], "usage": usage.to_dict()}, timings)

    def message(self, content: str, reasoning: str, tool_calls: list[dict[str, Any]], finish: str,
                usage: Usage, probs: list[TokenLogprob] | None = None,
                timings: Timings | None = None) -> dict[str, Any]:
        """A whole chat answer: content (null when only calls), reasoning_content, tool_calls."""
        msg: dict[str, Any] = {"role": "assistant", "content": content if content or not tool_calls else None}
        if reasoning:
            msg["reasoning_content"] = reasoning
        if tool_calls:
            msg["tool_calls"] = tool_calls
        choice = {"index": self.index, "message": msg, "finish_reason": finish, "logprobs": logprobs_body(probs)}
        return _timed({**self._base("chat.completion"), "choices": [choice], "usage": usage.to_dict()}, timings)

    def delta(self, content: str = "", reasoning: str = "", tool_call: dict[str, Any] | None = None,
              probs: list[TokenLogprob] | None = None, timings: Timings | None = None) -> dict[str, Any]:
        """One chat stream chunk of content, reasoning_content or a tool_calls fragment."""
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if reasoning:
            delta["reasoning_content"] = reasoning
        if tool_call is not None:
            delta["tool_calls"] = [tool_call]
        choice = {"index": self.index, "delta": delta, "finish_reason": None, "logprobs": logprobs_body(probs)}
        return _timed({**self._base("chat.completion.chunk"), "choices": [choice], "usage": None}, timings)

    def role_chunk(self) -> dict[str, Any]:
        """A chat stream's first chunk, as llama-server sends it: the role, content null."""
        choice = {"index": self.index, "delta": {"role": "assistant", "content": None}, "finish_reason": None,
                  "logprobs": None}
        return {**self._base("chat.completion.chunk"), "choices": [choice], "usage": None}

    def chunk(self, text: str | None = None, finish: str | None = None, probs: list[TokenLogprob] | None = None,
              timings: Timings | None = None) -> dict[str, Any]:
        """A completion's text chunk, or either stream's finish chunk."""
        if self.chat:
            delta: dict[str, Any] = {} if text is None else {"content": text}
            choice = {"index": self.index, "delta": delta, "finish_reason": finish, "logprobs": logprobs_body(probs)}
            return _timed({**self._base("chat.completion.chunk"), "choices": [choice], "usage": None}, timings)
        choice = {"index": self.index, "text": text or "", "finish_reason": finish, "logprobs": logprobs_body(probs)}
        return _timed({**self._base("text_completion"), "choices": [choice], "usage": None}, timings)

    def progress_chunk(self, progress: dict[str, Any], timings: Timings | None = None) -> dict[str, Any]:
        """A stream chunk of the prompt's progress (llama-server's return_progress): a chat's is a
        role chunk, a completion's an empty text; both carry `prompt_progress`."""
        body = self.role_chunk() if self.chat else self.chunk(text="")
        return _timed({**body, "prompt_progress": progress}, timings)

    def usage_chunk(self, usage: Usage, timings: Timings | None = None) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return _timed({**self._base(obj), "choices": [], "usage": usage.to_dict()}, timings)


def _timed(body: dict[str, Any], timings: Timings | None) -> dict[str, Any]:
    if timings is not None:
        body["timings"] = timings.to_dict()
    return body


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode()


def event_sse(event: dict[str, Any]) -> bytes:
    """One server-sent event named by its type (Anthropic's and the Responses API's streams)."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode()


def new_id(prefix: str) -> str:
    """An object's id: its prefix (msg_, toolu_, resp_, ...) and 24 random hex digits."""
    return prefix + secrets.token_hex(12)
