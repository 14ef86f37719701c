"""Text from the command line, stdin or a terminal, made valid UTF-8 for the tokenizer.

Python decodes argv (and, in a C locale, stdin) with surrogate escapes: bytes that are not
UTF-8 arrive as lone surrogates, which `str.encode("utf-8")` refuses. Here they become
U+FFFD replacement characters, counted so that the command can say so.
"""

from __future__ import annotations

import sys
from typing import BinaryIO


def _is_surrogate(c: str) -> bool:
    return 0xD800 <= ord(c) <= 0xDFFF


def utf8_text(text: str) -> tuple[str, int]:
    """(text with undecodable bytes and lone surrogates as U+FFFD, how many were replaced)."""
    bad = sum(1 for c in text if _is_surrogate(c))
    if not bad:
        return text, 0
    try:
        fixed = text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:  # a lone surrogate that stands for no byte
        fixed = "".join("\ufffd" if _is_surrogate(c) else c for c in text)
    return fixed, bad


def read_stream(stream: BinaryIO | None = None) -> tuple[str, int]:
    """All of a byte stream (default: stdin) as text; (text, bytes replaced by U+FFFD)."""
    data = (stream or sys.stdin.buffer).read()
    try:
        return data.decode("utf-8"), 0
    except UnicodeDecodeError:
        text = data.decode("utf-8", "replace")
        return text, max(1, text.count("\ufffd") - data.count("\ufffd".encode()))


def replaced_note(what: str, n: int) -> str:
    return f"{what}: not UTF-8; {n} undecodable byte{'s' if n != 1 else ''} replaced with \ufffd"
