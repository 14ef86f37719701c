#!/usr/bin/env python3
"""Build llama-cpp-python 0.3.36 from its sdist with Spark's native/ patch, cached.

Steps: download the sdist with pip and check its sha256; unpack it; copy native/'s new
files into vendor/llama.cpp and apply native/patches/*.patch (a hunk that does not apply
stops the build, naming the patch and hunk); build a wheel with CMake (always
-DGGML_RPC=ON; CUDA when nvcc and a GPU are present or SPARK_CUDA=1; Vulkan when a Vulkan
SDK and GPU are present or SPARK_VULKAN=1) and install it into the given virtualenv. Wheels are
cached under $SPARK_HOME/native, keyed by the sdist hash, the content of native/, the CMake flags
and RECIPE, so an unchanged rebuild takes seconds. llama.cpp's common library, which
llama-cpp-python builds but never installs, is left out. The patched, stock and Vulkan variants
share one source tree and build folder (per CPU or CUDA flavour), so the second and third build
recompile only what differs; a lock keeps two builds out of one folder.

Usage: python scripts/build_native.py [--venv .venv] [--force] [--stock]
Environment: SPARK_HOME (cache root), SPARK_CUDA=0|1, SPARK_CUDA_ARCH=90, SPARK_VULKAN=0|1,
SPARK_BUILD_JOBS (parallel compile jobs).

Vulkan: patches under native/patches/vulkan/ apply to the Vulkan build only. Without a system
Vulkan SDK (glslc, headers, SPIRV-Headers), SPARK_VULKAN=1 sets up a private one with
scripts/setup_vulkan.py (Debian 12, no root).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

SDIST_SPEC = "llama-cpp-python==0.3.36"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
REPO = Path(__file__).resolve().parent.parent
NATIVE = REPO / "native"
sys.path.insert(0, str(REPO))
from spark_cli.native.version import NATIVE_KEY_FILE as KEY_FILE  # noqa: E402  (spark --version reads it)
from spark_cli.native.version import LLAMA_CPP_SDIST as SDIST_NAME  # noqa: E402  (models/llama_vocab.py reads it)


class BuildError(Exception):
    pass


def home() -> Path:
    env = os.environ.get("SPARK_HOME")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "spark"
    root.mkdir(parents=True, exist_ok=True)
    return root


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_sdist() -> Path:
    dest = home() / "downloads" / SDIST_NAME
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.exists() and sha256_file(dest) == SDIST_SHA256:
        return dest
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".sdist-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               SDIST_SPEC, "-d", tmp, "-q"]
        print(f"downloading {SDIST_SPEC} sdist ...", flush=True)
        r = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / SDIST_NAME
        if r.returncode != 0 or not got.exists():
            raise BuildError(f"could not download {SDIST_SPEC}: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
        digest = sha256_file(got)
        if digest != SDIST_SHA256:
            raise BuildError(f"{SDIST_NAME}: sha256 {digest} does not match the pinned {SDIST_SHA256}")
        os.replace(got, dest)  # same folder: atomic
    return dest


VULKAN_PATCHES = NATIVE / "patches" / "vulkan"
RECIPE = "no-common"  # what this script changes beyond the flags and native/: part of the cache key


def native_files(vulkan: bool = False) -> list[Path]:
    """native/'s files that go into a build (the Vulkan-only patches only into a Vulkan build)."""
    return sorted(p for p in NATIVE.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                  and (vulkan or VULKAN_PATCHES not in p.parents))


