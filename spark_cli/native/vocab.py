"""A loaded model's vocabulary and chat templates: tokens, pieces, special tokens, prompts."""

from __future__ import annotations

import ctypes
from typing import Callable, Sequence

from ..core.chat_template import BoundTemplates, ChatTemplate, TemplateSet
from ..core.embedding import rerank_prompt, rerank_text
from ..core.fim import FimTokens
from ..core.gguf_info import ModelGeometry
from ..errors import SparkError


class Vocab:
    """Tokenizer and templates of one llama_model (`Engine.vocab`). `handle` is the llama_vocab."""

    def __init__(self, lc, model, geometry: Callable[[], ModelGeometry], chat_templates: TemplateSet | None):
        self.lc, self.model = lc, model
        self.handle = lc.llama_model_get_vocab(model)
        self.n_tokens = lc.llama_vocab_n_tokens(self.handle)
        self._geometry = geometry  # read on first use (the GGUF's templates)
        self._chat_templates = chat_templates  # None: the GGUF's own; empty: llama.cpp's built-in matcher
        self._templates: BoundTemplates | None = None
        self._eog: list[int] | None = None

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        lc = self.lc
        data = text.encode("utf-8")
        n_max = len(data) + 16
        buf = (lc.llama_token * n_max)()
        n = lc.llama_tokenize(self.handle, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            buf = (lc.llama_token * -n)()
            n = lc.llama_tokenize(self.handle, data, len(data), buf, -n, add_special, parse_special)
        return list(buf[:n])

    def piece(self, token: int, special: bool = False) -> bytes:
        buf = ctypes.create_string_buffer(256)
        n = self.lc.llama_token_to_piece(self.handle, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self.lc.llama_token_to_piece(self.handle, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", errors="replace")

    def server_text(self, tokens: Sequence[int]) -> str:
        """The tokens as llama-server shows a prompt (common_detokenize with special tokens: its
        BOS text, a SentencePiece first word's leading space): llama_detokenize, nothing removed."""
        lc = self.lc
        ids = (lc.llama_token * max(1, len(tokens)))(*tokens)
        n_max = 8 * len(tokens) + 16
        buf = ctypes.create_string_buffer(n_max)
        n = lc.llama_detokenize(self.handle, ids, len(tokens), buf, n_max, False, True)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = lc.llama_detokenize(self.handle, ids, len(tokens), buf, -n, False, True)
        return buf.raw[:n].decode("utf-8", errors="replace")

    @property
    def bos_token(self) -> int:
        return int(self.lc.llama_vocab_bos(self.handle))

    @property
    def adds_bos(self) -> bool:
        """Whether tokenizing adds a BOS (llama_vocab_get_add_bos)."""
        return bool(self.lc.llama_vocab_get_add_bos(self.handle))

    @property
    def eos_token(self) -> int:
        return int(self.lc.llama_vocab_eos(self.handle))

    def rerank_tokens(self, query: str, doc: str) -> list[int]:
        """llama-server's reranking prompt: the GGUF's rerank template filled in, else
        [BOS]query[EOS][SEP]doc[EOS] as the vocabulary adds those tokens."""
        tmpl = self.templates.set.templates.get("tokenizer.chat_template.rerank")
        if tmpl:
            return self.tokenize(rerank_text(tmpl, query, doc), add_special=False, parse_special=True)
        lc, h = self.lc, self.handle
        eos = self.eos_token if self.eos_token >= 0 else int(lc.llama_vocab_sep(h))
        return rerank_prompt(self.tokenize(query, add_special=False, parse_special=False),
                             self.tokenize(doc, add_special=False, parse_special=False),
                             self.bos_token if self.adds_bos else -1,
                             eos if lc.llama_vocab_get_add_eos(h) else -1,
                             int(lc.llama_vocab_sep(h)) if lc.llama_vocab_get_add_sep(h) else -1)

    def fim_tokens(self) -> FimTokens:
        """The FIM tokens llama.cpp found (the GGUF's tokenizer.ggml.fim_*_token_id, else tokens
        named as them) and whether prompts start with BOS."""
        lc, h = self.lc, self.handle
        ids = [int(f(h)) for f in (lc.llama_vocab_fim_pre, lc.llama_vocab_fim_suf, lc.llama_vocab_fim_mid,
                                   lc.llama_vocab_fim_rep, lc.llama_vocab_fim_sep)]
        return FimTokens(*ids, bos=self.bos_token, add_bos=self.adds_bos)

    def is_eog(self, token: int) -> bool:
        return bool(self.lc.llama_vocab_is_eog(self.handle, token))

    @property
    def eog_tokens(self) -> list[int]:
        """Every end-of-generation token of the vocabulary (found once)."""
        if self._eog is None:
            self._eog = [t for t in range(self.n_tokens) if self.is_eog(t)]
        return self._eog

    @property
    def templates(self) -> BoundTemplates:
        """The chat templates prompts are rendered with: --chat-template-file's, else the GGUF's."""
        if self._templates is None:
            tset = self._chat_templates
            if tset is None:
                tset = TemplateSet(dict(self._geometry().chat_templates))
            self._templates = tset.with_tokens(self._special_text(self.bos_token), self._special_text(self.eos_token))
        return self._templates

    def _special_text(self, token: int) -> str:
        return self.piece(token, special=True).decode("utf-8", errors="replace") if token >= 0 else ""

    def chat_template(self, with_tools: bool = False) -> ChatTemplate | None:
        """The Jinja template a prompt (with tools or without) is rendered with; None: the built-in matcher."""
        return self.templates.pick(with_tools)

    def chat_prompt(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                    tools: Sequence[dict] | None = None, extras: dict | None = None) -> str:
        """Format messages: the model's Jinja template (core/chat_template.py), else llama.cpp's
        built-in templates (a GGUF without a template, or --no-jinja)."""
        tmpl = self.chat_template(bool(tools))
        if tmpl is not None:
            return tmpl.render(messages, tools=tools, add_generation_prompt=add_generation_prompt, extras=extras)
        return self._builtin_prompt(messages, add_generation_prompt)

    def _builtin_prompt(self, messages: Sequence[dict], add_generation_prompt: bool) -> str:
        lc = self.lc
        name = self.templates.set.builtin
        tmpl = name.encode("utf-8") if name else lc.llama_model_chat_template(self.model, None)
        messages = [{"role": m["role"], "content": m.get("content") or ""} for m in messages]
        if not tmpl:
            # NOTE: a model without a template gets a plain transcript
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            return text + ("assistant:" if add_generation_prompt else "")
        arr = (lc.llama_chat_message * len(messages))()
        keep = []
        for i, m in enumerate(messages):
            role, content = m["role"].encode(), m["content"].encode()
            keep += [role, content]
            arr[i] = lc.llama_chat_message(role, content)
        size = sum(len(m["content"]) for m in messages) * 2 + 1024
        for _ in range(2):
            buf = ctypes.create_string_buffer(size)
            n = lc.llama_chat_apply_template(tmpl, arr, len(messages), add_generation_prompt, buf, size)
            if n < 0 and name:
                raise SparkError(f"--chat-template {name}: not one of llama.cpp's built-in templates",
                                 hint="give one such as chatml, llama3 or command-r, or a Jinja template")
            if n < 0:
                raise SparkError("the model's chat template is not supported by llama.cpp",
                                 hint="use --prompt with raw text")
            if n <= size:
                return buf.raw[:n].decode("utf-8", errors="replace")
            size = n + 1
        raise SparkError("chat template output kept growing")
