"""Router mode's model list (`spark serve` with no MODEL, as llama-server's router): where each model
comes from, under which name, and the flags its child server gets.

Three sources, as llama-server reads them (later ones win a name both have):

1. llama.cpp's download cache, read offline (Spark never downloads): LLAMA_CACHE, else Hugging
   Face's hub cache (HF_HUB_CACHE, HF_HOME/hub, ~/.cache/huggingface/hub). A repo is
   `models--OWNER--NAME/` with `refs/main` naming a commit and `snapshots/COMMIT/` holding its files
   (links into `blobs/`); each GGUF is listed as `OWNER/NAME:TAG`, TAG the quantization its file
   name ends in (`tinygemma3-Q8_0.gguf`: Q8_0), a split model once (its first part), projectors
   and draft heads (mmproj, mtp-, eagle3-, dflash-, dspark-) not at all.
2. `--models-dir DIR`: each `NAME.gguf` in DIR is NAME, each folder NAME holding a GGUF is NAME
   (its first split part, else its one model file).
3. `--models-preset FILE.ini`: each `[NAME]` section is a model, its keys spark serve's flags
   without dashes (`ctx-size = 2048`, `c = 2048`, `jinja = false`) and where its GGUF is: `model`
   (a path), or `hf-repo = OWNER/NAME[:TAG]` (and `hf-file`) looked up in the cache. `[*]` gives
   every section (and every other model) its keys first. A section named like a cached or
   --models-dir model adds flags to that model. Preset-only keys: `alias` and `tags`
   (comma-separated), `load-on-startup`, `stop-timeout` (seconds before a stopping child is
   killed) and `dedup-cache-models` (hide from the list the cache entries this section's
   hf-repo, or its draft's, resolves to; they are still served by name).

Pure: files only; no HTTP, no processes. `discover` builds the list; router_pool.py runs it.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from ..errors import UsageError

SOURCE_PRESET, SOURCE_MODELS_DIR, SOURCE_CACHE = "preset", "models_dir", "cache"
DEFAULT_STOP_TIMEOUT = 10.0  # seconds a stopping child has before it is killed (llama-server's)
GLOBAL_SECTION, DEFAULT_SECTION = "*", "default"

# file names that are not a model of their own (llama.cpp's download.cpp and preset.cpp)
COMPANIONS = ("mmproj", "mtp-", "eagle3-", "dflash-", "dspark-")
DRAFT_PREFIXES = ("mtp-", "dspark-", "dflash-")
TRUTHY, FALSEY = ("on", "enabled", "true", "1"), ("off", "disabled", "false", "0")

# preset keys about the model itself (llama-server's spellings), not flags of the child
MODEL_KEYS = {"model": "model", "m": "model", "hf-repo": "hf_repo", "hf": "hf_repo", "hfr": "hf_repo",
              "hf-file": "hf_file", "hff": "hf_file", "alias": "alias", "a": "alias", "tags": "tags"}
PRESET_ONLY = {"load-on-startup", "stop-timeout", "dedup-cache-models"}
# a draft model (speculative decoding): listed, its cache entry deduplicated, but not served
DRAFT_HF_KEYS = {"spec-draft-hf", "hf-repo-draft", "hfd", "hfrd"}
DRAFT_KEYS = DRAFT_HF_KEYS | {"model-draft", "md", "spec-draft-model", "spec-type"}
# the router's own flags: a preset's are dropped, as llama-server drops them
RESERVED = {"host", "port", "api-key", "api-key-file", "models-dir", "models-max", "models-preset",
            "models-autoload", "no-models-autoload", "version"}


@dataclass(frozen=True)
class FlagSpec:
    """One spelling of a spark serve flag, as a preset key names it (the command layer lists them)."""

    param: str               # the parameter it sets (one value per model: a later setting replaces it)
    flag: str                # the flag written for the child (--ctx-size)
    switch: bool = False     # takes no value: `key = true|false`
    off: str | None = None   # a switch's off form (--no-jinja); None: false leaves it out
    negated: bool = False    # this spelling is the off form (`no-jinja = true` is --no-jinja)

    def argv(self, value: str, where: str) -> tuple[str, ...]:
        if not self.switch:
            return (self.flag, value)
        v = value.strip().lower()
        if v not in TRUTHY + FALSEY:
            raise UsageError(f"{where}: expected true or false, got {value!r}")
        on = (v in TRUTHY) != self.negated
        return (self.flag,) if on else ((self.off,) if self.off else ())


@dataclass(frozen=True)
class RouterModel:
    """One model the router can serve: its name, where its GGUF is, and its child's flags."""

    name: str
    source: str                                  # SOURCE_PRESET, SOURCE_MODELS_DIR or SOURCE_CACHE
    path: Path | None                            # the GGUF (its first part); None: not on this machine
    missing: str = ""                            # why path is None
    flags: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # param -> the preset's argv for it
    options: Mapping[str, str] = field(default_factory=dict)  # the preset's keys as given (GET /models)
    aliases: tuple[str, ...] = ()
    tags: tuple[str, ...] = ()
    hidden: bool = False                         # deduplicated by a preset: served, not listed
    load_on_startup: bool = False
    stop_timeout: float = DEFAULT_STOP_TIMEOUT
    refused: str = ""                            # why spark serve cannot serve it (a draft model)

    def preset_ini(self) -> str:
        """The preset's keys as an INI section (llama-server's status.preset)."""
        return "".join([f"[{self.name}]\n", *(f"{k} = {v}\n" for k, v in self.options.items())])


