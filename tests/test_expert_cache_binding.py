"""spark_cli/expert_cache.py against the C header it binds: every status, every struct field in
order, every function; a library of another API version is refused at load, in one line."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace

import pytest

from spark_cli.native import expert_cache as ec
from spark_cli.errors import NativeError

HEADER = (Path(__file__).resolve().parent.parent / "native" / "include" / "llama-expert-cache-api.h").read_text()
PREFIX = "LLAMA_EXPERT_CACHE_"


def _enum(name: str) -> dict[str, int]:
    body = re.search(rf"enum {name} \{{(.*?)\}};", HEADER, re.S).group(1)
    return {m.group(1): int(m.group(2)) for m in re.finditer(rf"{PREFIX}(\w+)\s*=\s*(-?\d+)", body)}


def _struct(name: str) -> list[str]:
    body = re.search(rf"struct {name} \{{(.*?)\}};", HEADER, re.S).group(1)
    return re.findall(r"(\w+);", re.sub(r"//[^\n]*", "", body))


def test_api_version() -> None:
    assert int(re.search(rf"#define {PREFIX}API_VERSION (\d+)", HEADER).group(1)) == ec.API_VERSION


@pytest.mark.parametrize("c_enum,py_enum", [
    ("llama_expert_cache_status", ec.Status),
    ("llama_expert_cache_phase", ec.Phase),
    ("llama_expert_cache_miss_path", ec.NativeMissPath),
])
def test_enums_cover_every_code(c_enum, py_enum) -> None:
    want = _enum(c_enum)
    prefix = {"llama_expert_cache_phase": "PHASE_", "llama_expert_cache_miss_path": "MISS_"}.get(c_enum, "")
    got = {prefix + m.name: int(m) for m in py_enum}
    assert got == want


@pytest.mark.parametrize("c_struct,ctype", [
    ("llama_expert_cache_layer_params", ec.LayerParams),
    ("llama_expert_cache_params", ec.Params),
    ("llama_expert_cache_stats", ec.Stats),
])
def test_structs_match_the_header_field_by_field(c_struct, ctype) -> None:
    assert [n for n, _ in ctype._fields_] == _struct(c_struct)


def test_stats_dataclass_mirrors_the_struct() -> None:
    assert [f.name for f in fields(ec.CacheStats)] == _struct("llama_expert_cache_stats")
    a = ec.CacheStats(hits=3, misses=1, syncs=2)
    assert (a + a - a) == a and ec.CacheStats.total([a, a]).syncs == 4 and a.hit_rate == 0.75


def test_every_function_is_bound_and_named_after_it() -> None:
    c_functions = set(re.findall(r"LLAMA_API [^;]*?\bllama_expert_cache_(\w+)\(", HEADER))
    api = vars(ec.ExpertCacheAPI(_FakeLib(2)))
    assert c_functions == set(api)
    methods = {n for n in vars(ec.ExpertCache) if not n.startswith("_")}
    assert c_functions - {"api_version"} == methods


class _FakeLib:
    """Stands in for the ctypes library: every llama_expert_cache_* function."""

    def __init__(self, version: int | None, size: int | None = None):
        names = re.findall(r"LLAMA_API [^;]*?\b(llama_expert_cache_\w+)\(", HEADER)
        for n in names:
            setattr(self, n, _fn(lambda *a: 0))
        if version is None:
            delattr(self, "llama_expert_cache_api_version")
        else:
            self.llama_expert_cache_api_version = _fn(lambda: version)
        p = SimpleNamespace(size=ec.ctypes.sizeof(ec.Params) if size is None else size)
        self.llama_expert_cache_default_params = _fn(lambda: p)


def _fn(f):
    def g(*a):
        return f(*a)
    return g


def _older_lib() -> _FakeLib:
    """A build of the previous API version: it lacks the function v4 added."""
    lib = _FakeLib(ec.API_VERSION - 1)
    delattr(lib, "llama_expert_cache_memory_breakdown")
    return lib


@pytest.mark.parametrize("lib,message", [
    (_FakeLib(None), f"expert cache API v1, Spark needs v{ec.API_VERSION}"),
    (_older_lib(), f"expert cache API v{ec.API_VERSION - 1}, Spark needs v{ec.API_VERSION}"),
    (_FakeLib(ec.API_VERSION + 1), f"expert cache API v{ec.API_VERSION + 1}, Spark needs v{ec.API_VERSION}"),
    (_FakeLib(ec.API_VERSION, size=40), "params are 40 bytes"),
])
def test_another_api_version_is_refused_at_load(lib, message) -> None:
    with pytest.raises(NativeError, match=message) as e:
        ec.ExpertCacheAPI.bind(lib)
    assert "\n" not in e.value.one_line() and "scripts/bootstrap.sh" in e.value.one_line()
    assert e.value.exit_code == NativeError.exit_code


def test_a_stock_library_has_no_cache() -> None:
    assert ec.ExpertCacheAPI.bind(SimpleNamespace()) is None
    assert ec.ExpertCacheAPI.bind(_FakeLib(ec.API_VERSION)) is not None
