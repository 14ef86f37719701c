"""Embeddings of a prompt on a loaded engine (llama-server's --embedding / --reranking): the prompt
is decoded in one slot's sequence with embeddings switched on, read back pooled (mean, cls, last:
one vector; rank: the classifier's scores) or per token (none), and the sequence is cleared.
The context was made with the pooling type (EngineOptions.pooling); generation goes on as before
between embeddings (llama_set_embeddings switches the output per decode)."""

from __future__ import annotations

import ctypes
from typing import Any, Sequence

import numpy as np

from ..errors import SparkError

POOLING = {"none": 0, "mean": 1, "cls": 2, "last": 3, "rank": 4}  # enum llama_pooling_type


class EmbedError(SparkError):
    """A prompt that cannot be embedded (too long for one micro-batch, empty)."""


def embed(engine: Any, tokens: Sequence[int], seq: int) -> np.ndarray:
    """[n_tokens, n_embd] with pooling none, else [n_out] (n_embd, or the classes of rank). The
    prompt must fit one micro-batch (pooling is computed per micro-batch, as llama-server requires)."""
    lc, ctx = engine.lib.lc, engine.ctx
    if not tokens:
        raise EmbedError("Input content cannot be empty")
    if len(tokens) > engine.n_ubatch:
        raise EmbedError(f"input ({len(tokens)} tokens) is too large to process. increase the physical batch size "
                         f"(current batch size: {engine.n_ubatch})")
    if len(tokens) >= engine.n_ctx:
        raise EmbedError(f"request ({len(tokens)} tokens) exceeds the available context size ({engine.n_ctx} tokens), "
                         "try increasing it")
    pooling = int(lc.llama_pooling_type(ctx))
    engine.seq_clear(seq)
    lc.llama_set_embeddings(ctx, True)
    try:
        engine.decode([(t, seq, True) for t in tokens])
        if pooling == POOLING["none"]:
            n = int(lc.llama_model_n_embd_out(engine.model))
            rows = [_floats(lc.llama_get_embeddings_ith(ctx, i), n) for i in range(len(tokens))]
            return np.stack(rows)
        n = int(lc.llama_model_n_cls_out(engine.model)) if pooling == POOLING["rank"] else int(
            lc.llama_model_n_embd_out(engine.model))
        return _floats(lc.llama_get_embeddings_seq(ctx, seq), n)
    finally:
        lc.llama_set_embeddings(ctx, False)
        engine.seq_clear(seq)


def _floats(ptr: Any, n: int) -> np.ndarray:
    if not ptr:
        raise SparkError("llama.cpp returned no embeddings for the prompt")
    return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(n,)).copy()
