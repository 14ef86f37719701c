"""Profiling corpora: read a file or a folder of .txt/.md/.jsonl, and cut documents into
token chunks that fit the context.

A `.jsonl` line is `{"messages": [{"role": ..., "content": ...}, ...]}` (a chat, rendered
later with the model's chat template) or `{"text": ...}`. Files that are not UTF-8 are
skipped and counted; files that cannot be read are listed; an empty result is an error.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

from .regular import read_regular
from ..errors import ProfileError

SUFFIXES = (".txt", ".md", ".jsonl")
MAX_CORPUS_FILE = 64 << 20  # one corpus file at most (a link to /dev/zero never ends)
MIN_CHUNK = 2  # a one-token ubatch would be routed as decode


class CorpusError(ProfileError):
    """A corpus path that is missing or holds no usable text."""


@dataclass
class Document:
    source: str  # file name, or "file.jsonl:LINE"
    text: str | None = None
    messages: list[dict[str, str]] | None = None  # a chat: rendered by the model's template

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


@dataclass
class Corpus:
    root: Path
    documents: list[Document] = field(default_factory=list)
    files: int = 0  # files that gave at least one document
    non_utf8: list[Path] = field(default_factory=list)  # skipped
    unreadable: list[tuple[Path, str]] = field(default_factory=list)  # (path, reason)
    bad_lines: int = 0  # .jsonl lines not JSON (or with lone surrogates, huge integers), or neither messages nor text
    ignored: int = 0  # files of other types in a folder
    empty: int = 0  # files or records without text

    @property
    def n_chat(self) -> int:
        return sum(d.is_chat for d in self.documents)

    def summary(self) -> str:
        parts = [f"{len(self.documents)} documents ({self.n_chat} chats) from {self.files} files"]
        skipped = [(len(self.non_utf8), "non-UTF-8 files"), (len(self.unreadable), "unreadable files"),
                   (self.bad_lines, "invalid .jsonl lines"), (self.empty, "empty files or records"),
                   (self.ignored, "files of other types")]
        extra = [f"{n} {what}" for n, what in skipped if n]
        return parts[0] + (f"; skipped {', '.join(extra)}" if extra else "")


def bundled_corpus() -> Path:
    """The small sample corpus shipped with Spark (prose, code, chat)."""
    return Path(__file__).resolve().parents[1] / "data" / "corpus"


def _files(root: Path) -> tuple[list[Path], int]:
    """Corpus files under a folder (sorted, hidden entries skipped) and the count of others."""
    out, ignored = [], 0
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if name.startswith("."):
                continue
            p = Path(dirpath) / name
            if p.suffix.lower() in SUFFIXES:
                out.append(p)
            else:
                ignored += 1
    return out, ignored


def _messages(obj: object) -> list[dict[str, str]] | None:
    if not isinstance(obj, list) or not obj:
        return None
    out = []
    for m in obj:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return None
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _read_jsonl(path: Path, name: str, text: str, corpus: Corpus) -> list[Document]:
    docs = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            json.dumps(obj, ensure_ascii=False).encode("utf-8")  # NOTE: "\ud800" escapes decode to lone surrogates
        except (ValueError, RecursionError):  # not JSON, a lone surrogate, an integer past int's digits, too deep
            corpus.bad_lines += 1
            continue
        where = f"{name}:{i}"
        msgs = _messages(obj.get("messages")) if isinstance(obj, dict) else None
        if msgs is not None:
            if any(m["content"].strip() for m in msgs):
                docs.append(Document(where, messages=msgs))
            else:
                corpus.empty += 1
        elif isinstance(obj, dict) and isinstance(obj.get("text"), str):
            if obj["text"].strip():
                docs.append(Document(where, text=obj["text"]))
            else:
                corpus.empty += 1
        else:
            corpus.bad_lines += 1
    return docs


def _read_file(path: Path, name: str, corpus: Corpus) -> None:
    try:
        data = read_regular(path, MAX_CORPUS_FILE)
    except OSError as e:
        corpus.unreadable.append((path, e.strerror or type(e).__name__))
        return
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        corpus.non_utf8.append(path)
        return
    if path.suffix.lower() == ".jsonl":
        docs = _read_jsonl(path, name, text, corpus)
    elif text.strip():
        docs = [Document(name, text=text)]
    else:
        docs = []
        corpus.empty += 1
    if docs:
        corpus.files += 1
        corpus.documents.extend(docs)


def read_corpus(path: Path | str) -> Corpus:
    """Documents of a file (any name; .jsonl by its suffix) or of a folder's .txt/.md/.jsonl.

    Raises CorpusError for a missing path or when no document has text.
    """
    root = Path(path)
    corpus = Corpus(root)
    if root.is_dir():
        files, corpus.ignored = _files(root)
    elif root.exists() or root.is_symlink():
        files = [root]
    else:
        raise CorpusError(f"--corpus {root}: no such file or folder")
    for f in files:
        _read_file(f, str(f.relative_to(root)) if f != root else f.name, corpus)
    if not corpus.documents:
        why = corpus.summary().split("; ", 1)
        raise CorpusError(f"--corpus {root}: no text to profile" + (f" ({why[1]})" if len(why) > 1 else ""),
                          hint=f"give a text file or a folder of {', '.join(SUFFIXES)} files")
    return corpus


# ---------------------------------------------------------------- chunking

@dataclass
class Chunk:
    source: str
    tokens: list[int]


def chunk_tokens(tokens: Sequence[int], max_len: int, prefix: Sequence[int] = ()) -> list[list[int]]:
    """Cut `tokens` into pieces of at most `max_len` tokens, each starting with `prefix` (BOS).

    Pieces are as even as possible (no short tail); a piece shorter than MIN_CHUNK is dropped.
    """
    room = max_len - len(prefix)
    if room < 1:
        raise ValueError(f"max_len {max_len} leaves no room after a prefix of {len(prefix)}")
    n = len(tokens)
    if n == 0:
        return []
    pieces = -(-n // room)
    base, extra = divmod(n, pieces)
    out, start = [], 0
    for i in range(pieces):
        size = base + (i < extra)
        piece = list(prefix) + list(tokens[start:start + size])
        start += size
        if len(piece) >= MIN_CHUNK:
            out.append(piece)
    return out


def make_chunks(documents: Sequence[Document], max_len: int,
                tokenize: Callable[[str, bool], list[int]],
                render_chat: Callable[[list[dict[str, str]]], str],
                prefix: Sequence[int] = ()) -> Iterator[Chunk]:
    """Token chunks of every document, in order.

    `tokenize(text, parse_special)` must not add BOS: `prefix` starts each chunk instead, so
    that a long document's later chunks begin like a fresh prompt. Chats are rendered with
    `render_chat` and tokenized with special tokens parsed (the template's markers).
    """
    for doc in documents:
        if doc.is_chat:
            toks = tokenize(render_chat(doc.messages or []), True)
            if prefix and toks[:len(prefix)] == list(prefix):
                toks = toks[len(prefix):]  # a template that writes BOS itself
        else:
            toks = tokenize(doc.text or "", False)
        for piece in chunk_tokens(toks, max_len, prefix):
            yield Chunk(doc.source, piece)
