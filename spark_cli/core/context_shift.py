"""llama-server's context shift (`--context-shift`): when an answer fills its slot's context, the
tokens after the first n_keep are halved (or n_discard of them dropped) and generation goes on.
Pure: which span a shift drops (server-context.cpp, pre_decode)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ContextShift:
    """A request's shift settings (llama-server's n_keep, n_discard) with what they are read against."""

    n_keep: int = 0  # prompt tokens always kept (-1: the whole prompt); the BOS is added to it
    n_discard: int = 0  # tokens dropped per shift (0: half of those after n_keep)
    n_prompt: int = 0  # the request's whole prompt (the cached part included)
    add_bos: bool = False  # the vocabulary adds a BOS (llama_vocab_get_add_bos)

    def span(self, n_past: int, n_ctx: int) -> tuple[int, int]:
        """(first position dropped, how many) once a sequence holds n_past of its n_ctx positions:
        llama-server's n_keep (+1 with a BOS, at most n_ctx - 4) and n_discard (clamped to leave
        at least one token after n_keep)."""
        keep = (self.n_prompt if self.n_keep < 0 else self.n_keep) + int(self.add_bos)
        keep = min(n_ctx - 4, keep)
        n_left = n_past - keep
        discard = self.n_discard if self.n_discard else n_left // 2
        return keep, min(max(discard, 0), max(0, n_left - 1))


def after_shifts(tokens: list[int], shifts: list[tuple[int, int]]) -> list[int]:
    """A sequence's tokens once each (n_keep, n_discard) shift, in order, dropped its span."""
    out = list(tokens)
    for keep, discard in shifts:
        del out[keep:keep + discard]
    return out
