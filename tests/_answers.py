"""Whether a model knows an answer, read from its logits with the answer's start forced: greedy
text itself follows the CPU's kernels (AVX2 and AVX-512 round differently, and a near-tie early in
the answer sends it elsewhere), the next-token ranking after a forced prefix does not."""

from __future__ import annotations

import numpy as np

QUESTION = "What is the capital of France?"
FORCED = "The capital of France is"


def top_next_piece(engine) -> str:
    """The model's most likely next piece after the question's chat prompt and FORCED (resets the engine)."""
    text = engine.vocab.chat_prompt([{"role": "user", "content": QUESTION}]) + FORCED
    engine.reset()
    row = engine.eval(engine.vocab.tokenize(text), logits="last")
    engine.reset()
    return engine.vocab.detokenize([int(np.argmax(row))])


def knows_paris(engine) -> bool:
    return top_next_piece(engine).strip() == "Paris"


# logits: AVX2 and AVX-512 kernels round differently by hundredths of a logit; a greedy answer whose
# every token leads its runner-up by this much is the same on both (spark demo's question: tested)
ROBUST_MARGIN = 0.5


def greedy_rows(engine, tokens: list[int], n_tokens: int) -> tuple[list[int], list[np.ndarray]]:
    """An eval/argmax loop after `tokens`: the greedy tokens, and the logits row each step chose
    from (the end-of-generation step's included)."""
    row = engine.eval(tokens, logits="last")
    out, rows = [], []
    for _ in range(n_tokens):
        rows.append(row)
        tok = int(np.argmax(row))
        if engine.vocab.is_eog(tok):
            break
        out.append(tok)
        row = engine.eval([tok], logits="last")
    return out, rows


def greedy_margins(engine, question: str, n_tokens: int) -> tuple[str, list[float]]:
    """The greedy answer to `question` and, at each step, the top token's lead over the runner-up in
    logits (resets the engine)."""
    engine.reset()
    out, rows = greedy_rows(engine, engine.vocab.tokenize(engine.vocab.chat_prompt([{"role": "user", "content": question}])),
                            n_tokens)
    engine.reset()
    return engine.vocab.detokenize(out), [float(np.diff(np.sort(row)[-2:])[0]) for row in rows]
