"""scripts/build_native.py: patch failures name the file and hunk; the cache key follows native/."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow  # unpacks and hashes the sdist: not in the fast tier


def _module():
    spec = importlib.util.spec_from_file_location("build_native", REPO / "scripts" / "build_native.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_native_patch_applies_to_the_pinned_sdist(tmp_path):
    bn = _module()
    sdist = bn.fetch_sdist()
    import tarfile

    with tarfile.open(sdist) as tf:
        members = [m for m in tf.getmembers() if "/vendor/llama.cpp/src/" in m.name or "/vendor/llama.cpp/include/" in m.name]
        tf.extractall(tmp_path, members=members)
    vendor = next(tmp_path.glob("*/vendor/llama.cpp"))
    bn.apply_native(vendor)
    assert (vendor / "src" / "llama-expert-cache.cpp").exists()
    assert (vendor / "include" / "llama-expert-cache-api.h").exists()
    assert "ecache->build(" in (vendor / "src" / "llama-graph.cpp").read_text()


def test_a_patch_that_does_not_apply_names_file_and_hunk(tmp_path, monkeypatch):
    bn = _module()
    native = tmp_path / "native"
    (native / "patches").mkdir(parents=True)
    (native / "src").mkdir()
    (native / "include").mkdir()
    vendor = tmp_path / "vendor"
    (vendor / "src").mkdir(parents=True)
    (vendor / "include").mkdir()
    (vendor / "src" / "a.cpp").write_text("one\ntwo\nthree\n")
    (native / "patches" / "0001-x.patch").write_text(
        "--- a/src/a.cpp\n+++ b/src/a.cpp\n@@ -1,3 +1,3 @@\n one\n-zwei\n+2\n three\n")
    monkeypatch.setattr(bn, "NATIVE", native)
    monkeypatch.setattr(bn, "REPO", tmp_path)
    with pytest.raises(bn.BuildError) as e:
        bn.apply_native(vendor)
    msg = str(e.value)
    assert "native/patches/0001-x.patch" in msg and "hunk #1" in msg and "src/a.cpp" in msg
    assert (vendor / "src" / "a.cpp").read_text() == "one\ntwo\nthree\n"  # nothing half-applied


def test_cache_key_changes_with_native_content(tmp_path, monkeypatch):
    bn = _module()
    native = tmp_path / "native"
    native.mkdir()
    (native / "x.h").write_text("a")
    monkeypatch.setattr(bn, "NATIVE", native)
    h1 = bn.native_hash()
    (native / "x.h").write_text("b")
    assert bn.native_hash() != h1


def test_cuda_detection_respects_spark_cuda(monkeypatch):
    bn = _module()
    monkeypatch.setenv("SPARK_CUDA", "0")
    assert bn.detect_cuda() == (False, None)
    monkeypatch.setenv("SPARK_CUDA", "1")
    monkeypatch.setenv("SPARK_CUDA_ARCH", "90")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(bn.BuildError, match="nvcc"):
        bn.detect_cuda()
    flags = bn.cmake_flags(True, "90")
    assert "-DGGML_CUDA=ON" in flags and "-DCMAKE_CUDA_ARCHITECTURES=90" in flags and "-DGGML_RPC=ON" in flags


def _fake_cublas(root: Path) -> Path:
    """An nvidia-cublas wheel's layout: versioned libraries only, headers beside them."""
    lib = root / "nvidia" / "cu13" / "lib"
    lib.mkdir(parents=True)
    (lib / "libcublas.so.13").write_bytes(b"")
    (lib / "libcublasLt.so.13").write_bytes(b"")
    (root / "nvidia" / "cu13" / "include").mkdir()
    (root / "nvidia" / "cu13" / "include" / "cublas_v2.h").write_text("")
    return lib