def native_hash(vulkan: bool = False) -> str:
    h = hashlib.sha256()
    for p in native_files(vulkan):
        h.update(str(p.relative_to(NATIVE)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def detect_cuda() -> tuple[bool, str | None]:
    forced = os.environ.get("SPARK_CUDA")
    if forced == "0":
        return False, None
    arch = os.environ.get("SPARK_CUDA_ARCH")
    has_nvcc = shutil.which("nvcc") is not None
    gpu_arch = None
    if shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                           capture_output=True, text=True)
        if r.returncode == 0 and r.stdout.strip():
            gpu_arch = r.stdout.strip().splitlines()[0].replace(".", "").strip()
    if forced == "1" or (has_nvcc and gpu_arch):
        if not has_nvcc:
            raise BuildError("SPARK_CUDA=1 but nvcc is not on PATH: install the CUDA toolkit")
        arch = arch or gpu_arch
        if not arch:
            raise BuildError("SPARK_CUDA=1 but no GPU is visible: set SPARK_CUDA_ARCH (e.g. 90)")
        return True, arch
    return False, None


def cuda_toolkit_home() -> Path:
    """The CUDA toolkit that nvcc on PATH belongs to: its own TOP (nvcc -dryrun), which holds when nvcc
    is a wrapper script or a link; else the folder above nvcc's."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise BuildError("SPARK_CUDA=1 but nvcc is not on PATH: install the CUDA toolkit")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "x.cu")
        src.write_text("int main() { return 0; }\n")
        r = subprocess.run([nvcc, "-dryrun", "-c", str(src), "-o", str(Path(tmp, "x.o"))],
                           capture_output=True, text=True)
    m = re.search(r"^#\$ TOP=(.+)$", r.stdout + r.stderr, re.M)
    return Path(os.path.realpath(m.group(1).strip())) if m else Path(os.path.realpath(nvcc)).parent.parent


def cuda_major() -> int:
    r = subprocess.run(["nvcc", "--version"], capture_output=True, text=True)
    m = re.search(r"release (\d+)\.", r.stdout)
    if not m:
        raise BuildError(f"nvcc --version did not say its release: {r.stdout.strip()[-200:]!r}")
    return int(m.group(1))


def site_packages(py: Path) -> list[str]:
    r = subprocess.run([str(py), "-c", "import site;print('\\n'.join(site.getsitepackages()))"],
                       capture_output=True, text=True, check=True)
    return r.stdout.split()


def cublas_flags(py: Path) -> list[str]:
    """CMake flags that point a CUDA build at cuBLAS: none when the toolkit has it; else PyPI's
    nvidia-cublas wheel (installed into the build's venv when missing), through unversioned links
    under $SPARK_HOME/native/cublas since the wheel ships only libcublas.so.N."""
    sys.path.insert(0, str(REPO / "scripts"))
    import find_cublas

    toolkit = cuda_toolkit_home()
    if find_cublas.in_toolkit(toolkit):
        return []
    roots = site_packages(py)
    found = find_cublas.in_wheel(roots)
    if found is None:
        major = cuda_major()
        package = "nvidia-cublas" if major >= 13 else f"nvidia-cublas-cu{major}"
        print(f"cuBLAS: not in the toolkit at {toolkit}; installing {package} from PyPI", flush=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", package], check=True)
        found = find_cublas.in_wheel(roots)
        if found is None:
            raise BuildError(f"{package} installed but no libcublas.so with cublas_v2.h under {roots}")
    lib, inc = found
    # NOTE: the libraries get this folder as their RUNPATH (CMake adds a linked library's folder), so it
    # holds the versioned names the loader asks for (libcublas.so.13) beside the linker's unversioned ones
    links = home() / "native" / "cublas"
    links.mkdir(parents=True, exist_ok=True)
    for name in ("libcublas", "libcublasLt"):
        versioned = sorted(lib.glob(f"{name}.so.*"))
        for target, link in [(p, links / p.name) for p in versioned] + [(versioned[0], links / f"{name}.so")]:
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(target)
    return [f"-DCUDA_cublas_LIBRARY={links / 'libcublas.so'}", f"-DCUDA_cublasLt_LIBRARY={links / 'libcublasLt.so'}",
            f"-DCMAKE_CUDA_FLAGS=-I{inc}", f"-DCMAKE_CXX_FLAGS=-I{inc}"]


def system_vulkan_sdk() -> bool:
    """glslc, the Vulkan headers and SPIRV-Headers' CMake config are on this system (or VULKAN_SDK)."""
    if os.environ.get("VULKAN_SDK"):
        return True
    return (shutil.which("glslc") is not None and Path("/usr/include/vulkan/vulkan.h").exists()
            and any(Path(d).exists() for d in ("/usr/share/cmake/SPIRV-Headers", "/usr/lib/cmake/SPIRV-Headers",
                                              "/usr/local/share/cmake/SPIRV-Headers")))


def vulkan_gpu_present() -> bool:
    """A Vulkan GPU (not a CPU driver such as lavapipe) is visible to vulkaninfo."""
    if shutil.which("vulkaninfo") is None:
        return False
    r = subprocess.run(["vulkaninfo", "--summary"], capture_output=True, text=True)
    return r.returncode == 0 and any(t in r.stdout for t in ("DISCRETE_GPU", "INTEGRATED_GPU"))


def detect_vulkan() -> tuple[bool, dict[str, str] | None]:
    """(build Vulkan?, the environment the build needs: None means this process's own)."""
    forced = os.environ.get("SPARK_VULKAN")
    if forced == "0":
        return False, None
    if forced != "1":
        return (system_vulkan_sdk() and vulkan_gpu_present()), None
    if system_vulkan_sdk():
        return True, None
    sys.path.insert(0, str(REPO / "scripts"))
    import setup_vulkan

    try:
        return True, setup_vulkan.environment(setup_vulkan.setup())
    except setup_vulkan.SetupError as e:
        raise BuildError(f"SPARK_VULKAN=1 but no Vulkan SDK: {e}") from e


def cmake_flags(cuda: bool, arch: str | None, vulkan: bool = False) -> list[str]:
    flags = [
        "-DGGML_RPC=ON",
        "-DGGML_NATIVE=OFF" if cuda else "-DGGML_NATIVE=ON",
        "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=OFF",
        "-DLLAMA_BUILD_SERVER=OFF", "-DLLAVA_BUILD=OFF",
    ]
    # NOTE: every variant of one device flavour shares a build folder (see build()), and CMake keeps
    # options between runs: each backend is switched on or off explicitly
    if cuda:
        flags += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={arch}", "-DGGML_CUDA_NO_VMM=ON"]
    else:
        flags += ["-DGGML_CUDA=OFF"]
    flags += ["-DGGML_VULKAN=ON" if vulkan else "-DGGML_VULKAN=OFF"]
    return flags


def apply_native(vendor: Path, vulkan: bool = False) -> None:
    """Copy native/include and native/src into vendor/llama.cpp, then apply the patches
    (native/patches/*.patch, and native/patches/vulkan/*.patch for a Vulkan build)."""
    for sub in ("include", "src"):
        for p in sorted((NATIVE / sub).glob("*")):
            if p.is_file():
                shutil.copy2(p, vendor / sub / p.name)
    patches = sorted((NATIVE / "patches").glob("*.patch"))
    if vulkan:
        patches += sorted(VULKAN_PATCHES.glob("*.patch"))
    for patch in patches:
        r = subprocess.run(["patch", "-p1", "--forward", "--batch", "--dry-run", "-i", str(patch)],
                           cwd=vendor, capture_output=True, text=True)
        if r.returncode != 0:
            raise BuildError(f"{patch.relative_to(REPO)} does not apply: {describe_failure(r.stdout + r.stderr)}")
        subprocess.run(["patch", "-p1", "--forward", "--batch", "--quiet", "-i", str(patch)],
                       cwd=vendor, check=True)


# NOTE: llama-cpp-python forces llama.cpp's common library on (arg parsing, chat parsers, JSON
# schemas, downloads), but neither installs nor loads it: a third of the compile steps and most of
# their time. Nothing else in this build needs it (tools, examples, server and mtmd are off).
COMMON_ON = 'set(LLAMA_BUILD_COMMON ON CACHE BOOL "Build llama.cpp common library" FORCE)'
COMMON_OFF = 'set(LLAMA_BUILD_COMMON OFF CACHE BOOL "Build llama.cpp common library" FORCE)'


def skip_common(tree: Path) -> None:
    """Turn off llama.cpp's common library in llama-cpp-python's CMakeLists.txt (stock builds too)."""
    cmake = tree / "CMakeLists.txt"
    text = cmake.read_text()
    if text.count(COMMON_ON) != 1:
        raise BuildError(f"{SDIST_NAME}: CMakeLists.txt no longer forces LLAMA_BUILD_COMMON on in one place; "
                         "update skip_common() in scripts/build_native.py")
    cmake.write_text(text.replace(COMMON_ON, COMMON_OFF))


def describe_failure(out: str) -> str:
    current = "?"
    for line in out.splitlines():
        m = re.match(r"(?:checking|patching) file (\S+)", line)
        if m:
            current = m.group(1)
        m = re.match(r"Hunk #(\d+) FAILED at (\d+)", line)
        if m:
            return f"hunk #{m.group(1)} of {current} (at line {m.group(2)}) failed; rebase the patch on this llama.cpp"
        if "can't find file" in line or "No file to patch" in line:
            return f"{line.strip()}; rebase the patch on this llama.cpp"
        if "Reversed (or previously applied)" in line:
            return f"a hunk of {current} looks already applied"
    return out.strip().splitlines()[-1] if out.strip() else "unknown patch error"


def sync_tree(src: Path, dst: Path) -> int:
    """Make dst equal to src, rewriting only files whose bytes changed (unchanged files keep
    their mtimes for incremental CMake builds; rewritten ones get the current time, so they are
    newer than objects built from another tree). Returns the number of files written."""
    written = 0
    src_files = {p.relative_to(src) for p in src.rglob("*") if p.is_file() or p.is_symlink()}
    if dst.exists():
        for p in list(dst.rglob("*")):
            rel = p.relative_to(dst)
            if (p.is_file() or p.is_symlink()) and rel not in src_files:
                p.unlink()
    for rel in src_files:
        s, d = src / rel, dst / rel
        if d.exists() and not d.is_symlink() and not s.is_symlink() and d.stat().st_size == s.stat().st_size \
                and d.read_bytes() == s.read_bytes():
            continue
        d.parent.mkdir(parents=True, exist_ok=True)
        if d.exists() or d.is_symlink():
            d.unlink()
        shutil.copy2(s, d, follow_symlinks=False)
        if not d.is_symlink():
            os.utime(d)  # NOTE: copy2 keeps the source's mtime, which may be older than the objects
        written += 1
    return written


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def installed_key(py: Path) -> str | None:
    r = subprocess.run([str(py), "-c",
                        "import importlib.util,pathlib;s=importlib.util.find_spec('llama_cpp');"
                        f"p=pathlib.Path(s.origin).parent/'{KEY_FILE}' if s else None;"
                        "print(p.read_text() if p and p.exists() else '')"],
                       capture_output=True, text=True)
    return r.stdout.strip() or None


def install_wheel(py: Path, wheel: Path, key: str) -> None:
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps", str(wheel)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "typing-extensions>=4.5", "numpy>=1.20",
                    "diskcache>=5.6", "jinja2>=2.11"], check=True)
    r = subprocess.run([str(py), "-c", "import llama_cpp,os;print(os.path.dirname(llama_cpp.__file__))"],
                       capture_output=True, text=True, check=True)
    Path(r.stdout.strip(), KEY_FILE).write_text(key)


