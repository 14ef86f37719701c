"""llama-server's `POST /embeddings` and OpenAI's `POST /v1/embeddings` (with `spark serve
--embedding`): each prompt of `input` (or `content`) is one worker job (Job.embed) in a free
slot, between the generation steps of the others, one prompt after another.

In: `input` as text, token ids, a list of these (several prompts), {"prompt_string": ...} or
{"content": [{"type": "text", "text": ...}]}; `encoding_format` float | base64; `embd_normalize`
(-1 none, 0 max absolute, 2 euclidean (the default), p: p-norm). Out: /v1/embeddings: OpenAI's
list with usage; /embeddings: llama-server's [{"index", "embedding": [vector, ...]}] (one vector
per token with --pooling none, never normalised).
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..core.embedding import normalized
from .chat import ClientGone, one_event, read_body
from .llama_api import sub_prompts
from .protocol import ApiError, Strict, parse
from .worker import Embedded

NOT_OAI = "Pooling type 'none' is not OAI compatible. Please use a different pooling type"


class EmbeddingRequest(Strict):
    input: Any = None
    content: Any = None
    encoding_format: str = "float"
    embd_normalize: int = Field(2, ge=-1)
    model: str | None = None


def _text_parts(content: Any) -> str:
    """OpenAI's content parts as one text (only text parts: this model takes no media)."""
    if not isinstance(content, list) or not content:
        raise ApiError(400, '"content" must be a non-empty array of {"type": "text", "text": ...} parts',
                       param="input")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ApiError(400, f"input: a content part of type {kind!r}: spark serve embeds text parts only "
                                "(the model takes no images, audio or video)", param="input")
        texts.append(part["text"])
    return "".join(texts)


def prompts_of(raw: Any) -> list[str | list[int | str]]:
    """The prompts of `input` (llama-server's tokenize_input_prompts, plus OpenAI content parts)."""
    if raw is None:
        raise ApiError(400, '"input" or "content" must be provided', param="input")
    if isinstance(raw, list) and not raw:
        raise ApiError(400, '"input" must not be empty', param="input")
    items = raw if isinstance(raw, list) and not any(isinstance(p, int) for p in raw) else [raw]
    out: list[str | list[int | str]] = []
    for item in items:
        if isinstance(item, dict) and "content" in item:
            out.append(_text_parts(item["content"]))
            continue
        try:
            out += sub_prompts(item)
        except ValueError as e:
            raise ApiError(400, f"input: {e}", param="input") from None
    return out


async def embed_tokens(request: Request, st: Any, prompt: Any) -> Embedded:
    """One prompt's embedding job (text, or token ids and texts), once it is done."""
    ev = await one_event(request, st.worker, text=prompt, embed=True)
    assert isinstance(ev, Embedded)
    return ev


async def embeddings(request: Request, oai: bool) -> Response:
    st = request.app.state.spark
    if st.pooling is None:
        raise ApiError(501, "This server does not support embeddings. Start it with `--embeddings`",
                       "not_supported_error")
    if oai and st.pooling == "none":
        raise ApiError(400, NOT_OAI)
    try:
        req = parse(EmbeddingRequest, await read_body(request, st.max_body))
    except ClientGone:
        return Response(status_code=499)
    if req.encoding_format not in ("float", "base64"):
        raise ApiError(400, "The format to return the embeddings in. Can be either float or base64",
                       param="encoding_format")
    if req.input is None and req.content is not None:
        oai = False  # NOTE: llama-server's: "content" is not OpenAI's field
    prompts = prompts_of(req.input if req.input is not None else req.content)
    try:
        # NOTE: one after another: a long input list never fills the request queue, and each is quick
        results = [await embed_tokens(request, st, p) for p in prompts]
    except ClientGone:
        return Response(status_code=499)
    vectors = [_vectors(ev.vectors, st.pooling, req.embd_normalize) for ev in results]
    if not oai:
        return JSONResponse([{"index": i, "embedding": v} for i, v in enumerate(vectors)])
    data = [{"embedding": _b64(v[0]) if req.encoding_format == "base64" else v[0], "index": i, "object": "embedding",
             **({"encoding_format": "base64"} if req.encoding_format == "base64" else {})}
            for i, v in enumerate(vectors)]
    n = sum(ev.n_tokens for ev in results)
    return JSONResponse({"model": req.model or st.model_name, "object": "list",
                         "usage": {"prompt_tokens": n, "total_tokens": n}, "data": data})


def _vectors(got: np.ndarray, pooling: str, norm: int) -> list[list[float]]:
    """A prompt's vectors: one per token with pooling none (as computed), else the pooled one normalised."""
    if pooling == "none":
        return [[float(x) for x in row] for row in got]
    return [normalized(got, norm)]


def _b64(vec: list[float]) -> str:
    return base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode("ascii")


async def embeddings_native(request: Request) -> Response:
    return await embeddings(request, oai=False)


async def embeddings_oai(request: Request) -> Response:
    return await embeddings(request, oai=True)