@dataclass(frozen=True)
class Sources:
    """Where router mode looks: --models-dir, --models-preset and llama.cpp's cache folder."""

    cache: Path
    models_dir: Path | None = None
    preset: Path | None = None


# ---------------------------------------------------------------- llama.cpp's download cache


def llama_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """The folder llama.cpp downloads into (hf-cache.cpp's order): LLAMA_CACHE, HF_HUB_CACHE,
    HUGGINGFACE_HUB_CACHE, HF_HOME/hub, XDG_CACHE_HOME/huggingface/hub, ~/.cache/huggingface/hub."""
    env = os.environ if env is None else env
    for var, sub in (("LLAMA_CACHE", ""), ("HF_HUB_CACHE", ""), ("HUGGINGFACE_HUB_CACHE", ""), ("HF_HOME", "hub"),
                     ("XDG_CACHE_HOME", "huggingface/hub")):
        if env.get(var):
            return Path(env[var]).expanduser() / sub
    return Path.home() / ".cache" / "huggingface" / "hub"


_REPO_ID = re.compile(r"^[A-Za-z0-9_]+(?:[./-][A-Za-z0-9_]+)*$")
_COMMIT = re.compile(r"^[0-9a-fA-F]{40}$")
_SPLIT = re.compile(r"^(.+)-([0-9]{5})-of-([0-9]{5})$", re.IGNORECASE)
_TAG = re.compile(r"[-.]([A-Z0-9_]+)$", re.IGNORECASE)


def repo_folder(repo: str) -> str:
    """`ggml-org/models` -> `models--ggml-org--models` (the hub cache's folder name)."""
    return "models--" + repo.replace("/", "--")


def _repo_of(folder: str) -> str | None:
    if not folder.startswith("models--"):
        return None
    repo = folder[len("models--"):].replace("--", "/")
    return repo if repo.count("/") == 1 and _REPO_ID.match(repo) and len(repo) <= 256 else None


def _commit(repo_dir: Path) -> str | None:
    """The snapshot a repo's refs name: refs/main, else the first valid ref."""
    refs = repo_dir / "refs"
    if not refs.is_dir():
        return None
    found = None
    for ref in sorted(refs.iterdir()):
        try:
            commit = ref.read_text().splitlines()[0].strip() if ref.is_file() else ""
        except (OSError, IndexError):
            continue
        if _COMMIT.match(commit):
            if ref.name == "main":
                return commit
            found = found or commit
    return found


@dataclass(frozen=True)
class CachedFile:
    repo: str
    rel: str      # the file's path in the repo (posix)
    local: Path   # the snapshot's entry (a link into blobs/, usually)


def cached_files(cache: Path, repo: str | None = None) -> list[CachedFile]:
    """Every file of the cache's repos (or of `repo`) in their current snapshot, sorted."""
    if not cache.is_dir():
        return []
    out: list[CachedFile] = []
    folders = [cache / repo_folder(repo)] if repo else sorted(cache.iterdir())
    for d in folders:
        name = _repo_of(d.name)
        commit = _commit(d) if name and d.is_dir() else None
        snap = d / "snapshots" / commit if commit else None
        if snap is None or not snap.is_dir():
            continue
        for root, dirs, files in os.walk(snap, followlinks=False):
            dirs.sort()
            for f in sorted(files):
                local = Path(root) / f
                out.append(CachedFile(name, local.relative_to(snap).as_posix(), local))  # type: ignore[arg-type]
    return out