def build(venv: Path, force: bool = False, stock: bool = False) -> dict:
    t0 = time.time()
    py = venv_python(venv)
    sdist = fetch_sdist()
    cuda, arch = detect_cuda()
    vulkan, vulkan_env = (False, None) if stock else detect_vulkan()  # the reference stays CPU/CUDA
    flags = cmake_flags(cuda, arch, vulkan)
    if cuda:
        flags += cublas_flags(py)
    key_src = f"{SDIST_SHA256}\n{'stock' if stock else native_hash(vulkan)}\n{' '.join(flags)}\n{RECIPE}\n"
    key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    base = f"cuda{arch}" if cuda else "cpu"
    flavour = base + ("-vulkan" if vulkan else "") + ("-stock" if stock else "")
    info = {"key": key, "backends": ["CPU", "RPC"] + (["CUDA"] if cuda else []) + (["Vulkan"] if vulkan else []),
            "cuda_arch": arch, "cache_hit": False}

    wheel_dir = home() / "native" / "wheels" / key
    if not force and _install_cached(py, wheel_dir, key):
        info["cache_hit"] = True
        info["seconds"] = round(time.time() - t0, 1)
        return info

    # build: unpack + patch in a scratch dir, sync into a stable tree for incremental builds. The
    # patched, stock and Vulkan variants of one device flavour share the tree and the build folder:
    # sync_tree rewrites only the files that differ, so switching variants recompiles the patched
    # llama.cpp sources (and ggml-vulkan), not ggml's CPU backend. One build at a time per folder.
    (home() / "native").mkdir(parents=True, exist_ok=True)
    with build_lock(home() / "native" / f".build-{base}.lock"):
        if not force and _install_cached(py, wheel_dir, key):  # built meanwhile by the build we waited for
            info["cache_hit"] = True
        else:
            _compile(py, sdist, stock, vulkan, vulkan_env, flags, key, base, flavour, wheel_dir)
    info["seconds"] = round(time.time() - t0, 1)
    return info


