#!/usr/bin/env python3
"""Where cuBLAS is for a CUDA build of llama.cpp: in the toolkit, or in PyPI's nvidia-cublas wheel.

A toolkit installed from NVIDIA's runfile or packages has cuBLAS beside nvcc. A toolkit without it
(a container with only the compiler) can take cuBLAS from the `nvidia-cublas` wheel (CUDA 13) or
`nvidia-cublas-cu12` (CUDA 12), which ship libcublas.so.N, libcublasLt.so.N and the headers under
site-packages/nvidia/cu*/ or nvidia/cublas/.

Usage: python3 scripts/find_cublas.py TOOLKIT_HOME [ROOT ...]
Prints "toolkit" when the toolkit has cuBLAS, else "LIB_DIR INCLUDE_DIR" of a wheel found under
the given roots or this python's site-packages; exits 1 when there is none. Standard library only:
scripts/gpu_bench.sh runs it with a bare python3 on the GPU machine.
"""

from __future__ import annotations

import glob
import os
import site
import sys
from pathlib import Path

LIB_DIRS = ("lib64", "lib", "targets/x86_64-linux/lib")
INCLUDE_DIRS = ("include", "targets/x86_64-linux/include")
WHEEL_PATTERNS = ("nvidia/*/lib/libcublas.so*", "nvidia/cublas/lib/libcublas.so*", "lib/libcublas.so*")


def in_toolkit(home: Path) -> bool:
    """The toolkit at `home` has cuBLAS's library and header."""
    has_lib = any(glob.glob(str(home / d / "libcublas.so*")) for d in LIB_DIRS)
    return has_lib and any((home / d / "cublas_v2.h").is_file() for d in INCLUDE_DIRS)


def search_roots(extra: list[str]) -> list[str]:
    roots = list(extra)
    try:
        roots += site.getsitepackages() + [site.getusersitepackages()]
    except AttributeError:  # NOTE: some virtualenvs' site module lacks getsitepackages
        pass
    return roots + sys.path


def in_wheel(roots: list[str]) -> tuple[Path, Path] | None:
    """(library folder, include folder) of an nvidia-cublas wheel under one of `roots`."""
    for root in roots:
        for pattern in WHEEL_PATTERNS:
            for lib in sorted(glob.glob(os.path.join(root, pattern))):
                lib_dir = Path(lib).parent
                inc = lib_dir.parent / "include"
                if glob.glob(str(lib_dir / "libcublasLt.so*")) and (inc / "cublas_v2.h").is_file():
                    return lib_dir, inc
    return None


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.split("\n\n")[2], file=sys.stderr)
        return 2
    if in_toolkit(Path(argv[0])):
        print("toolkit")
        return 0
    found = in_wheel(search_roots(argv[1:]))
    if found is None:
        return 1
    print(found[0], found[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
