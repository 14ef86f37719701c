"""One request's generation on the server's engine, through `spark chat`'s answer loop.

`RequestSession` is a `ChatSession` whose prompt is the request's own (every message, or a
raw completion prompt) instead of the session history, so KV prefix reuse, the generation loop
(native/generate.py, which also cuts stop strings), cache figures and decode-count harvesting
are the ones `spark chat` runs.
"""

from __future__ import annotations

from typing import Callable, Sequence

from ..runs.chat_session import Answer, ChatSession, Sampling, _Learned
from ..errors import SparkError
from ..native.generate import TokenProbs


class ContextError(SparkError):
    """The prompt does not fit the context."""

    def __init__(self, message: str, n_prompt: int, n_ctx: int, **kw):
        super().__init__(message, **kw)
        self.n_prompt, self.n_ctx = n_prompt, n_ctx


def continued(prompt: str, content: str) -> str | None:
    """`prompt` cut right after the last occurrence of `content` (the end-of-turn markers after it
    dropped), or None when the template did not render `content` as given."""
    k = prompt.rfind(content)
    return prompt[:k + len(content)] if k >= 0 else None


class RequestSession(ChatSession):
    """A ChatSession over a fixed prompt; `kv` is the server's record of the KV cache."""

    def __init__(self, engine, sampling: Sampling, kv: list[int], cached_layers: set[int]):
        super().__init__(engine, sampling, cached_layers=cached_layers)
        self._kv = list(kv)
        self._prompt: list[int] = []

    def set_chat(self, messages: list[dict], tools: list[dict] | None = None, extras: dict | None = None,
                 prefill: bool = False) -> str:
        """Render the messages with the model's template (tools included); the prompt text.
        `prefill`: the last message is the assistant's, and the prompt ends where its text does, so
        the answer continues it (llama-server's prefill); a template that rewrites that text gets
        a fresh assistant turn after it instead."""
        text = None
        if prefill and messages[-1].get("content"):
            whole = self.engine.chat_prompt(messages, add_generation_prompt=False, tools=tools, extras=extras)
            text = continued(whole, messages[-1]["content"])
        if text is None:
            text = self.engine.chat_prompt(messages, tools=tools, extras=extras)
        self._prompt = self._prompt_tokens(text)
        return text

    @property
    def prompt_tokens(self) -> int:
        return len(self._prompt)

    def set_text(self, prompt: str | Sequence[int | str]) -> str:
        """A completion's prompt: text, or llama-server's list of token ids and texts (only the
        first text gets the BOS); the prompt's text. A token id past the vocabulary: SparkError."""
        if isinstance(prompt, str):
            self._prompt = self.engine.tokenize(prompt, add_special=True, parse_special=True)
            return prompt
        n_vocab = getattr(self.engine, "n_vocab", None)
        toks: list[int] = []
        for i, part in enumerate(prompt):
            if isinstance(part, str):
                toks += self.engine.tokenize(part, add_special=i == 0, parse_special=True)
            elif n_vocab is not None and not 0 <= part < n_vocab:
                raise SparkError(f"prompt: token {part} is not in the vocabulary (0 to {n_vocab - 1})")
            else:
                toks.append(part)
        self._prompt = toks
        return self.engine.detokenize(toks)

    def _fit(self, user: str) -> tuple[list[int], int]:
        n_ctx = self.engine.n_ctx
        if len(self._prompt) >= n_ctx:
            raise ContextError(f"the request needs {len(self._prompt)} prompt tokens but the context holds {n_ctx}",
                               len(self._prompt), n_ctx,
                               hint="shorten the messages or start spark serve with a larger -c")
        return list(self._prompt), 0

    def run(self, on_text: Callable[[str], None], should_stop: Callable[[], bool], stops: Sequence[str] = (),
            special: bool = False, on_probs: Callable[[TokenProbs], None] | None = None) -> Answer:
        """Generate; text that may begin a stop string is held back, and one ends the answer (stop).
        With Sampling.n_probs, each token's probabilities go to on_probs before its text."""
        self.learned = _Learned()  # this request's decode counts only
        return self.answer("", on_text=on_text, should_stop=should_stop, stops=stops, special=special,
                           on_probs=on_probs)

    @property
    def kv(self) -> list[int]:
        return self._kv
