"""The package's layers: each subpackage imports only its own layer and the ones below it.

commands -> serve -> runs -> native -> core -> files -> errors. Pure layers (core, files)
import no llama_cpp, rich or typer; only native/ touches ctypes and llama_cpp. Function-local imports
count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "spark_cli"

# rank of each part of the package; a module may import ranks <= its own
RANKS = {"errors": 0, "__init__": 0, "files": 1, "core": 2, "native": 3, "runs": 4, "serve": 5,
         "commands": 6, "cli": 6}  # cli.py assembles the commands; `spark demo` calls it back
# third-party modules a layer must not import
FORBIDDEN = {
    "files": {"llama_cpp", "rich", "typer", "ctypes"},
    "core": {"llama_cpp", "rich", "typer", "ctypes"},
    "native": {"rich", "typer"},
    "runs": {"rich", "typer", "ctypes", "llama_cpp"},
    "serve": {"rich", "typer", "ctypes", "llama_cpp"},
    "commands": {"ctypes", "llama_cpp"},
}


def part_of(module: str) -> str:
    """'spark_cli.core.planner' -> 'core'; 'spark_cli.cli' -> 'cli'; 'spark_cli' -> '__init__'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path, root: Path = PKG) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, root: Path = PKG) -> list[tuple[int, str]]:
    """(line, absolute module) for every import in the file, relative ones resolved."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from . import x`: x is a module of the package (its own import) or a name in its __init__
            for a in ([] if node.module else node.names):
                sub = root.parent.joinpath(*target.split("."), a.name)
                out.append((node.lineno, f"{target}.{a.name}" if sub.is_dir() or sub.with_suffix(".py").is_file()
                            else target))
            out += [(node.lineno, target)] if node.module else []
    return out


def violations(root: Path = PKG) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        src = module_name(path, root)
        layer = part_of(src)
        rank = RANKS.get(layer)
        if rank is None:
            bad.append(f"{path.relative_to(root.parent)}: {layer} is no known layer (add it to RANKS)")
            continue
        for line, target in imports_of(path, root):
            top = target.split(".")[0]
            if top == "spark_cli":
                dst = part_of(target)
                if RANKS.get(dst, 99) > rank:
                    bad.append(f"{path.relative_to(root.parent)}:{line}: {layer} imports {target} ({dst} is above it)")
            elif top in FORBIDDEN.get(layer, ()):
                bad.append(f"{path.relative_to(root.parent)}:{line}: {layer} imports {top}")
    return bad


def test_every_import_goes_down_the_layers():
    assert violations() == []


def test_every_module_sits_in_a_layer():
    top_level = {p.stem for p in PKG.glob("*.py")}
    assert top_level <= {"__init__", "cli", "errors"}, f"modules outside the layers: {top_level}"


@pytest.mark.parametrize("layer, bad_import", [
    ("core", "from ..native.engine import Engine"),
    ("core", "import rich"),
    ("runs", "from ..commands.common import console"),
    ("native", "from ..runs import session"),
    ("files", "from ..core import planner"),
    ("commands", "import ctypes"),
])
def test_a_wrong_import_is_caught(tmp_path, layer, bad_import):
    pkg = tmp_path / "spark_cli"
    (pkg / layer).mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / layer / "__init__.py").write_text("")
    (pkg / layer / "mod.py").write_text(f"def f():\n    {bad_import}\n")
    found = violations(pkg)
    assert len(found) == 1 and f"spark_cli/{layer}/mod.py:2" in found[0], found
