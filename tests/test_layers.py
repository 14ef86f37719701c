"""The package's layers: each subpackage imports only its own layer and the ones below it.

commands -> serve -> runs -> models -> native -> core -> files -> errors. Pure layers (core, files)
import no llama_cpp, rich or typer; only native/ touches ctypes and llama_cpp. Function-local imports
count too: a lazy import is still a dependency. No two modules import each other, directly or round a
circle (imports under `if TYPE_CHECKING:` aside: they never run), and no module imports another's
private (`_x`) names.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "spark_cli"

# rank of each part of the package; a module may import ranks <= its own
RANKS = {"errors": 0, "__init__": 0, "files": 1, "core": 2, "native": 3, "models": 4, "runs": 5, "serve": 6,
         "commands": 7, "cli": 7}  # cli.py assembles the commands
# third-party modules a layer must not import
FORBIDDEN = {
    "files": {"llama_cpp", "rich", "typer", "ctypes"},
    "core": {"llama_cpp", "rich", "typer", "ctypes"},
    "native": {"rich", "typer"},
    "models": {"rich", "typer", "ctypes", "llama_cpp"},
    "runs": {"rich", "typer", "ctypes", "llama_cpp"},
    "serve": {"rich", "typer", "ctypes", "llama_cpp"},
    "commands": {"ctypes", "llama_cpp"},
}


ALLOWED_CYCLE_EDGES: set[tuple[str, str]] = set()  # none: `spark demo` runs its steps through commands/runner
ALLOWED_PRIVATE_IMPORTS: set[str] = set()


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
    ("models", "from ..runs import session"),
    ("native", "from ..models.demo_model import build_demo_model"),
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


def _type_checking_lines(tree: ast.Module) -> set[int]:
    """Lines of imports under `if TYPE_CHECKING:` (typing only, never run: no cycle at import)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out |= {n.lineno for stmt in node.body for n in ast.walk(stmt) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return out


def import_graph(root: Path = PKG) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (function-local too, TYPE_CHECKING ones not).
    `from pkg import name` imports pkg, and pkg.name too when that is a module."""
    modules = {module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_lines(tree)
        targets: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import) and node.lineno not in skip:
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.lineno not in skip:
                base = _resolve(node, name, path)
                targets |= {base} | {f"{base}.{a.name}" for a in node.names}
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a path back to its start) per strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan; the package's depth is small, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_cycle_in(graph, set(c), c[0]) for c in components]


def _cycle_in(graph: dict[str, set[str]], component: set[str], start: str) -> list[str]:
    """A shortest path start -> ... -> start inside one strongly connected component."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{start} is in no cycle")


def private_imports(root: Path = PKG) -> list[str]:
    """Private names (`_x`) one module takes from another: `from .mod import _x`, or `mod._x`
    where `mod` is a package module it imported."""
    modules = {module_name(p, root) for p in root.rglob("*.py")}
    bad = []
    for path in sorted(root.rglob("*.py")):
        src = module_name(path, root)
        tree = ast.parse(path.read_text(), str(path))
        bound: dict[str, str] = {}  # local name -> package module it stands for
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target = _resolve(node, src, path)
                for a in node.names:
                    full = f"{target}.{a.name}"
                    if full in modules:
                        bound[a.asname or a.name] = full
                    elif a.name.startswith("_") and not a.name.startswith("__") and target in modules \
                            and target != src:
                        bad.append(f"{path.relative_to(root.parent)}:{node.lineno}: imports {a.name} from {target}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in modules and a.asname:
                        bound[a.asname] = a.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                    and node.attr.startswith("_") and not node.attr.startswith("__")
                    and bound[node.value.id] != src):
                bad.append(f"{path.relative_to(root.parent)}:{node.lineno}: uses "
                           f"{bound[node.value.id]}.{node.attr}")
    return bad


def _resolve(node: ast.ImportFrom, src: str, path: Path) -> str:
    if not node.level:
        return node.module or ""
    package = src if path.name == "__init__.py" else src.rsplit(".", 1)[0]
    base = package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def test_no_import_cycles():
    graph = {m: {t for t in ts if (m, t) not in ALLOWED_CYCLE_EDGES} for m, ts in import_graph().items()}
    cycles = import_cycles(graph)
    assert cycles == [], "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_private_name_crosses_modules():
    found = [f for f in private_imports() if re.sub(r":\d+:", ":", f, count=1) not in ALLOWED_PRIVATE_IMPORTS]
    assert found == []


def test_a_cycle_and_a_private_import_are_caught(tmp_path):
    pkg = tmp_path / "spark_cli"
    (pkg / "core").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "__init__.py").write_text("")
    (pkg / "core" / "a.py").write_text("from .b import _helper\n")
    (pkg / "core" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import c\n"
                                       "def f():\n    from . import a\n    return a._x\n")
    (pkg / "core" / "c.py").write_text("from . import b\n")  # b -> c only for typing: no cycle
    assert import_cycles(import_graph(pkg)) == [["spark_cli.core.a", "spark_cli.core.b", "spark_cli.core.a"]]
    assert private_imports(pkg) == ["spark_cli/core/a.py:1: imports _helper from spark_cli.core.b",
                                    "spark_cli/core/b.py:6: uses spark_cli.core.a._x"]

