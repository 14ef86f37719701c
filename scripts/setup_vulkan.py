#!/usr/bin/env python3
"""Set up a private Vulkan toolchain and Mesa's software Vulkan driver (lavapipe), no root needed.

For CI and for trying the Vulkan backend on a machine without a GPU. On Debian 12 it fetches,
with apt-get and a private package state (the system's packages are untouched):
  from bookworm:            glslc, libvulkan-dev, spirv-headers
  from bookworm-backports:  mesa-vulkan-drivers 25 (Mesa 22's lavapipe corrupts its heap in
                            ggml's MUL_MAT_ID tests; Mesa 25's passes them)
plus whatever of their dependencies the system lacks, then unpacks them into
$SPARK_HOME/vulkan/root. It makes an SDK view there for CMake (VULKAN_SDK) and an ICD file
that points the Vulkan loader at the unpacked lavapipe. A second run takes milliseconds.

  python scripts/setup_vulkan.py          set up (if needed) and print where
  eval "$(python scripts/setup_vulkan.py --env)"
                                          ... and export what a build or a run needs

The environment it exports: VULKAN_SDK, PATH (glslc), LD_LIBRARY_PATH (libvulkan, libshaderc,
Mesa's newer libdrm), VK_ICD_FILENAMES (lavapipe only), GGML_VK_VISIBLE_DEVICES=0 (ggml hides
CPU-type Vulkan devices unless asked) and MESA_SHADER_CACHE_DIR (Mesa compiles ggml's shaders
once per model shape, about a minute cold; the cache makes later runs fast).

With real Vulkan hardware, install the distribution's packages instead (Debian/Ubuntu:
`apt install libvulkan-dev glslc spirv-headers mesa-vulkan-drivers`); build_native.py picks up
a system SDK by itself.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# what is asked for; apt resolves the rest against this system's installed packages
PACKAGES = ["glslc", "libvulkan-dev", "spirv-headers", "mesa-vulkan-drivers/bookworm-backports"]
SOURCES = ("deb http://deb.debian.org/debian bookworm main\n"
           "deb http://deb.debian.org/debian bookworm-backports main\n")
STAMP_VERSION = 1


class SetupError(Exception):
    pass


def home() -> Path:
    env = os.environ.get("SPARK_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "spark"


def root_dir() -> Path:
    return home() / "vulkan"


def stamp_text() -> str:
    return json.dumps({"version": STAMP_VERSION, "packages": PACKAGES, "sources": SOURCES}, sort_keys=True)


def is_ready(top: Path) -> bool:
    stamp = top / "ready.json"
    return stamp.is_file() and stamp.read_text() == stamp_text()


def multiarch_libdir(sysroot: Path) -> Path:
    dirs = sorted((sysroot / "usr" / "lib").glob("*-linux-gnu*"))
    if not dirs:
        raise SetupError(f"{sysroot}/usr/lib has no multiarch folder: the unpacked packages look incomplete")
    return dirs[0]


def apt_options(state: Path) -> list[str]:
    opts = ["-o", f"Dir::Etc::SourceList={state / 'sources.list'}", "-o", "Dir::Etc::SourceParts=/dev/null",
            "-o", f"Dir::State::Lists={state / 'lists'}", "-o", f"Dir::Cache={state / 'cache'}",
            "-o", "Debug::NoLocking=1"]
    if os.geteuid() == 0:  # apt's _apt user cannot write into our private folders
        opts += ["-o", "APT::Sandbox::User=root"]
    return opts


def run(cmd: list[str], what: str, cwd: Path | None = None) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
    if r.returncode != 0:
        last = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise SetupError(f"{what} failed: {last[0]}")
    return r.stdout


def fetch_debs(state: Path, debs: Path) -> list[Path]:
    """apt-get update into a private state, resolve PACKAGES against the installed system and
    download every package that an install would add or upgrade."""
    for sub in ("lists/partial", "cache/archives/partial"):
        (state / sub).mkdir(parents=True, exist_ok=True)
    (state / "sources.list").write_text(SOURCES)
    opts = apt_options(state)
    print("vulkan: reading Debian's package lists (bookworm, bookworm-backports) ...", flush=True)
    run(["apt-get", *opts, "update"], "apt-get update")
    sim = run(["apt-get", *opts, "-s", "install", "--no-install-recommends", *PACKAGES], "resolving the packages")
    wanted = []
    for line in sim.splitlines():
        if line.startswith("Inst "):
            parts = line.split()
            name = parts[1]
            version = line.split("(", 1)[1].split()[0]
            wanted.append(f"{name}={version}")
    if not wanted:
        raise SetupError("apt resolved nothing to fetch; is this Debian 12 (bookworm)?")
    debs.mkdir(parents=True, exist_ok=True)
    print(f"vulkan: downloading {len(wanted)} packages: {', '.join(w.split('=')[0] for w in wanted)}", flush=True)
    run(["apt-get", *opts, "download", *wanted], "apt-get download", cwd=debs)
    return sorted(debs.glob("*.deb"))


def make_sdk_view(sysroot: Path, sdk: Path) -> None:
    """VULKAN_SDK layout that CMake's FindVulkan and ggml's find_package(SPIRV-Headers) read."""
    libdir = multiarch_libdir(sysroot)
    sdk.mkdir(parents=True, exist_ok=True)
    for name, target in (("include", sysroot / "usr" / "include"), ("lib", libdir),
                         ("bin", sysroot / "usr" / "bin"), ("share", sysroot / "usr" / "share")):
        link = sdk / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target)


def make_icd(sysroot: Path, top: Path) -> Path:
    """An ICD file naming the unpacked lavapipe by absolute path (Debian's names /usr/lib/...)."""
    shipped = sorted((sysroot / "usr" / "share" / "vulkan" / "icd.d").glob("lvp_icd*.json"))
    if not shipped:
        raise SetupError("mesa-vulkan-drivers has no lvp_icd*.json: lavapipe is missing from the package")
    icd = json.loads(shipped[0].read_text())
    lib = Path(icd["ICD"]["library_path"]).name
    found = multiarch_libdir(sysroot) / lib
    if not found.exists():
        raise SetupError(f"lavapipe's library {lib} is not in the unpacked packages")
    icd["ICD"]["library_path"] = str(found)
    out = top / "lvp_icd.json"
    out.write_text(json.dumps(icd, indent=2) + "\n")
    return out


def setup(force: bool = False) -> Path:
    top = root_dir()
    if is_ready(top) and not force:
        return top
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise SetupError("needs Debian's apt-get and dpkg-deb; elsewhere install the Vulkan SDK and "
                         "Mesa's lavapipe and set VULKAN_SDK")
    top.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=top.parent, prefix=".vulkan-"))
    try:
        debs = fetch_debs(staging / "apt", staging / "debs")
        sysroot = staging / "root"
        for deb in debs:
            run(["dpkg-deb", "-x", str(deb), str(sysroot)], f"unpacking {deb.name}")
        shutil.rmtree(staging / "apt", ignore_errors=True)
        # the final paths are baked into the SDK view and the ICD file: move first, then make them
        if top.exists():
            shutil.rmtree(top)
        os.replace(staging, top)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    make_sdk_view(top / "root", top / "sdk")
    make_icd(top / "root", top)
    (top / "shader-cache").mkdir(exist_ok=True)
    (top / "ready.json").write_text(stamp_text())
    print(f"vulkan: ready in {top}", flush=True)
    return top


