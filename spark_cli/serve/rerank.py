"""llama-server's `POST /rerank` (also /reranking, /v1/rerank, /v1/reranking), with `spark serve
--reranking` on a model with a classifier head: each document's score is the model's first class
on the reranking prompt (Vocab.rerank_tokens), one embedding job after another (embeddings.py).

In: `query` (a string), `documents` (Jina) or `texts` (TEI: the answer is TEI's list, `return_text`
adds each text; as llama-server's, a body with a `texts` key gets TEI's answer, and `documents` is
read first), `top_n`. Out: the documents by score, best first, at most top_n.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..core.embedding import rerank_results
from .chat import ClientGone, read_body
from .embeddings import embed_tokens
from .protocol import ApiError, Strict, parse, unavailable
from .sleep import awake


class RerankRequest(Strict):
    query: Any = None
    documents: Any = None
    texts: Any = None
    top_n: int | None = Field(None, ge=0)
    return_text: bool = False
    model: str | None = None

    def docs(self) -> list[str]:
        docs = self.documents if self.documents is not None else self.texts
        if not isinstance(docs, list) or not docs or not all(isinstance(d, str) for d in docs):
            raise ApiError(400, '"documents" must be a non-empty string array', param="documents")
        return docs


async def rerank(request: Request) -> Response:
    st = request.app.state.spark
    if st.pooling != "rank":
        raise ApiError(501, "This server does not support reranking. Start it with `--reranking`",
                       "not_supported_error")
    try:
        req = parse(RerankRequest, await read_body(request, st.max_body))
    except ClientGone:
        return Response(status_code=499)
    if req.query is None:
        raise ApiError(400, '"query" must be provided', param="query")
    if not isinstance(req.query, str):
        raise ApiError(400, '"query" must be a string', param="query")
    docs = req.docs()
    async with awake(st.worker.idle, lambda: bool(st.worker.fatal)):
        if st.worker.engine is None or not st.worker.ready.is_set():
            raise unavailable("Loading model")
        vocab = st.worker.engine.vocab
        prompts = await asyncio.to_thread(lambda: [vocab.rerank_tokens(req.query, d) for d in docs])
    try:
        got = [await embed_tokens(request, st, p) for p in prompts]
    except ClientGone:
        return Response(status_code=499)
    tei = "texts" in req.model_fields_set  # NOTE: llama-server's body.contains("texts")
    body = rerank_results([float(ev.vectors[0]) for ev in got], [ev.n_tokens for ev in got], docs,
                          req.top_n if req.top_n is not None else len(docs), tei, req.return_text,
                          req.model or st.model_name)
    return JSONResponse(body)


ROUTES = [Route(p, rerank, methods=["POST"]) for p in ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking")]
