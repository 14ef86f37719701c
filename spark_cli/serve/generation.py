"""One request's prompt on the server's engine: a chat rendered with the model's template
(tools, prefill) or a completion's text or token ids, checked against one slot's context.

The tokens are `spark chat`'s (chat_session.prompt_tokens); the generation itself is the
engine's one loop (native/generate.BatchLoop), driven by the worker's slots.
"""

from __future__ import annotations

from typing import Sequence

from ..errors import SparkError
from ..runs.chat_session import prompt_tokens


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


class RequestPrompt:
    """A request's prompt tokens (`tokens`) and text, from a chat or a completion."""

    def __init__(self, engine):
        self.engine = engine
        self.tokens: list[int] = []

    def set_chat(self, messages: list[dict], tools: list[dict] | None = None, extras: dict | None = None,
                 prefill: bool = False, add_generation_prompt: bool = True) -> str:
        """Render the messages with the model's template (tools included); the prompt text.
        `prefill`: the last message is the assistant's, and the prompt ends where its text does, so
        the answer continues it (llama-server's prefill); a template that rewrites that text gets
        a fresh assistant turn after it instead. `add_generation_prompt` False: no assistant
        turn is opened (llama-server's, for /apply-template)."""
        text = None
        if prefill and messages[-1].get("content"):
            whole = self.engine.vocab.chat_prompt(messages, add_generation_prompt=False, tools=tools, extras=extras)
            text = continued(whole, messages[-1]["content"])
        if text is None:
            text = self.engine.vocab.chat_prompt(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                                 extras=extras)
        self.tokens = prompt_tokens(self.engine, text)
        return text

    def set_text(self, prompt: str | Sequence[int | str]) -> str:
        """A completion's prompt: text, or llama-server's list of token ids and texts (only the
        first text gets the BOS); the prompt's text. A token id past the vocabulary: SparkError."""
        if isinstance(prompt, str):
            self.tokens = self.engine.vocab.tokenize(prompt, add_special=True, parse_special=True)
            return prompt
        n_vocab = getattr(self.engine, "n_vocab", None)
        toks: list[int] = []
        for i, part in enumerate(prompt):
            if isinstance(part, str):
                toks += self.engine.vocab.tokenize(part, add_special=i == 0, parse_special=True)
            elif n_vocab is not None and not 0 <= part < n_vocab:
                raise SparkError(f"prompt: token {part} is not in the vocabulary (0 to {n_vocab - 1})")
            else:
                toks.append(part)
        self.tokens = toks
        return self.engine.vocab.detokenize(toks)

    def check_fits(self) -> None:
        """ContextError when the prompt leaves no room in one slot's context."""
        n_ctx = self.engine.n_ctx
        if len(self.tokens) >= n_ctx:
            # NOTE: llama-server's words: clients match "exceeds the available context size"
            raise ContextError(f"request ({len(self.tokens)} tokens) exceeds the available context size ({n_ctx} "
                               "tokens), try increasing it",
                               len(self.tokens), n_ctx,
                               hint="shorten the messages or start spark serve with a larger -c "
                                    "(-c is split between the -np slots unless --kv-unified)")
