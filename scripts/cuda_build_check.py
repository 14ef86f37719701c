#!/usr/bin/env python3
"""Build Spark's CUDA flavour here, whole, and check it (issue 46): a machine with nvcc but no GPU.

1. scripts/build_native.py's CUDA branch, as a user's scripts/demo runs it on a CUDA machine
   (SPARK_CUDA=1, SPARK_CUDA_ARCH=ARCH), into its own venv ($SPARK_HOME/venvs/cudaARCH), never .venv;
   cuBLAS from the toolkit, else PyPI's nvidia-cublas. The wall time is the build's on this machine.
2. The libraries: size, the CUDA backend's registration symbol in libggml-cuda.so, Spark's expert-cache
   C API in libllama.so (every LLAMA_API function of native/include), and what the CUDA library needs
   from the system (ldd): the CUDA runtime and cuBLAS, never the driver (libcuda.so.1, -DGGML_CUDA_NO_VMM).
3. On this machine, which has no driver: `spark devices --json` in that venv lists no CUDA device, exits 0
   and says why in one line; `spark chat` on a tiny model answers on the CPU.

Usage: .venv/bin/python scripts/cuda_build_check.py [--arch 89] [--skip-build] [--json OUT]
(about an hour of 2 cores for the build; a cache hit when native/ is unchanged).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

API_HEADER = REPO / "native" / "include" / "llama-expert-cache-api.h"


def spark_home() -> Path:
    from spark_cli.files.paths import spark_home as home

    return home()


def api_functions() -> list[str]:
    return re.findall(r"LLAMA_API\s+[^;(]*?\b(llama_expert_cache_\w+)\s*\(", API_HEADER.read_text())


def exported(lib: Path) -> set[str]:
    r = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True)
    return {line.split()[-1] for line in r.stdout.splitlines() if line.strip()}


def needed(lib: Path) -> dict[str, str]:
    """ldd's answer: each needed library and where it resolves ('not found' where it does not)."""
    r = subprocess.run(["ldd", str(lib)], capture_output=True, text=True)
    out = {}
    for line in r.stdout.splitlines():
        m = re.match(r"\s*(\S+)\s+=>\s+(.*?)\s*(\(0x[0-9a-f]+\))?$", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def build(venv: Path, arch: str) -> dict:
    env = {**os.environ, "SPARK_CUDA": "1", "SPARK_CUDA_ARCH": arch}
    t0 = time.time()
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "build_native.py"), "--venv", str(venv)], env=env,
                       capture_output=True, text=True)
    info = {"seconds": round(time.time() - t0, 1), "rc": r.returncode, "last_line": (r.stdout + r.stderr).strip()[-400:]}
    return info


def lib_dir(venv: Path) -> Path:
    py = venv / "bin" / "python"
    r = subprocess.run([str(py), "-c", "import importlib.util,os;print(os.path.dirname(importlib.util.find_spec('llama_cpp').origin))"],
                       capture_output=True, text=True, check=True)
    return Path(r.stdout.strip()) / "lib"


def check_libs(libs: Path) -> dict:
    cuda = libs / "libggml-cuda.so"
    llama = libs / "libllama.so"
    out: dict = {"sizes_mib": {p.name: round(p.stat().st_size / 2**20, 1) for p in sorted(libs.glob("*.so*"))}}
    out["cuda_library"] = cuda.exists()
    if cuda.exists():
        syms = exported(cuda)
        out["cuda_symbols"] = {s: s in syms for s in ("ggml_backend_cuda_reg", "ggml_backend_cuda_init",
                                                      "ggml_backend_cuda_get_device_count")}
        deps = needed(cuda)
        out["cuda_needs"] = {k: v for k, v in deps.items() if re.match(r"lib(cuda|cudart|cublas|cublasLt)\.", k)}
        out["links_driver"] = any(k.startswith("libcuda.so") for k in deps)
        out["unresolved"] = [k for k, v in deps.items() if v == "not found"]
    api = api_functions()
    have = exported(llama)
    out["expert_cache_api"] = {"declared": len(api), "missing": [f for f in api if f not in have]}
    return out


def run_without_driver(venv: Path) -> dict:
    """spark in the CUDA venv, on this driverless machine: devices and a short CPU chat."""
    py = str(venv / "bin" / "python")
    subprocess.run([py, "-m", "pip", "install", "-q", str(REPO)], check=True)  # Spark and its dependencies
    spark = [str(venv / "bin" / "spark")]
    dev = subprocess.run([*spark, "devices", "--json"], capture_output=True, text=True, timeout=300)
    from spark_cli.files.paths import models_dir

    tiny = sorted(models_dir().glob("tiny-llama-*.gguf"))
    chat = None
    if tiny:
        chat = subprocess.run([*spark, "chat", str(tiny[0]), "-n", "4", "--temp", "0", "-p", "Hi", "--no-learn",
                               "-c", "256"], capture_output=True, text=True, timeout=600)
    return {"devices_rc": dev.returncode, "devices_stdout": dev.stdout.strip()[-600:],
            "devices_stderr": dev.stderr.strip()[-600:],
            "chat_rc": chat.returncode if chat else None,
            "chat_tail": ((chat.stdout + chat.stderr).strip()[-600:] if chat else "no tiny llama model built")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="89")
    ap.add_argument("--skip-build", action="store_true", help="check the venv's build as it is")
    ap.add_argument("--json", type=Path, help="write the result here too")
    args = ap.parse_args()
    venv = spark_home() / "venvs" / f"cuda{args.arch}"
    result: dict = {"arch": args.arch, "venv": str(venv)}
    if not args.skip_build:
        result["build"] = build(venv, args.arch)
        if result["build"]["rc"] != 0:
            print(json.dumps(result, indent=2))
            return 1
    result["libs"] = check_libs(lib_dir(venv))
    result["no_driver"] = run_without_driver(venv)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    libs, nd = result["libs"], result["no_driver"]
    print(f"cuda tier: build {result.get('build', {}).get('seconds', '-')} s; libggml-cuda.so "
          f"{libs['sizes_mib'].get('libggml-cuda.so', '-')} MiB; CUDA symbols "
          f"{all(libs.get('cuda_symbols', {}).values()) if libs.get('cuda_symbols') else False}; expert-cache API "
          f"missing {libs['expert_cache_api']['missing']}; links the driver {libs.get('links_driver')}; "
          f"unresolved {libs.get('unresolved')}; devices exit {nd['devices_rc']}, chat exit {nd['chat_rc']}",
          file=sys.stderr)  # the one line CI's tier shows
    ok = (libs.get("cuda_library") and all(libs["cuda_symbols"].values()) and not libs["links_driver"]
          and not libs["unresolved"] and not libs["expert_cache_api"]["missing"]
          and result["no_driver"]["devices_rc"] == 0 and result["no_driver"]["chat_rc"] in (0, None))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
