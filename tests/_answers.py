"""Whether a model knows an answer, read from its logits with the answer's start forced: greedy
text itself follows the CPU's kernels (AVX2 and AVX-512 round differently, and a near-tie early in
the answer sends it elsewhere), the next-token ranking after a forced prefix does not."""

from __future__ import annotations

import numpy as np

QUESTION = "What is the capital of France?"
FORCED = "The capital of France is"


def top_next_piece(engine) -> str:
    """The model's most likely next piece after the question's chat prompt and FORCED (resets the engine)."""
    text = engine.chat_prompt([{"role": "user", "content": QUESTION}]) + FORCED
    engine.reset()
    row = engine.eval(engine.tokenize(text), logits="last")
    engine.reset()
    return engine.detokenize([int(np.argmax(row))])


def knows_paris(engine) -> bool:
    return top_next_piece(engine).strip() == "Paris"
