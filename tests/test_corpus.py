"""Corpus reading (file types, bad files) and token chunking; no model needed."""

from __future__ import annotations

import json

import pytest

from spark_cli.files.corpus import (MIN_CHUNK, Chunk, CorpusError, Document, bundled_corpus, chunk_tokens, make_chunks,
                              read_corpus)
from spark_cli.errors import ProfileError

LATIN1 = "caf\u00e9 cr\u00e8me br\u00fbl\u00e9e, na\u00efve fa\u00e7ade\n".encode("latin-1")


def _write_folder(root):
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("Plain prose about rivers and bridges.\n", encoding="utf-8")
    (root / "sub" / "b.md").write_text("# Title\n\nSome *markdown* text.\n", encoding="utf-8")
    lines = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {"text": "a plain record"},
        {"messages": [{"role": "user"}]},  # no content: invalid
        {"other": 1},  # neither messages nor text: invalid
        {"text": "   "},  # empty record
    ]
    body = "\n".join(json.dumps(x) for x in lines) + "\nnot json at all\n\n"
    (root / "c.jsonl").write_text(body, encoding="utf-8")
    (root / "latin.txt").write_bytes(LATIN1)
    (root / "empty.md").write_text("  \n", encoding="utf-8")
    (root / "image.png").write_bytes(b"\x89PNG")
    (root / ".hidden.txt").write_text("never read", encoding="utf-8")
    (root / "gone.txt").symlink_to(root / "does-not-exist.txt")


def test_folder_file_types_and_bad_files(tmp_path):
    _write_folder(tmp_path)
    c = read_corpus(tmp_path)
    by_source = {d.source: d for d in c.documents}
    assert sorted(by_source) == ["a.txt", "c.jsonl:1", "c.jsonl:2", "sub/b.md"]
    chat = by_source["c.jsonl:1"]
    assert chat.is_chat and chat.messages == [{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "hello"}]
    assert by_source["c.jsonl:2"].text == "a plain record" and not by_source["c.jsonl:2"].is_chat
    assert by_source["sub/b.md"].text.startswith("# Title")
    assert [p.name for p in c.non_utf8] == ["latin.txt"]
    assert [(p.name, why) for p, why in c.unreadable] == [("gone.txt", "No such file or directory")]
    assert c.bad_lines == 3  # no content, no messages/text, not JSON
    assert c.empty == 2  # empty.md and the blank record
    assert c.ignored == 1  # image.png; hidden files are not counted
    assert c.files == 3 and c.n_chat == 1
    s = c.summary()
    assert "4 documents (1 chats) from 3 files" in s
    for part in ("1 non-UTF-8 files", "1 unreadable files", "3 invalid .jsonl lines", "1 files of other types"):
        assert part in s


def test_single_file_of_any_name(tmp_path):
    p = tmp_path / "notes.log"
    p.write_text("one document\n", encoding="utf-8")
    c = read_corpus(p)
    assert [(d.source, d.text) for d in c.documents] == [("notes.log", "one document\n")]
    bom = tmp_path / "bom.txt"
    bom.write_bytes("\ufeffwith a byte-order mark".encode("utf-8"))
    assert read_corpus(bom).documents[0].text == "with a byte-order mark"


@pytest.mark.parametrize("make,expect", [
    (lambda d: None, "no text to profile"),
    (lambda d: (d / "x.txt").write_bytes(LATIN1), "1 non-UTF-8 files"),
    (lambda d: (d / "x.jsonl").write_text('{"nope": 1}\n'), "1 invalid .jsonl lines"),
    (lambda d: (d / "x.md").write_text("\n\n"), "1 empty files or records"),
])
def test_empty_corpus_is_an_error(tmp_path, make, expect):
    make(tmp_path)
    with pytest.raises(CorpusError) as e:
        read_corpus(tmp_path)
    assert expect in e.value.one_line() and e.value.exit_code == ProfileError.exit_code
    assert "\n" not in e.value.one_line()


def test_missing_corpus(tmp_path):
    with pytest.raises(CorpusError, match="no such file or folder"):
        read_corpus(tmp_path / "nope")


@pytest.mark.parametrize("n,max_len,prefix,sizes", [
    (10, 4, (), [4, 3, 3]),  # even pieces, no short tail
    (10, 5, (1,), [5, 4, 4]),  # every piece starts with the prefix
    (3, 10, (1,), [4]),
    (0, 10, (1,), []),
    (1, 10, (), []),  # below MIN_CHUNK: dropped
    (9, 2, (), [2, 2, 2, 2, 1]),  # would be one token: the last is dropped
])
def test_chunk_tokens(n, max_len, prefix, sizes):
    toks = list(range(100, 100 + n))
    pieces = chunk_tokens(toks, max_len, prefix)
    sizes = [s for s in sizes if s >= MIN_CHUNK]
    assert [len(p) for p in pieces] == sizes
    assert all(len(p) <= max_len and tuple(p[:len(prefix)]) == prefix for p in pieces)
    body = [t for p in pieces for t in p[len(prefix):]]
    assert body == toks[:len(body)]  # order kept, nothing duplicated


def test_chunk_tokens_needs_room():
    with pytest.raises(ValueError):
        chunk_tokens([1, 2, 3], 1, prefix=(0,))


def test_make_chunks_renders_chats_and_cuts_long_documents():
    seen = []

    def tokenize(text, special):
        seen.append((text, special))
        return [0, *range(1, len(text.split()) + 1)] if text.startswith("<s>") else list(range(1, len(text.split()) + 1))

    def render(msgs):
        return "<s> " + " ".join(f"{m['role']}: {m['content']}" for m in msgs)

    docs = [Document("long.txt", text=" ".join(["w"] * 25)),
            Document("c.jsonl:1", messages=[{"role": "user", "content": "a b"}])]
    chunks = list(make_chunks(docs, 10, tokenize, render, prefix=[0]))
    assert [c.source for c in chunks] == ["long.txt"] * 3 + ["c.jsonl:1"]
    assert [len(c.tokens) for c in chunks] == [10, 9, 9, 5]
    assert all(isinstance(c, Chunk) and c.tokens[0] == 0 for c in chunks)
    assert chunks[3].tokens.count(0) == 1  # a template's own BOS is not doubled
    assert seen == [(docs[0].text, False), ("<s> user: a b", True)]  # specials parsed in chats only


def test_bundled_corpus():
    root = bundled_corpus()
    size = sum(p.stat().st_size for p in root.iterdir())
    assert 3000 <= size <= 6500
    c = read_corpus(root)
    assert {d.source.rsplit(".", 1)[-1].split(":")[0] for d in c.documents} == {"txt", "md", "jsonl"}
    assert c.n_chat >= 3 and not (c.non_utf8 or c.unreadable or c.bad_lines or c.empty)
