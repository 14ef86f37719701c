#!/usr/bin/env python3
"""Write what scripts/gpu_bench.sh carries to a GPU machine that has no network and none of
Spark's build: two folders of at most 60 MiB each (the device tool carries 64 MiB a call).

  build/gpu-bundle/stage1/  src.tar.xz   llama.cpp from the pinned llama-cpp-python sdist with
                                         native/ applied, trimmed to what a CUDA + RPC build of
                                         the libraries needs (no models/, docs/, tools/, other backends)
                            py.tar.xz    pure-python packages: llama_cpp (the sdist's bindings),
                                         gguf and diskcache (from .venv); in fallback/ pyyaml,
                                         jinja2, markupsafe, typing_extensions for a bare python3
                            smollm2.part1  first bytes of the SmolLM2-135M GGUF (the demo model's source)
                            MANIFEST     sha256 of every file and of the whole GGUF
  build/gpu-bundle/stage2/  smollm2.part2, MANIFEST

build/ is ignored by git, so the bundles travel only when a call names them in `carry`.
Run with the project's venv: .venv/bin/python scripts/gpu_bundle.py [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20
LIMIT = 60 * MiB  # per stage folder; the working tree (< 1 MiB) travels too
KEEP_TOP = ("CMakeLists.txt", "cmake", "ggml", "src", "include", "vendor", "licenses", "LICENSE")
KEEP_BACKENDS = ("ggml-cpu", "ggml-cuda", "ggml-rpc")  # other ggml/src/ggml-* folders are dropped
SKIP_NAMES = ("__pycache__", ".git", ".github")
PACKAGES = ("gguf", "diskcache")  # not on the GPU machine
FALLBACK = ("yaml", "jinja2", "markupsafe", "typing_extensions")  # used only where python3 lacks them


def _load_build_native():
    spec = importlib.util.spec_from_file_location("build_native", REPO / "scripts" / "build_native.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def sha256(path: Path) -> str:
    return _load_build_native().sha256_file(path)


def _tar_xz(out: Path, root: Path, arcname: str, keep=lambda rel: True) -> int:
    def filt(ti: tarfile.TarInfo) -> tarfile.TarInfo | None:
        rel = Path(ti.name).relative_to(arcname) if ti.name != arcname else Path()
        if rel.parts and not keep(rel):
            return None
        ti.uid = ti.gid = 0
        ti.uname = ti.gname = ""
        return ti

    with tarfile.open(out, "w:xz", preset=6) as tf:
        tf.add(root, arcname=arcname, filter=filt)
    return out.stat().st_size


def _copy_module(name: str, dest: Path) -> None:
    """Copy an installed pure-python package or module (compiled extensions left out: their
    pure-python fallbacks serve another Python version)."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise SystemExit(f"gpu_bundle: the package {name} is not installed here; run scripts/bootstrap.sh")
    origin = Path(spec.origin)
    dest.mkdir(parents=True, exist_ok=True)
    if origin.name == "__init__.py":
        shutil.copytree(origin.parent, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    else:
        shutil.copy2(origin, dest / origin.name)


def _py_bundle(out: Path, sdist_tree: Path) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        stage = Path(tmp) / "py"
        shutil.copytree(sdist_tree / "llama_cpp", stage / "llama_cpp",
                        ignore=shutil.ignore_patterns("__pycache__", "lib"))
        for name in PACKAGES:
            _copy_module(name, stage)
        for name in FALLBACK:
            _copy_module(name, stage / "fallback")
        return _tar_xz(out, stage, "py")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "build" / "gpu-bundle"))
    args = ap.parse_args()
    out = Path(args.out)
    t0 = time.time()
    bn = _load_build_native()
    sdist = bn.fetch_sdist()
    sys.path.insert(0, str(REPO))
    from spark_cli.models.smollm2 import fetch_smollm2

    gguf = fetch_smollm2()
    if out.exists():
        shutil.rmtree(out)
    s1, s2 = out / "stage1", out / "stage2"
    s1.mkdir(parents=True)
    s2.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(sdist) as tf:
            tf.extractall(tmp, filter="tar") if hasattr(tarfile, "data_filter") else tf.extractall(tmp)
        tree = Path(tmp) / bn.SDIST_NAME.removesuffix(".tar.gz")
        vendor = tree / "vendor" / "llama.cpp"
        bn.apply_native(vendor)
        src_bytes = _tar_xz(s1 / "src.tar.xz", vendor, "llama.cpp", _keep_src_rel(vendor))
        py_bytes = _py_bundle(s1 / "py.tar.xz", tree)
    t_src = time.time() - t0

    size = gguf.stat().st_size
    first = LIMIT - src_bytes - py_bytes - 64 * 1024
    if first <= 0 or size - first > LIMIT:
        raise SystemExit(f"gpu_bundle: {size / MiB:.1f} MiB of GGUF does not fit two carries "
                         f"beside {(src_bytes + py_bytes) / MiB:.1f} MiB of sources")
    with open(gguf, "rb") as f:
        (s1 / "smollm2.part1").write_bytes(f.read(first))
        (s2 / "smollm2.part2").write_bytes(f.read())
    whole = sha256(gguf)
    for stage in (s1, s2):
        lines = [f"gguf {whole} {size} {gguf.name}"]
        lines += [f"file {sha256(p)} {p.stat().st_size} {p.name}" for p in sorted(stage.iterdir())]
        (stage / "MANIFEST").write_text("\n".join(lines) + "\n")
    for stage in (s1, s2):
        total = sum(p.stat().st_size for p in stage.iterdir())
        print(f"{stage.relative_to(REPO) if stage.is_relative_to(REPO) else stage}: {total / MiB:.1f} MiB "
              f"({', '.join(f'{p.name} {p.stat().st_size / MiB:.1f}' for p in sorted(stage.iterdir()))})")
        assert total <= LIMIT, stage
    print(f"sources {src_bytes / MiB:.1f} MiB + python {py_bytes / MiB:.1f} MiB packed in {t_src:.0f} s; "
          f"total {time.time() - t0:.0f} s")
    return 0


def _keep_src_rel(root: Path):
    def keep(rel: Path) -> bool:
        parts = rel.parts
        if not parts or parts[0] not in KEEP_TOP or any(p in SKIP_NAMES for p in parts):
            return False
        if parts[:2] == ("ggml", "src") and len(parts) > 2 and parts[2].startswith("ggml-") \
                and (root / "ggml" / "src" / parts[2]).is_dir() and parts[2] not in KEEP_BACKENDS:
            return False
        return True
    return keep


if __name__ == "__main__":
    sys.exit(main())
