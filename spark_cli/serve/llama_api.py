"""llama.cpp's own completion API, `POST /completion`: the request and its bodies. Pure: no web
framework, no llama_cpp; the route (app.py) runs it through the one boundary (chat.open_run).

In: `prompt` as text, token ids or a list of both, `{"prompt_string": ...}`, or several of these in
a list without token ids (llama-server's rule: a batch, answered with a list of bodies); `n_predict`, `stream`, `cache_prompt`,
`n_probs` (`post_sampling_probs`: after the sampler chain), `return_tokens`, `timings_per_token`,
`return_progress`, `response_fields` and the sampling fields the OpenAI endpoints take. Out: llama-server's bodies:
`content`, `tokens_predicted`, `tokens_evaluated`, `stop_type` (eos | word | limit | none),
`stopping_word`, `generation_settings`, `timings`, `completion_probabilities` (n_probs > 0); the
final one is also the OpenAI answers' `__verbose` (`verbose`).
Streamed: one `{"content", "stop": false, ...}` event per piece (with `return_progress`, empty
pieces with `prompt_progress` first), then the final body with `stop: true` and empty content;
no `[DONE]`, as llama-server's.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any, Sequence, Union

from pydantic import Field, field_validator

from ..runs.chat_session import Sampling
from .protocol import GenerationRequest, Timings, TokenLogprob, Usage

Prompt = Union[str, list[Union[int, str]]]  # one prompt: text, or token ids and texts
JSON_PROMPT, JSON_MEDIA = "prompt_string", "multimodal_data"


def sub_prompts(prompt: Any) -> list[Prompt]:
    """llama-server's tokenize_input_prompts: a list without token ids is several prompts (each
    text, token ids and texts, or {"prompt_string": ...}); anything else is one. ValueError for
    media (no multimodal model) or an element of another kind."""
    many = isinstance(prompt, list) and not any(isinstance(p, int) for p in prompt)
    return [_one_prompt(p) for p in (prompt if many else [prompt])]


def _one_prompt(p: Any) -> Prompt:
    if isinstance(p, dict):
        if JSON_MEDIA in p:
            raise ValueError("Multimodal data provided, but model does not support multimodal requests.")
        p = p.get(JSON_PROMPT)
        if not isinstance(p, (str, list)):
            raise ValueError(f'a JSON prompt is {{"{JSON_PROMPT}": text or token ids}}')
    if isinstance(p, list) and not all(isinstance(q, (int, str)) for q in p):
        raise ValueError('"prompt" elements must be a string, a list of tokens, a JSON object containing a '
                         'prompt string, or a list of mixed strings & tokens.')
    return p


STOP_TYPE = {"eog": "eos", "stop": "word", "length": "limit", "context": "limit", "interrupted": "none"}


class NativeCompletionRequest(GenerationRequest):
    OWN = frozenset({"return_tokens"})
    NATIVE = True

    prompt: Union[str, dict, list[Union[int, str, dict, list[Union[int, str]]]]]
    probs_n: int = Field(0, ge=0, le=100, alias="n_probs")  # >0: each token's probability and the top n

    @field_validator("prompt")
    @classmethod
    def _some(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("the prompt is empty")
        for p in sub_prompts(v):
            if not p or (isinstance(p, list) and all(isinstance(q, str) and not q for q in p)):
                raise ValueError("the prompt is empty")
            if isinstance(p, list) and any(isinstance(q, int) and q < 0 for q in p):
                raise ValueError("token ids are >= 0")
        return v

    @field_validator("n")
    @classmethod
    def _one(cls, v: int) -> int:
        if v != 1:
            raise ValueError(f"/completion answers one completion per prompt in spark serve, got {v} (several "
                             "prompts are a batch; /v1/completions and /v1/chat/completions take n)")
        return v

    @property
    def prompts(self) -> list[Prompt]:
        """The prompts of this request: one, or a batch."""
        return sub_prompts(self.prompt)

    @property
    def n_probs(self) -> int | None:
        return self.probs_n or None


def settings(s: Sampling, req: GenerationRequest, eog: Sequence[int] = ()) -> dict[str, Any]:
    """`generation_settings`: what this request sampled with (the server's defaults filled in);
    `eog`: the end-of-generation tokens ignore_eos bans, listed with the biases as llama-server's."""
    d = asdict(s)
    bias = list(d.pop("logit_bias"))
    given = {t for t, _ in bias}
    bias += [(t, float("-inf")) for t in eog if t not in given]
    return {**{k: v for k, v in d.items() if k not in ("temp", "n_probs")}, "temperature": s.temp,
            "max_tokens": s.n_predict,
            # NOTE: a banned token's -inf is null, as llama-server's JSON writes it
            "logit_bias": [{"token": t, "bias": b if math.isfinite(b) else None} for t, b in bias],
            "n_probs": req.n_probs or 0, "stop": req.stops, "stream": req.stream, "cache_prompt": req.cache_prompt}


def piece_event(text: str, n_prompt: int, n_predicted: int, probs: list[TokenLogprob] | None,
                id_slot: int = 0, tokens: list[int] | None = None, timings: Timings | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"index": 0, "content": text, "tokens": list(tokens or []), "stop": False,
                            "id_slot": id_slot, "tokens_predicted": n_predicted, "tokens_evaluated": n_prompt}
    if timings is not None:
        body["timings"] = timings.to_dict()
    if probs:
        body["completion_probabilities"] = [p.to_dict() for p in probs]
    return body


def progress_event(progress: dict[str, Any], n_prompt: int, id_slot: int = 0,
                   timings: Timings | None = None) -> dict[str, Any]:
    """A streamed event of the prompt's progress (return_progress): an empty piece with
    `prompt_progress` (llama-server's also lists token 0 in `tokens`; this one none)."""
    return {**piece_event("", n_prompt, 0, None, id_slot, [], timings), "prompt_progress": progress}


def final_body(content: str, model: str, prompt: str, finish: str, stop_word: str | None, usage: Usage,
               timings: Timings | None, generation: dict[str, Any],
               probs: list[TokenLogprob] | None, id_slot: int = 0, tokens: list[int] | None = None,
               index: int = 0, shifted: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {
        "index": index, "content": content, "tokens": list(tokens or []), "id_slot": id_slot, "stop": True,
        "model": model, "tokens_predicted": usage.completion_tokens, "tokens_evaluated": usage.prompt_tokens,
        "generation_settings": generation, "prompt": prompt, "has_new_line": "\n" in content,
        # llama-server's: the context filled up (without --context-shift), or was shifted (with it)
        "truncated": finish == "context" or shifted,
        "stop_type": STOP_TYPE[finish], "stopping_word": stop_word or "",
        "tokens_cached": usage.prompt_tokens + usage.completion_tokens,
        "timings": (timings or Timings()).to_dict(),
    }
    if probs:
        body["completion_probabilities"] = [p.to_dict() for p in probs]
    return body


def picked(body: dict[str, Any], paths: Sequence[str]) -> dict[str, Any]:
    """llama-server's response_fields: only the values these paths name (`a/b`: body["a"]["b"],
    under the key "a/b"); a path that names nothing is left out; no paths: the whole body."""
    if not paths:
        return body
    out: dict[str, Any] = {}
    for path in paths:
        v: Any = body
        for key in path.split("/"):
            if not isinstance(v, dict) or key not in v:
                break
            v = v[key]
        else:
            out[path] = v
    return out