def split_info(rel: str) -> tuple[str, str, int, int] | None:
    """(prefix, TAG, part, parts) of a GGUF's path (`x/Model-Q4_K_M-00001-of-00003.gguf`: prefix
    `x/Model-Q4_K_M`, Q4_K_M, 1, 3); None for a file that is not .gguf. TAG may be ''."""
    if not rel.endswith(".gguf"):
        return None
    prefix, index, count = rel[:-len(".gguf")], 1, 1
    m = _SPLIT.match(prefix)
    if m:
        prefix, index, count = m.group(1), int(m.group(2)), int(m.group(3))
    t = _TAG.search(prefix)
    return prefix, t.group(1).upper() if t else "", index, count


def _is_model_file(rel: str) -> bool:
    name = rel.rsplit("/", 1)[-1]
    return name.endswith(".gguf") and "imatrix" not in name and not any(c in name for c in COMPANIONS)


def split_repo_tag(repo_tag: str) -> tuple[str, str]:
    """`owner/name:Q8_0` -> ('owner/name', 'Q8_0'); no tag: ''."""
    repo, _, tag = repo_tag.partition(":")
    return repo, tag


def resolve_cached(cache: Path, repo_tag: str, hf_file: str = "") -> Path | None:
    """The cached GGUF that `-hf OWNER/NAME[:TAG]` (and `-hff FILE`) loads, offline: FILE exactly;
    else the first model file whose name has TAG (no TAG: Q4_K_M, then Q8_0, then any), a split
    model's first part. None when the cache has no such file."""
    repo, tag = split_repo_tag(repo_tag)
    files = cached_files(cache, repo) if repo.count("/") == 1 else []
    if hf_file:
        return next((f.local for f in files if f.rel == hf_file), None)
    for t in [tag] if tag else ["Q4_K_M", "Q8_0"]:
        pattern = re.compile(re.escape(t) + r"[.-]", re.IGNORECASE)
        for f in files:
            info = split_info(f.rel)
            if _is_model_file(f.rel) and pattern.search(f.rel) and info and (info[3] <= 1 or info[2] == 1):
                return f.local
    if not tag:
        for f in files:
            info = split_info(f.rel)
            if _is_model_file(f.rel) and info and (info[3] <= 1 or info[2] == 1):
                return f.local
    return None


def cached_models(cache: Path) -> dict[str, Path]:
    """llama.cpp's cached models by name (`OWNER/NAME:TAG`) and the GGUF each loads."""
    out: dict[str, Path] = {}
    for f in cached_files(cache):
        info = split_info(f.rel)
        if info is None or info[2] != 1 or not info[1] or any(c in info[0] for c in COMPANIONS):
            continue
        name = f"{f.repo}:{info[1]}"
        if name not in out:
            path = resolve_cached(cache, name)
            if path is not None:
                out[name] = path
    return out


# ---------------------------------------------------------------- --models-dir


def models_dir_models(folder: Path) -> dict[str, Path]:
    """--models-dir's models by name: `NAME.gguf`, and folders holding one (its first split part,
    else its model file; projectors and draft heads are not models of their own)."""
    if not folder.is_dir():
        raise UsageError(f"--models-dir {folder}: no such folder", hint="give the folder your GGUF files are in")
    out: dict[str, Path] = {}
    for entry in sorted(folder.iterdir()):
        if entry.is_dir():
            ggufs = sorted(p for p in entry.iterdir() if p.name.endswith(".gguf") and p.is_file())
            models = [p for p in ggufs if "mmproj" not in p.name and not p.name.startswith(DRAFT_PREFIXES)]
            first = [p for p in models if "-00001-of-" in p.name]
            whole = [p for p in models if not _SPLIT.match(p.name[:-len(".gguf")])]
            if first or whole:
                out[entry.name] = (first or whole)[0]
        elif entry.name.endswith(".gguf") and entry.is_file():
            if "mmproj" in entry.name or entry.name.startswith(DRAFT_PREFIXES):
                continue
            out[entry.name.replace(".gguf", "")] = entry
    return out