def test_cuda_build_takes_cublas_from_the_toolkit_else_from_the_pip_wheel(tmp_path, monkeypatch):
    """A toolkit without cuBLAS (nvcc alone) builds against PyPI's nvidia-cublas through unversioned
    links; a toolkit with cuBLAS adds no flags."""
    bn = _module()
    toolkit, site = tmp_path / "cuda", tmp_path / "site"
    (toolkit / "lib64").mkdir(parents=True)
    lib = _fake_cublas(site)
    monkeypatch.setenv("SPARK_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(bn, "cuda_toolkit_home", lambda: toolkit)
    monkeypatch.setattr(bn, "site_packages", lambda py: [str(site)])
    monkeypatch.setattr(bn.subprocess, "run", lambda *a, **k: pytest.fail(f"nothing to install: {a}"))
    flags = dict(f.split("=", 1) for f in bn.cublas_flags(Path("python")))
    assert Path(flags["-DCUDA_cublas_LIBRARY"]).name == "libcublas.so"
    assert Path(flags["-DCUDA_cublas_LIBRARY"]).resolve() == lib / "libcublas.so.13"
    assert Path(flags["-DCUDA_cublasLt_LIBRARY"]).resolve() == lib / "libcublasLt.so.13"
    assert flags["-DCMAKE_CUDA_FLAGS"] == f"-I{lib.parent / 'include'}"
    links = Path(flags["-DCUDA_cublas_LIBRARY"]).parent  # the libraries' RUNPATH: the loader's names too
    assert (links / "libcublas.so.13").resolve() == lib / "libcublas.so.13"
    assert (links / "libcublasLt.so.13").resolve() == lib / "libcublasLt.so.13"
    (toolkit / "lib64" / "libcublas.so.13").write_bytes(b"")
    (toolkit / "include").mkdir()
    (toolkit / "include" / "cublas_v2.h").write_text("")
    assert bn.cublas_flags(Path("python")) == []


def test_find_cublas_script_answers_for_gpu_bench(tmp_path):
    """scripts/find_cublas.py, as gpu_bench.sh runs it with a bare python3: the wheel's folders, or 1."""
    script = REPO / "scripts" / "find_cublas.py"
    none = subprocess.run([sys.executable, "-S", str(script), str(tmp_path / "cuda"), str(tmp_path / "empty")],
                          capture_output=True, text=True)
    assert none.returncode == 1 and none.stdout == ""
    lib = _fake_cublas(tmp_path / "site")
    r = subprocess.run([sys.executable, "-S", str(script), str(tmp_path / "cuda"), str(tmp_path / "site")],
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.split() == [str(lib), str(lib.parent / "include")]


def test_unchanged_rebuild_is_a_cache_hit(tmp_path, monkeypatch):
    """The running venv's build is the one this checkout's native/ keys, and a rebuild of it is a
    cache hit: the cached wheel is installed (into a scratch venv here, never the running one)
    and nothing is compiled."""
    bn = _module()
    running = bn.installed_key(Path(sys.executable))
    assert running, "llama_cpp in this venv was not installed by scripts/build_native.py"
    installs = []
    monkeypatch.setattr(bn, "installed_key", lambda py: None)
    monkeypatch.setattr(bn, "install_wheel", lambda py, wheel, key: installs.append((py, wheel, key)))
    real_run = bn.subprocess.run

    def no_compile(cmd, *a, **k):
        assert "wheel" not in cmd and "install" not in cmd, f"a cache hit ran {cmd}"
        return real_run(cmd, *a, **k)

    monkeypatch.setattr(bn.subprocess, "run", no_compile)
    info = bn.build(tmp_path / "venv")
    assert info["cache_hit"] and "RPC" in info["backends"]
    assert info["key"] == running, "native/ changed since this venv was built: rerun scripts/bootstrap.sh"
    (py, wheel, key), = installs
    assert py == tmp_path / "venv" / "bin" / "python" and key == running and wheel.suffix == ".whl"


def test_build_starts_from_an_empty_spark_home(tmp_path, monkeypatch):
    """A fresh SPARK_HOME: the folders the build writes into are created (stops before pip)."""
    bn = _module()
    sdist = bn.fetch_sdist()  # from the real cache, before SPARK_HOME moves
    monkeypatch.setenv("SPARK_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(bn, "fetch_sdist", lambda: sdist)
    monkeypatch.setattr(bn, "detect_cuda", lambda: (False, None))

    real_run = bn.subprocess.run

    def stop(cmd, *a, **k):
        if "pip" in cmd:
            raise bn.BuildError("stop before pip")
        return real_run(cmd, *a, **k)

    monkeypatch.setattr(bn.subprocess, "run", stop)
    with pytest.raises(bn.BuildError, match="stop before pip"):
        bn.build(tmp_path / "venv")
    assert (tmp_path / "home" / "native" / "src" / "cpu" / "vendor" / "llama.cpp" / "src" / "llama-expert-cache.cpp").exists()


def test_ci_runs_the_cuda_compile_tier_which_a_machine_without_nvcc_skips(tmp_path):
    """.ci/run has the CUDA compile tier; without nvcc on PATH the tier says so and fails nothing
    (it neither bootstraps nor builds)."""
    import shutil

    root = REPO
    ci = (root / ".ci" / "run").read_text()
    assert any("scripts/test_cuda_build" in l for l in ci.splitlines() if not l.lstrip().startswith("#"))
    assert os.access(root / "scripts" / "test_cuda_build", os.X_OK)
    bindir = tmp_path / "bin"  # the tools the script needs, nvcc not among them
    bindir.mkdir()
    for tool in ("bash", "dirname", "env"):
        os.symlink(shutil.which(tool), bindir / tool)
    r = subprocess.run([str(bindir / "bash"), str(root / "scripts" / "test_cuda_build")], capture_output=True,
                       text=True, env={"PATH": str(bindir)}, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip() == ("cuda tier: no nvcc on PATH: not run (install the CUDA toolkit to compile the "
                                "CUDA flavour)")
