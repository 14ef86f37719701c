"""The README and docs/: every link resolves to a file in the repository (and to a heading where
it names one), every docs page is reachable from the README, the README stays short, and its
two commands are the ones CI runs (.ci/run -> scripts/test -> pytest)."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def _prose(path: Path) -> str:
    """The page without its code blocks (a `#` there is a comment, a `[x](y)` code)."""
    return FENCE.sub("", path.read_text(encoding="utf-8"))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", "")).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", _prose(path), re.M)}


def _links(path: Path) -> list[tuple[Path, str]]:
    """(target file, anchor or '') of each link in the page to this repository."""
    out = []
    for target in LINK.findall(_prose(path)):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: outside the repository
        file, _, anchor = target.partition("#")
        out.append(((path.parent / file).resolve() if file else path, anchor))
    return out


def _reachable() -> set[Path]:
    """The README and every markdown page its links lead to, and theirs."""
    seen, todo = set(), [README]
    while todo:
        page = todo.pop()
        if page in seen:
            continue
        seen.add(page)
        todo += [t for t, _ in _links(page) if t.suffix == ".md" and t.is_file()]
    return seen


def test_links_resolve_to_files_and_headings() -> None:
    bad = []
    for page in sorted(_reachable()):
        for target, anchor in _links(page):
            where = f"{page.relative_to(ROOT)} -> {target.relative_to(ROOT) if target.is_relative_to(ROOT) else target}"
            if not target.is_relative_to(ROOT) or not target.exists():
                bad.append(f"{where}: no such file")
            elif anchor and (target.suffix != ".md" or anchor not in _anchors(target)):
                bad.append(f"{where}#{anchor}: no such heading")
    assert bad == []


def test_every_docs_page_is_reachable_from_the_readme() -> None:
    pages = set((ROOT / "docs").glob("*.md"))
    assert pages and pages - _reachable() == set()


def test_the_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines: move the reference to docs/"


def _two_commands() -> list[str]:
    text = README.read_text(encoding="utf-8")
    section = text.split("## Two commands", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]


def _runs(script: Path, command: str) -> bool:
    """Whether `script` runs `command` on a line that is not a comment."""
    pattern = rf"(?<![\w/.-]){re.escape(command)}(?![\w/.-])"
    return any(re.search(pattern, line) for line in script.read_text(encoding="utf-8").splitlines()
               if not line.lstrip().startswith("#"))


def test_the_readme_commands_are_what_ci_runs() -> None:
    assert _two_commands() == ["scripts/demo", "scripts/test"]
    for name in ("scripts/demo", "scripts/test", ".ci/run"):
        assert os.access(ROOT / name, os.X_OK), f"{name} is not executable"
    assert _runs(ROOT / ".ci/run", "scripts/test")  # CI: the README's test command ...
    test, demo = ROOT / "scripts/test", ROOT / "scripts/demo"
    for script in (test, demo):  # ... both set everything up first ...
        assert _runs(script, "scripts/bootstrap.sh"), script
    assert _runs(test, "exec .venv/bin/python -m pytest")  # ... then run the suite, or the demo
    assert _runs(demo, "exec .venv/bin/spark demo")