def environment(top: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """The variables a build or a run on lavapipe needs (added to base, default os.environ)."""
    env = dict(os.environ if base is None else base)
    sysroot = top / "root"

    def prepend(var: str, value: Path) -> None:
        old = env.get(var, "")
        parts = [p for p in old.split(":") if p and p != str(value)]
        env[var] = ":".join([str(value), *parts])

    prepend("PATH", sysroot / "usr" / "bin")
    prepend("LD_LIBRARY_PATH", multiarch_libdir(sysroot))
    env["VULKAN_SDK"] = str(top / "sdk")
    env["VK_ICD_FILENAMES"] = str(top / "lvp_icd.json")
    env.setdefault("GGML_VK_VISIBLE_DEVICES", "0")
    env["MESA_SHADER_CACHE_DIR"] = str(top / "shader-cache")
    return env


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--env", action="store_true", help="print export lines (for eval) instead of the path")
    ap.add_argument("--force", action="store_true", help="fetch and unpack again")
    args = ap.parse_args()
    try:
        top = setup(force=args.force)
        if args.env:
            env = environment(top)
            for var in ("VULKAN_SDK", "PATH", "LD_LIBRARY_PATH", "VK_ICD_FILENAMES", "GGML_VK_VISIBLE_DEVICES",
                        "MESA_SHADER_CACHE_DIR"):
                print(f"export {var}={shlex.quote(env[var])}")
        else:
            print(top)
    except (SetupError, OSError) as e:
        print(f"setup_vulkan: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("setup_vulkan: interrupted; nothing was kept", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