def _install_cached(py: Path, wheel_dir: Path, key: str) -> bool:
    """Install the cached wheel of `key` unless the venv has it already; False: none cached."""
    wheels = sorted(wheel_dir.glob("*.whl")) if wheel_dir.exists() else []
    if not wheels:
        return False
    if installed_key(py) != key:
        install_wheel(py, wheels[0], key)
    return True


@contextlib.contextmanager
def build_lock(path: Path):
    """An exclusive lock on the shared build folder (a second build waits, saying so)."""
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another native build ({path}) ...", flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _compile(py: Path, sdist: Path, stock: bool, vulkan: bool, vulkan_env: dict[str, str] | None,
             flags: list[str], key: str, base: str, flavour: str, wheel_dir: Path) -> None:
    """Unpack, patch, sync into the shared tree, build the wheel, cache it and install it."""
    with tempfile.TemporaryDirectory(dir=home() / "native", prefix=".unpack-") as tmp:
        with tarfile.open(sdist) as tf:
            tf.extractall(tmp, filter="tar") if hasattr(tarfile, "data_filter") else tf.extractall(tmp)
        tree = Path(tmp) / SDIST_NAME.removesuffix(".tar.gz")
        skip_common(tree)
        if not stock:
            apply_native(tree / "vendor" / "llama.cpp", vulkan)
        stable = home() / "native" / "src" / base
        changed = sync_tree(tree, stable)
    print(f"patched tree ready ({changed} files changed); building ({flavour}) ...", flush=True)

    subprocess.run([str(py), "-m", "pip", "install", "-q", "scikit-build-core>=0.9.2"], check=True)
    env = dict(vulkan_env or os.environ)
    env["CMAKE_ARGS"] = " ".join(flags)
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", os.environ.get("SPARK_BUILD_JOBS", str(os.cpu_count() or 2)))
    build_dir = home() / "native" / "build" / base
    out_tmp = Path(tempfile.mkdtemp(dir=home() / "native", prefix=".wheel-"))
    log = home() / "native" / f"build-{flavour}.log"
    try:
        with open(log, "w") as lf:
            r = subprocess.run([str(py), "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
                                "-C", f"build-dir={build_dir}", "-w", str(out_tmp), str(stable)],
                               stdout=lf, stderr=subprocess.STDOUT, env=env)
        if r.returncode != 0:
            tail = log.read_text(errors="replace").splitlines()[-15:]
            raise BuildError("the native build failed; last lines of " + str(log) + ":\n" + "\n".join(tail))
        built = sorted(out_tmp.glob("*.whl"))
        wheel_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=wheel_dir.parent, prefix=".stage-"))
        shutil.move(str(built[0]), staging / built[0].name)
        if wheel_dir.exists():
            shutil.rmtree(wheel_dir)
        os.replace(staging, wheel_dir)
    finally:
        shutil.rmtree(out_tmp, ignore_errors=True)
    install_wheel(py, sorted(wheel_dir.glob("*.whl"))[0], key)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", default=str(REPO / ".venv"))
    ap.add_argument("--force", action="store_true", help="rebuild even when a cached wheel matches")
    ap.add_argument("--stock", action="store_true",
                    help="build without native/ (the unpatched reference the tests compare against)")
    args = ap.parse_args()
    venv = Path(args.venv)
    try:
        if not venv_python(venv).exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        info = build(venv, force=args.force, stock=args.stock)
    except BuildError as e:
        print(f"build_native: {e}", file=sys.stderr)
        return 1
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"build_native: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("build_native: interrupted; nothing was installed", file=sys.stderr)
        return 130
    arch = f", CUDA arch sm_{info['cuda_arch']}" if info["cuda_arch"] else ""
    what = "stock (unpatched)" if args.stock else "+ native/"
    print(f"native: llama-cpp-python 0.3.36 {what} [{info['key']}], backends {'+'.join(info['backends'])}"
          f"{arch}, {'cache hit' if info['cache_hit'] else 'built'} in {info['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
