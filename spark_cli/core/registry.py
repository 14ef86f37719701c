"""The MoE families Spark knows (models.toml), read once into frozen dataclasses.

The file is `spark_cli/data/models.toml`, shipped in the package.
"""

from __future__ import annotations

import functools
import re

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import SparkError

# Stock llama.cpp names, used for archs the file does not list.
GENERIC_EXPERT_PATTERN = re.compile(r"^blk\.\d+\.ffn_(gate|up|down|gate_up)_(ch)?exps\.weight$")
GENERIC_SHARED_PATTERN = re.compile(r"^blk\.\d+\.ffn_\w+_shexp\.(weight|bias)$")

SCHEMA = 1


@dataclass(frozen=True)
class Family:
    arch: str  # general.architecture in the GGUF
    name: str
    expert_patterns: tuple[re.Pattern[str], ...]
    shared_patterns: tuple[re.Pattern[str], ...]
    notes: str = ""
    swa_period: int = 0  # 0: no default sliding-window pattern
    swa_dense_first: bool = False
    full_attention_interval: int = 0  # 0: every layer has a KV cache

    def is_expert(self, tensor_name: str) -> bool:
        return any(p.search(tensor_name) for p in self.expert_patterns)

    def is_shared(self, tensor_name: str) -> bool:
        return any(p.search(tensor_name) for p in self.shared_patterns)


@dataclass(frozen=True)
class Registry:
    path: str
    families: tuple[Family, ...]

    def get(self, arch: str) -> Family | None:
        for f in self.families:
            if f.arch == arch:
                return f
        return None

    @property
    def archs(self) -> tuple[str, ...]:
        return tuple(f.arch for f in self.families)


def registry_path() -> Path:
    """spark_cli/data/models.toml, in the source tree and the installed package alike."""
    return Path(__file__).resolve().parents[1] / "data" / "models.toml"


def _fail(field: str, problem: str) -> SparkError:
    return SparkError(f"models.toml: {field}: {problem}")


def _str(d: dict[str, Any], key: str, where: str, default: str | None = None) -> str:
    v = d.get(key, default)
    if not isinstance(v, str) or (default is None and not v):
        raise _fail(f"{where}.{key}", "expected a non-empty string")
    return v


def _int(d: dict[str, Any], key: str, where: str) -> int:
    v = d.get(key, 0)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise _fail(f"{where}.{key}", f"expected an integer >= 0, got {v!r}")
    return v


def _patterns(d: dict[str, Any], key: str, where: str, required: bool) -> tuple[re.Pattern[str], ...]:
    v = d.get(key, [])
    if not isinstance(v, list) or not all(isinstance(p, str) for p in v):
        raise _fail(f"{where}.{key}", "expected a list of regex strings")
    if required and not v:
        raise _fail(f"{where}.{key}", "must list at least one pattern")
    out = []
    for i, p in enumerate(v):
        try:
            out.append(re.compile(p))
        except re.error as e:
            raise _fail(f"{where}.{key}[{i}]", f"invalid regex {p!r}: {e}") from None
    return tuple(out)


_KNOWN_KEYS = {
    "arch", "name", "expert_patterns", "shared_patterns", "notes",
    "swa_period", "swa_dense_first", "full_attention_interval",
}


def parse_registry(text: str, path: str = "models.toml") -> Registry:
    """Validate the TOML text; every problem is `models.toml: field: problem`."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise _fail("(file)", f"not valid TOML: {e}") from None
    if doc.get("schema") != SCHEMA:
        raise _fail("schema", f"expected {SCHEMA}, got {doc.get('schema')!r}")
    raw = doc.get("family")
    if not isinstance(raw, list) or not raw:
        raise _fail("family", "expected at least one [[family]] table")
    families: list[Family] = []
    seen: set[str] = set()
    for i, d in enumerate(raw):
        where = f"family[{i}]"
        unknown = sorted(set(d) - _KNOWN_KEYS)
        if unknown:
            raise _fail(f"{where}.{unknown[0]}", "unknown field")
        arch = _str(d, "arch", where)
        where = f"family[{i}] ({arch})"
        if arch in seen:
            raise _fail(f"{where}.arch", "listed twice")
        seen.add(arch)
        dense_first = d.get("swa_dense_first", False)
        if not isinstance(dense_first, bool):
            raise _fail(f"{where}.swa_dense_first", "expected true or false")
        families.append(Family(
            arch=arch,
            name=_str(d, "name", where),
            expert_patterns=_patterns(d, "expert_patterns", where, required=True),
            shared_patterns=_patterns(d, "shared_patterns", where, required=False),
            notes=_str(d, "notes", where, default=""),
            swa_period=_int(d, "swa_period", where),
            swa_dense_first=dense_first,
            full_attention_interval=_int(d, "full_attention_interval", where),
        ))
    return Registry(path=path, families=tuple(families))


@functools.lru_cache(maxsize=4)
def load_registry(path: str | None = None) -> Registry:
    p = Path(path) if path else registry_path()
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise SparkError(f"models.toml: (file): cannot read {p}: {e.strerror}") from None
    return parse_registry(text, str(p))


def family_for(arch: str) -> Family | None:
    return load_registry().get(arch)