# ---------------------------------------------------------------- --models-preset


_HEADER = re.compile(r"^[ \t]*\[[ \t]*([^\]]*?)[ \t]*\][ \t]*(?:[;#].*)?$")
_KEY_VALUE = re.compile(r"^[ \t]*([A-Za-z_][A-Za-z0-9_.-]*)[ \t]*=[ \t]*([^;#]*?)[ \t]*(?:[;#].*)?$")
_BLANK = re.compile(r"^[ \t]*(?:[;#].*)?$")


def canonical_name(section: str) -> str:
    """A section's model name with its tag as llama.cpp writes it (`repo:q8_0` -> `repo:Q8_0`)."""
    if section in (GLOBAL_SECTION, DEFAULT_SECTION) or ":" not in section:
        return section
    head, _, tag = section.rpartition(":")
    m = _TAG.search(tag)
    return f"{head}:{(m.group(1) if m else tag).upper()}"


def read_preset(path: Path) -> dict[str, dict[str, str]]:
    """An INI preset's sections (`[*]` included; keys before the first section are `default`'s),
    each key's last value. UsageError naming the file and line for anything else."""
    where = f"--models-preset {path}"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"{where}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{where}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    sections: dict[str, dict[str, str]] = {}
    current = DEFAULT_SECTION
    for n, line in enumerate(text.splitlines(), 1):
        if _BLANK.match(line):
            continue
        h = _HEADER.match(line)
        if h:
            if not h.group(1):
                raise UsageError(f"{where}: line {n}: a section needs a name ([NAME])")
            current = canonical_name(h.group(1))
            sections.setdefault(current, {})
            continue
        kv = _KEY_VALUE.match(line)
        if kv is None:
            raise UsageError(f"{where}: line {n}: expected [SECTION], KEY = VALUE or a comment, got {line.strip()!r}")
        if kv.group(1) != "version":  # NOTE: reserved by llama.cpp for the format's version
            sections.setdefault(current, {})[kv.group(1)] = kv.group(2)
    if not sections.get(DEFAULT_SECTION, True):
        sections.pop(DEFAULT_SECTION)
    return sections


@dataclass
class _Entry:
    """A model being assembled from the sources."""

    name: str
    source: str
    path: Path | None = None
    options: dict[str, str] = field(default_factory=dict)


def _truthy(value: str) -> bool:
    return value.strip().lower() in TRUTHY


def _names(text: str) -> tuple[str, ...]:
    return tuple(sorted({n.strip() for n in text.split(",") if n.strip()}))


def _build(e: _Entry, cache: Path, specs: Mapping[str, FlagSpec], where: str) -> RouterModel:
    """A model from its entry: the preset's keys checked and turned into the child's flags, its GGUF
    found (a preset's `model` or `hf-repo` over what its source found)."""
    flags: dict[str, tuple[str, ...]] = {}
    model_keys: dict[str, str] = {}
    refused = ""
    stop_timeout = DEFAULT_STOP_TIMEOUT
    for key, value in e.options.items():
        at = f"{where}: [{e.name}] {key}"
        if key in MODEL_KEYS:
            model_keys[MODEL_KEYS[key]] = value
        elif key in DRAFT_KEYS:
            refused = f"{key}: speculative decoding (a draft model) is not in spark serve"
        elif key == "stop-timeout":
            try:
                stop_timeout = float(value)
            except ValueError:
                raise UsageError(f"{at}: expected seconds, got {value!r}") from None
        elif key in PRESET_ONLY or key in RESERVED:
            continue
        elif key in specs:
            spec = specs[key]
            flags[spec.param] = spec.argv(value, at)
        else:
            raise UsageError(f"{at}: not a spark serve flag (spark serve --help lists them)")
    path, missing = e.path, ""
    if model_keys.get("model"):
        path = Path(model_keys["model"]).expanduser()
        missing = "" if path.is_file() else f"{path}: no such file"
        path = path if path.is_file() else None
    elif model_keys.get("hf_repo"):
        repo = model_keys["hf_repo"]
        path = resolve_cached(cache, repo, model_keys.get("hf_file", ""))
        missing = "" if path is not None else (
            f"{repo}{' ' + model_keys['hf_file'] if model_keys.get('hf_file') else ''}: not in llama.cpp's cache "
            f"({cache}); spark serve never downloads (llama-server -hf {repo} downloads it there)")
    elif path is None:
        missing = "the preset names no GGUF (give it `model = PATH` or `hf-repo = OWNER/NAME[:TAG]`)"
    return RouterModel(e.name, e.source, path, missing, flags, dict(e.options), _names(model_keys.get("alias", "")),
                       _names(model_keys.get("tags", "")), load_on_startup=_truthy(e.options.get("load-on-startup", "")),
                       stop_timeout=stop_timeout, refused=refused)


