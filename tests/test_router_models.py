"""Router mode's model list (serve/router_models.py): --models-dir's files, a --models-preset INI
(`[*]`, merged sections, preset-only keys, dedup-cache-models) and llama.cpp's download cache read
offline, named as llama-server names them; bad input is one UsageError naming the flag and file."""

from __future__ import annotations

from pathlib import Path

import pytest

from spark_cli.errors import UsageError
from spark_cli.serve.router_models import (FlagSpec, Sources, cached_models, child_flags, discover, find,
                                           llama_cache_dir, models_dir_models, read_preset, resolve_cached)

SPECS = {"ctx-size": FlagSpec("ctx_size", "--ctx-size"), "c": FlagSpec("ctx_size", "--ctx-size"),
         "temp": FlagSpec("temp", "--temp"),
         "jinja": FlagSpec("jinja", "--jinja", True, "--no-jinja"),
         "no-jinja": FlagSpec("jinja", "--jinja", True, "--no-jinja", negated=True),
         "embedding": FlagSpec("embedding", "--embedding", True)}
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _gguf(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF")
    return path


def _cache_repo(cache: Path, repo: str, files: list[str], ref: str = "main", commit: str = COMMIT) -> Path:
    """A repo in llama.cpp's (Hugging Face's) cache layout: refs/REF, snapshots/COMMIT/FILE -> blobs/."""
    folder = cache / ("models--" + repo.replace("/", "--"))
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / ref).write_text(commit + "\n")
    for i, f in enumerate(files):
        blob = _gguf(folder / "blobs" / f"{i:064x}")
        link = folder / "snapshots" / commit / f
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(blob)
    return folder / "snapshots" / commit


def test_llama_cache_dir_follows_llama_cpps_order(tmp_path):
    assert llama_cache_dir({"LLAMA_CACHE": "tmp", "HF_HOME": "/h"}) == Path("tmp")
    assert llama_cache_dir({"HF_HUB_CACHE": "/hub"}) == Path("/hub")
    assert llama_cache_dir({"HF_HOME": "/h"}) == Path("/h/hub")
    assert llama_cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/huggingface/hub")
    assert llama_cache_dir({}) == Path.home() / ".cache" / "huggingface" / "hub"


def test_cached_models_are_named_owner_name_tag(tmp_path):
    snap = _cache_repo(tmp_path, "ggml-org/tinygemma3-GGUF", ["tinygemma3-Q8_0.gguf", "tinygemma3-f16.gguf",
                                                              "mmproj-tinygemma3.gguf", "README.md"])
    _cache_repo(tmp_path, "o/big", ["Big-Q4_K_M-00001-of-00002.gguf", "Big-Q4_K_M-00002-of-00002.gguf",
                                    "sub/Other.Q5_K_S.gguf", "notag.gguf"])
    _cache_repo(tmp_path, "o/noref", ["x-Q8_0.gguf"], commit="not-a-commit")  # an invalid ref: skipped
    (tmp_path / "models--bad").mkdir()  # not OWNER--NAME: skipped
    got = cached_models(tmp_path)
    assert sorted(got) == ["ggml-org/tinygemma3-GGUF:F16", "ggml-org/tinygemma3-GGUF:Q8_0", "o/big:Q4_K_M",
                           "o/big:Q5_K_S"]
    assert got["ggml-org/tinygemma3-GGUF:Q8_0"] == snap / "tinygemma3-Q8_0.gguf"
    assert got["o/big:Q4_K_M"].name == "Big-Q4_K_M-00001-of-00002.gguf"  # a split model: its first part
    # -hf without a tag: Q4_K_M, else Q8_0, else the first model file; -hff: that file exactly
    assert resolve_cached(tmp_path, "ggml-org/tinygemma3-GGUF") == snap / "tinygemma3-Q8_0.gguf"
    assert resolve_cached(tmp_path, "ggml-org/tinygemma3-GGUF:f16") == snap / "tinygemma3-f16.gguf"
    assert resolve_cached(tmp_path, "ggml-org/tinygemma3-GGUF", "tinygemma3-f16.gguf") == snap / "tinygemma3-f16.gguf"
    assert resolve_cached(tmp_path, "ggml-org/tinygemma3-GGUF:Q2_K") is None
    assert resolve_cached(tmp_path, "ggml-org/absent") is None
    assert cached_models(tmp_path / "nowhere") == {}


