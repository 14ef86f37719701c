"""Embeddings and reranking as llama-server serves them (`--embedding`, `--pooling`, `--reranking`):
which pooling a model gets, the normalisation of a pooled vector (embd_normalize), and the
reranking prompt. Pure: numpy only.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from ..errors import UsageError

POOLINGS = ("none", "mean", "cls", "last", "rank")  # llama_pooling_type 0..4


def ranks(asked: str | None, reranking: bool) -> bool:
    """Whether the server reranks (--reranking, or --pooling rank): then a dense model is served too
    (every reranker llama.cpp runs is dense), for /rerank and /embeddings only (cannot_generate)."""
    return reranking or asked == "rank"


def cannot_generate(arch: str, causal: bool, moe: bool, model: str = "the model") -> str | None:
    """Why a served model generates no text (None: it does): an encoder (non-causal attention) has no
    next-token output, and Spark generates with Mixture-of-Experts models only."""
    if not causal:
        return (f"{model} is an encoder ({arch}, non-causal attention): it has no next-token output, so it "
                "cannot generate text; it serves /rerank and /embeddings")
    if not moe:
        return (f"{model} is a dense {arch} model, served for /rerank and /embeddings only: Spark generates "
                "with Mixture-of-Experts models (use llama.cpp for a dense one)")
    return None


def choose_pooling(asked: str | None, reranking: bool, model_pooling: int, has_classifier: bool,
                   model: str = "the model") -> str:
    """The pooling the context is made with: --reranking's rank, else --pooling, else the GGUF's
    own (`<arch>.pooling_type`), else `last` (a decoder's usual). UsageError for a name llama.cpp
    lacks, or ranking without a classifier head."""
    if asked is not None and asked not in POOLINGS:
        raise UsageError(f"--pooling {asked}: expected one of {', '.join(POOLINGS)}")
    if ranks(asked, reranking):
        if not has_classifier:
            raise UsageError(f"{'--reranking' if reranking else '--pooling rank'}: {model} has no classifier head "
                             "(cls.* tensors), so it cannot rerank", hint="serve a reranker model, or drop the flag")
        return "rank"
    if asked is not None:
        return asked
    if 0 <= model_pooling < len(POOLINGS) and POOLINGS[model_pooling] != "rank":
        return POOLINGS[model_pooling]
    return "last"


def normalized(vec: np.ndarray, norm: int) -> list[float]:
    """llama.cpp's common_embd_normalize: -1 none, 0 max absolute (int16 range), 2 euclidean,
    else the p-norm."""
    v = vec.astype(np.float64)
    if norm == -1:
        total = 1.0
    elif norm == 0:
        total = float(np.max(np.abs(v), initial=0.0)) / 32760.0
    elif norm == 2:
        total = math.sqrt(float(np.sum(v * v)))
    else:
        total = float(np.sum(np.abs(v) ** norm)) ** (1.0 / norm)
    scale = 1.0 / total if total > 0 else 0.0
    return [float(x) for x in (v * scale).astype(np.float32)]


def rerank_prompt(query: Sequence[int], doc: Sequence[int], bos: int = -1, eos: int = -1, sep: int = -1) -> list[int]:
    """llama-server's format_prompt_rerank without a template: [BOS]query[EOS][SEP]doc[EOS]
    (-1: the vocabulary does not add that token)."""
    out = [bos, *query, eos, sep, *doc, eos]
    return [t for t in out if t >= 0]


def rerank_text(template: str, query: str, doc: str) -> str:
    """A GGUF's rerank template (tokenizer.chat_template.rerank) with the query and the document."""
    return template.replace("{query}", query).replace("{document}", doc)


def rerank_results(scores: Sequence[float], n_tokens: Sequence[int], texts: Sequence[str], top_n: int, tei: bool,
                   return_text: bool, model: str) -> dict[str, Any] | list[dict[str, Any]]:
    """llama-server's format_response_rerank: the documents by score, best first, at most top_n;
    TEI's list (`score`, `text` with return_text) or Jina's body (`relevance_score`, usage)."""
    label = "score" if tei else "relevance_score"
    elems = [{"index": i, label: float(s), **({"text": texts[i]} if tei and return_text else {})}
             for i, s in enumerate(scores)]
    elems = sorted(elems, key=lambda e: -e[label])[:max(0, top_n)]
    if tei:
        return elems
    n = sum(n_tokens)
    return {"model": model, "object": "list", "usage": {"prompt_tokens": n, "total_tokens": n}, "results": elems}
