"""Fill-in-the-middle prompts, as llama-server's `/infill` builds them (format_prompt_infill): the
repo-level pattern of the model's FIM tokens (arXiv 2409.12186). Pure: the tokenizer is passed in.

    [FIM_REP]myproject\\n [FIM_SEP]file0\\n text0 ... [FIM_SEP]filename\\n
    [FIM_PRE]prefix+prompt [FIM_SUF]suffix [FIM_MID]

Without FIM_SEP the extra chunks are joined by a "--- snippet ---" line; with `spm` the suffix
comes first (SPM order). The prefix keeps its last 3/4 of a batch, the suffix what is left of the
batch's quarter after the prompt, the extra chunks the context past a batch and twice n_predict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

Tokenize = Callable[[str, bool], list[int]]  # (text, parse special tokens) -> ids, no BOS
SNIPPET = "\n\n--- snippet ---\n\n"
# llama.cpp's names of the FIM tokens (llama_vocab_fim_*), and the GGUF keys that give them
FIM_KEYS = {"prefix": "tokenizer.ggml.fim_pre_token_id", "suffix": "tokenizer.ggml.fim_suf_token_id",
            "middle": "tokenizer.ggml.fim_mid_token_id"}


@dataclass(frozen=True)
class FimTokens:
    """A vocabulary's FIM tokens (-1: none) and whether its prompts start with BOS."""

    pre: int = -1
    suf: int = -1
    mid: int = -1
    rep: int = -1
    sep: int = -1
    bos: int = -1
    add_bos: bool = False

    def missing(self) -> list[str]:
        """The FIM tokens /infill needs that the model lacks, by llama-server's names."""
        have = {"prefix": self.pre, "suffix": self.suf, "middle": self.mid}
        return [name for name, t in have.items() if t < 0]


@dataclass(frozen=True)
class ExtraChunk:
    """One of input_extra: a file's text the model sees before the prefix."""

    text: str
    filename: str = "tmp"


class NoFim(ValueError):
    """A model without the FIM tokens /infill needs."""

    def __init__(self, missing: list[str]):
        self.missing = missing
        keys = ", ".join(FIM_KEYS[m] for m in missing)
        super().__init__("Infill is not supported by this model: " + " ".join(f"{m} token is missing." for m in missing)
                         + f" (the GGUF gives no {keys}, and no token is named as one)")


def infill_tokens(fim: FimTokens, tokenize: Tokenize, prefix: str, suffix: str, extra: Sequence[ExtraChunk] = (),
                  prompt: str = "", *, n_batch: int, n_predict: int, n_ctx: int, spm: bool = False) -> list[int]:
    """The /infill prompt's token ids. NoFim when the model lacks a FIM token it needs."""
    if fim.missing():
        raise NoFim(fim.missing())
    extra_toks: list[int] = []
    if fim.rep >= 0:
        extra_toks += [fim.rep, *tokenize("myproject\n", False)]
    for chunk in extra:
        extra_toks += [fim.sep, *tokenize(chunk.filename + "\n", False)] if fim.sep >= 0 else tokenize(SNIPPET, False)
        extra_toks += tokenize(chunk.text, False)
    if fim.sep >= 0:
        extra_toks += [fim.sep, *tokenize("filename\n", False)]
    # NOTE: as llama-server's: the prompt's special tokens are parsed, the code's are text
    pre, suf, mid = tokenize(prefix, False), tokenize(suffix, False), tokenize(prompt, True) if prompt else []
    n_pre = min(len(pre), 3 * (n_batch // 4))
    n_suf = min(len(suf), max(0, n_batch // 4 - (2 + len(mid))))
    n_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra_toks))
    head = [fim.pre, *pre[len(pre) - n_pre:], *mid]
    tail = [fim.suf, *suf[:n_suf]]
    first, last = (tail, head) if spm else (head, tail)
    if fim.add_bos and fim.bos >= 0:
        first = [fim.bos, *first]
    return [*extra_toks[len(extra_toks) - n_extra:], *first, *last, fim.mid]