def test_models_dir_names_files_and_folders(tmp_path):
    _gguf(tmp_path / "alpha.gguf")
    _gguf(tmp_path / "mmproj-alpha.gguf")  # a projector, not a model
    _gguf(tmp_path / "mtp-alpha.gguf")  # a draft head, not a model
    _gguf(tmp_path / "beta" / "beta-Q4_K_M.gguf")
    _gguf(tmp_path / "beta" / "mmproj-beta.gguf")
    _gguf(tmp_path / "gamma" / "g-00002-of-00002.gguf")
    _gguf(tmp_path / "gamma" / "g-00001-of-00002.gguf")
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("x")
    got = models_dir_models(tmp_path)
    assert got == {"alpha": tmp_path / "alpha.gguf", "beta": tmp_path / "beta" / "beta-Q4_K_M.gguf",
                   "gamma": tmp_path / "gamma" / "g-00001-of-00002.gguf"}
    with pytest.raises(UsageError, match=r"--models-dir .*nowhere: no such folder"):
        models_dir_models(tmp_path / "nowhere")


def test_preset_ini_sections_global_keys_and_merges(tmp_path):
    cache = tmp_path / "cache"
    snap = _cache_repo(cache, "o/stories", ["stories-F32.gguf"])
    local = _gguf(tmp_path / "dir" / "local.gguf")
    ini = tmp_path / "p.ini"
    ini.write_text("; comment\n"
                   "[*]\n"
                   "c = 512\n"
                   "temp = 0.5   # inline comment\n"
                   "\n"
                   "[story]\n"
                   "hf-repo = o/stories\n"
                   "jinja = false\n"
                   "alias = s1, s2\n"
                   "tags = t\n"
                   "load-on-startup = true\n"
                   "stop-timeout = 3\n"
                   "[o/stories:f32]\n"  # the cache's model, its tag as llama.cpp writes it: flags added to it
                   "ctx-size = 2048\n"
                   "no-jinja = true\n"
                   "[path-model]\n"
                   f"model = {local}\n"
                   "embedding = on\n"
                   "[gone]\n"
                   "hf-repo = o/absent:Q8_0\n")
    models = discover(Sources(cache, tmp_path / "dir", ini), SPECS)
    assert sorted(models) == ["gone", "local", "o/stories:F32", "path-model", "story"]
    story = models["story"]
    assert story.source == "preset" and story.path == snap / "stories-F32.gguf"
    assert dict(story.flags) == {"ctx_size": ("--ctx-size", "512"), "temp": ("--temp", "0.5"), "jinja": ("--no-jinja",)}
    assert story.aliases == ("s1", "s2") and story.tags == ("t",)
    assert story.load_on_startup and story.stop_timeout == 3.0
    assert "[story]\n" in story.preset_ini() and "hf-repo = o/stories\n" in story.preset_ini()
    cached = models["o/stories:F32"]
    assert cached.source == "preset" and cached.path == snap / "stories-F32.gguf"  # merged with the cache entry
    assert dict(cached.flags)["ctx_size"] == ("--ctx-size", "2048") and dict(cached.flags)["jinja"] == ("--no-jinja",)
    assert models["local"].source == "models_dir" and dict(models["local"].flags)["ctx_size"] == ("--ctx-size", "512")
    assert models["path-model"].path == local and dict(models["path-model"].flags)["embedding"] == ("--embedding",)
    gone = models["gone"]
    assert gone.path is None and "not in llama.cpp's cache" in gone.missing and "never downloads" in gone.missing
    assert find(models, "s2") is story and find(models, "nope") is None
    # the router's command line over the preset: --temp 0 on the router holds for every model
    assert child_flags(story, {"temp": ("--temp", "0"), "threads": ("--threads", "1")}) == [
        "--ctx-size", "512", "--temp", "0", "--no-jinja", "--threads", "1"]


