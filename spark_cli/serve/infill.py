"""llama-server's `POST /infill`, what editor plugins (llama.vscode, llama.vim) send: the request and
its prompt. The prompt is token ids from the model's FIM tokens (core/fim.py); the answer is
/completion's, through the same run (app.py), so the same engine, slots and expert cache.

In: `input_prefix`, `input_suffix` (required), `input_extra` (a list of {"filename", "text"}),
`prompt` (text after the prefix, special tokens parsed), and /completion's sampling fields.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from ..core.fim import ExtraChunk, infill_tokens
from .llama_api import NativeCompletionRequest
from .protocol import ApiError


class InfillRequest(NativeCompletionRequest):
    prompt: str = ""  # type: ignore[assignment]  # optional here, text only
    input_prefix: str
    input_suffix: str
    input_extra: list[Any] = Field(default_factory=list)

    @field_validator("prompt")
    @classmethod
    def _some(cls, v: Any) -> Any:  # NOTE: replaces /completion's: an infill's prompt may be empty
        return v

    @field_validator("input_extra")
    @classmethod
    def _chunks(cls, v: list[Any]) -> list[Any]:
        # NOTE: llama-server's checks, in its words
        for i, chunk in enumerate(v):
            if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
                raise ApiError(400, 'extra_context chunk must contain a "text" field with a string value',
                               param=f"input_extra.{i}.text")
            if "filename" in chunk and not isinstance(chunk["filename"], str):
                raise ApiError(400, 'extra_context chunk\'s "filename" field must be a string',
                               param=f"input_extra.{i}.filename")
        return v

    @property
    def extra(self) -> list[ExtraChunk]:
        return [ExtraChunk(c["text"], c.get("filename", "tmp")) for c in self.input_extra]


def infill_prompt(engine: Any, req: InfillRequest, n_predict: int) -> list[int]:
    """The request's prompt ids on `engine` (its vocabulary's FIM tokens, batch and slot context);
    `n_predict`: the server's --n-predict. core.fim.NoFim when the model has no FIM tokens."""
    vocab = engine.vocab
    return infill_tokens(vocab.fim_tokens(),
                         lambda text, special: vocab.tokenize(text, add_special=False, parse_special=special),
                         req.input_prefix, req.input_suffix, req.extra, req.prompt, n_batch=engine.n_batch,
                         n_predict=n_predict, n_ctx=engine.n_ctx)