def _dedup_paths(presets: dict[str, dict[str, str]], cache: Path) -> set[Path]:
    """The cached GGUFs the presets with dedup-cache-models resolve to (their model's and their draft's)."""
    out: set[Path] = set()
    for opts in presets.values():
        if not _truthy(opts.get("dedup-cache-models", "")):
            continue
        repo = next((opts[k] for k in ("hf-repo", "hf", "hfr") if opts.get(k)), "")
        if repo:
            p = resolve_cached(cache, repo, next((opts[k] for k in ("hf-file", "hff") if opts.get(k)), ""))
            out |= {p} if p is not None else set()
        draft = next((opts[k] for k in sorted(DRAFT_HF_KEYS) if opts.get(k)), "")
        if draft:
            p = resolve_cached(cache, draft)
            out |= {p} if p is not None else set()
    return out


def discover(sources: Sources, specs: Mapping[str, FlagSpec]) -> dict[str, RouterModel]:
    """Every model of the sources by name (sorted), llama-server's way: the cache's, --models-dir's
    over them, the preset's sections over both (merged into a model of the same name); `[*]`'s keys
    under every model's. `specs`: the preset keys that are spark serve flags. UsageError for a bad
    --models-dir or preset (naming the flag, file and section)."""
    entries: dict[str, _Entry] = {}
    cached = cached_models(sources.cache)
    for name, path in cached.items():
        entries[name] = _Entry(name, SOURCE_CACHE, path)
    if sources.models_dir is not None:
        for name, path in models_dir_models(sources.models_dir).items():
            entries[name] = _Entry(name, SOURCE_MODELS_DIR, path)
    presets: dict[str, dict[str, str]] = {}
    glob: dict[str, str] = {}
    if sources.preset is not None:
        presets = read_preset(sources.preset)
        glob = presets.pop(GLOBAL_SECTION, {})
        presets = {name: {**glob, **opts} for name, opts in presets.items()}
    for e in entries.values():
        e.options = dict(glob)
    for name, opts in presets.items():
        e = entries.setdefault(name, _Entry(name, SOURCE_PRESET))
        e.source = SOURCE_PRESET
        e.options = {**e.options, **opts}
    where = f"--models-preset {sources.preset}"
    models = {name: _build(entries[name], sources.cache, specs, where) for name in sorted(entries)}
    hidden = _dedup_paths(presets, sources.cache)
    if hidden:
        models = {name: dataclasses.replace(m, hidden=True) if m.source == SOURCE_CACHE and m.path in hidden else m
                  for name, m in models.items()}
    _check_names(models, where)
    return models


def _check_names(models: Mapping[str, RouterModel], where: str) -> None:
    """An alias may name one model only, and not another model's name (llama-server refuses both)."""
    seen: dict[str, str] = {}
    for m in models.values():
        for a in m.aliases:
            other = a if a in models and a != m.name else seen.get(a)
            if other is not None:
                raise UsageError(f"{where}: [{m.name}] alias {a!r} is already the name or an alias of {other!r}")
            seen[a] = m.name


def find(models: Mapping[str, RouterModel], name: str) -> RouterModel | None:
    """The model a request's `model` names: by name, else by alias."""
    if name in models:
        return models[name]
    return next((m for m in models.values() if name in m.aliases), None)


def child_flags(model: RouterModel, cli: Mapping[str, tuple[str, ...]]) -> list[str]:
    """The child's flags: the preset's (its section's over `[*]`'s), the router's command-line flags
    over them (as llama-server's: `--temp 0` on the router holds for every model)."""
    merged = {**model.flags, **cli}
    return [a for argv in merged.values() for a in argv]