def test_dedup_cache_models_hides_the_cache_entry_a_preset_resolves_to(tmp_path):
    cache = tmp_path / "cache"
    _cache_repo(cache, "o/main", ["main-F32.gguf"])
    _cache_repo(cache, "o/draft", ["draft-F32.gguf"])
    _cache_repo(cache, "o/other", ["other-Q8_0.gguf"])
    ini = tmp_path / "p.ini"
    body = "[dedup]\nhf-repo = o/main\nspec-draft-hf = o/draft\n"
    ini.write_text(body + "dedup-cache-models = 1\n")
    models = discover(Sources(cache, None, ini), SPECS)
    hidden = sorted(n for n, m in models.items() if m.hidden)
    assert hidden == ["o/draft:F32", "o/main:F32"] and not models["o/other:Q8_0"].hidden
    assert "speculative decoding" in models["dedup"].refused  # listed, its draft not servable
    ini.write_text(body)
    assert not any(m.hidden for m in discover(Sources(cache, None, ini), SPECS).values())
    ini.write_text("[*]\ndedup-cache-models = 1\n\n" + body)  # from the global section too
    assert sorted(n for n, m in discover(Sources(cache, None, ini), SPECS).items() if m.hidden) == hidden


@pytest.mark.parametrize("text,why", [
    ("[a]\nthis is not a key\n", "line 2: expected [SECTION], KEY = VALUE"),
    ("[]\n", "line 1: a section needs a name"),
    ("[a]\nmodel = x.gguf\nn-gpu-experts = 3\n", "[a] n-gpu-experts: not a spark serve flag"),
    ("[a]\nmodel = x.gguf\njinja = maybe\n", "[a] jinja: expected true or false"),
    ("[a]\nmodel = x.gguf\nstop-timeout = soon\n", "[a] stop-timeout: expected seconds"),
    ("[a]\nmodel = x.gguf\nalias = b\n[b]\nmodel = y.gguf\n", "alias 'b' is already the name"),
])
def test_a_bad_preset_is_one_usage_error_naming_the_file(tmp_path, text, why):
    ini = tmp_path / "bad.ini"
    ini.write_text(text)
    with pytest.raises(UsageError) as e:
        discover(Sources(tmp_path / "cache", None, ini), SPECS)
    assert why in e.value.message and f"--models-preset {ini}" in e.value.message


def test_preset_reader_edge_cases(tmp_path):
    ini = tmp_path / "p.ini"
    with pytest.raises(UsageError, match="no such file"):
        read_preset(ini)
    ini.write_text("version = 1\nc = 8\n[x]\n[x]\nc = 9\n")
    assert read_preset(ini) == {"default": {"c": "8"}, "x": {"c": "9"}}  # keys before any section: `default`


def test_flag_specs_are_spark_serves_flags():
    import typer

    from spark_cli import cli
    from spark_cli.commands.serve_router import flag_specs

    cli._register()
    serve = typer.main.get_command(cli.app).commands["serve"]  # type: ignore[attr-defined]
    specs = flag_specs(serve)
    assert specs["c"] == specs["ctx-size"] and specs["c"].flag == "--ctx-size" and not specs["c"].switch
    assert specs["jinja"].off == "--no-jinja" and specs["no-jinja"].negated
    assert specs["no-jinja"].argv("true", "x") == ("--no-jinja",) and specs["jinja"].argv("1", "x") == ("--jinja",)
    assert {"host", "port", "api-key", "models-dir", "models-max", "plan", "alias"}.isdisjoint(specs)
