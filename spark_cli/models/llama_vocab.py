"""llama.cpp's vendored test vocabularies (`vendor/llama.cpp/models/ggml-vocab-NAME.gguf`): the other
tokenizers a tiny model can carry (tiny_models.py `vocab=`), for what SmolLM2's lacks: FIM tokens
(/infill), a SentencePiece BOS, BERT's CLS/SEP (embeddings).

They come with the llama-cpp-python sdist scripts/build_native.py downloads and checks
($SPARK_HOME/downloads): read from that tarball once, checked against a pinned sha256 and kept
beside it; else from an unpacked build tree ($SPARK_HOME/native/src/*/). Never the network.
"""

from __future__ import annotations

import glob
import hashlib
import tarfile
from pathlib import Path

from ..errors import ModelFileError
from ..files.atomic import atomic_write_with, file_lock
from ..files.paths import downloads_dir, spark_home
from ..native.version import LLAMA_CPP_SDIST
from .gguf_write import lock_path

# name -> (sha256, what it gives a tiny model); the sdist's copies
VOCABS: dict[str, tuple[str, str]] = {
    "starcoder": ("fedb892b4e1bd3c1f2fcdae356440b14fb458f4264d586e5c987ed93df4e174d",
                  "StarCoder's BPE with FIM tokens (<fim_prefix>, <fim_suffix>, <fim_middle>): /infill"),
    "llama-spm": ("16c3724582d59aa8bf84711894e833f916ee46a31d80e21312759c48bf8d0e69",
                  "Llama 2's SentencePiece, BOS added"),
    "bert-bge": ("fbcbe22278fb302694d5f4a41bfe48c5f90e8e3554eab1c0435387dff654a854",
                 "bge-small-en-v1.5's WordPiece, CLS/SEP added: embeddings"),
}
MEMBER = "vendor/llama.cpp/models/ggml-vocab-{}.gguf"


def vendored_vocab(name: str) -> Path:
    """Path of llama.cpp's ggml-vocab-NAME.gguf in downloads_dir(), taken from the sdist once."""
    if name not in VOCABS:
        raise ValueError(f"vocab: must be one of {', '.join(VOCABS)}, got {name!r}")
    final = downloads_dir() / f"ggml-vocab-{name}.gguf"
    if final.is_file():
        return final
    with file_lock(lock_path(final)):
        if final.is_file():
            return final
        member = MEMBER.format(name)
        sdist = downloads_dir() / LLAMA_CPP_SDIST
        if sdist.is_file():
            with tarfile.open(sdist) as tf:
                try:
                    src = tf.extractfile(f"{LLAMA_CPP_SDIST.removesuffix('.tar.gz')}/{member}")
                except KeyError:
                    src = None
                if src is not None:
                    _write_checked(final, name, src)
                    return final
        for tree in sorted(glob.glob(str(spark_home() / "native" / "src" / "*" / member))):
            with open(tree, "rb") as src:
                _write_checked(final, name, src)
            return final
    raise ModelFileError(f"ggml-vocab-{name}.gguf: not in {sdist} nor in an unpacked build tree",
                         hint="build the native code first (scripts/build_native.py downloads that sdist)")


def _write_checked(final: Path, name: str, src) -> None:
    data = src.read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != VOCABS[name][0]:
        raise ModelFileError(f"ggml-vocab-{name}.gguf: sha256 {digest} is not the pinned {VOCABS[name][0]} "
                             f"(another llama-cpp-python than {LLAMA_CPP_SDIST}?)")
    atomic_write_with(final, lambda f: f.write(data))
