"""Folding a run's routing counts into the profile beside the model, losing nothing.

A fold locks the profile, loads it, adds the run's counts (a `RoutingProfile` delta) and
writes it atomically. When that fails (a lock held too long, a read-only folder, a full
disk, a corrupt or newer profile) the delta goes to a *pending* side file instead, and the
next fold of the same profile merges every pending file it finds:

    <profile>.pending-<utc>-<pid>.json        beside the profile, or else
    $SPARK_HOME/pending/<profile name>.<path hash>.pending-<utc>-<pid>.json

A pending file is a profile of one run's counts, written once and never changed.
`reset` moves a profile that cannot be read aside (`<profile>.old-<utc>`), keeping it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Mapping

from ..files.atomic import atomic_write_text, file_lock
from ..errors import ProfileError, SaveError, SparkError
from .profile import RoutingProfile


def _stamp() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")


def _home_prefix(profile_path: Path) -> str:
    digest = hashlib.sha256(str(profile_path.resolve()).encode("utf-8", "surrogateescape")).hexdigest()[:12]
    return f"{profile_path.name}.{digest}"


def pending_files(profile_path: Path | str) -> list[Path]:
    """Pending side files of this profile, oldest first (beside it and under SPARK_HOME)."""
    from ..files.paths import spark_home

    p = Path(profile_path)
    found = list(p.parent.glob(f"{_glob(p.name)}.pending-*.json"))
    with contextlib.suppress(SparkError, OSError):
        home = spark_home() / "pending"
        if home.is_dir():
            found += home.glob(f"{_glob(_home_prefix(p))}.pending-*.json")
    return sorted(found, key=lambda f: f.name.rsplit(".pending-", 1)[1])


def _glob(name: str) -> str:
    import glob

    return glob.escape(name)


def delta(model: Mapping[str, Any] | object, prefill, decode, tokens_prefill: float, tokens_decode: float,
          source: str) -> RoutingProfile:
    """One run's counts as a profile of their own (what a fold adds, what a pending file holds)."""
    return RoutingProfile.empty(model).add(prefill, decode, tokens_prefill, tokens_decode, source)


def _apply(p: RoutingProfile, d: RoutingProfile) -> None:
    p.add(d.prefill, d.decode, d.tokens_prefill, d.tokens_decode, d.sources[0] if d.sources else "")
    for s in d.sources[1:]:
        p._add_source(s)
    rd = d.recent_trace()
    if rd is not None:  # d's decode steps are the most recent ones
        p.add_recent(rd)


def write_pending(profile_path: Path | str, d: RoutingProfile) -> Path | None:
    """Keep a delta in a pending side file: beside the profile, else under SPARK_HOME; None if neither works."""
    from ..files.paths import pending_dir

    p = Path(profile_path)
    text = json.dumps(d.to_json(), separators=(",", ":")) + "\n"
    name = f"pending-{_stamp()}-{os.getpid()}.json"
    candidates: list[Callable[[], Path]] = [lambda: p.parent / f"{p.name}.{name}",
                                            lambda: pending_dir() / f"{_home_prefix(p)}.{name}"]
    for where in candidates:
        try:
            return atomic_write_text(where(), text)
        except SparkError:
            continue
    return None


@dataclass
class FoldResult:
    profile: RoutingProfile
    merged: list[Path] = field(default_factory=list)  # pending files merged (and removed)
    created: bool = False


def _load_for_fold(path: Path, model: Mapping[str, Any] | object) -> tuple[RoutingProfile, bool]:
    if path.exists():
        return RoutingProfile.load(path, expect=model), False
    return RoutingProfile.empty(model), True


def _merge_pending(p: RoutingProfile, path: Path) -> list[Path]:
    merged = []
    for f in pending_files(path):
        try:
            d = RoutingProfile.load(f)
        except ProfileError:
            continue  # not ours to judge or delete: left for a person to look at
        if d.same_model(p.model):
            _apply(p, d)
            merged.append(f)
    return merged


def fold(path: Path | str, model: Mapping[str, Any] | object, d: RoutingProfile | None, *,
         timeout: float | None = None, on_wait: Callable[[str], None] | None = None) -> FoldResult:
    """Add `d` (and every pending file of this profile) to the profile at `path`.

    On failure `d` is written to a pending file and SaveError names it (exit code 1);
    a profile of another model raises ProfileError unchanged, after keeping `d` the same way.
    """
    path = Path(path)
    try:
        with file_lock(path, timeout=timeout, on_wait=on_wait):
            p, created = _load_for_fold(path, model)
            merged = _merge_pending(p, path)
            if d is not None:
                _apply(p, d)
            if d is None and not merged and not created:
                return FoldResult(p)
            atomic_write_text(path, json.dumps(p.to_json(), separators=(",", ":")) + "\n")
            for f in merged:
                with contextlib.suppress(OSError):
                    f.unlink()
            return FoldResult(p, merged, created)
    except SparkError as e:
        if d is None:
            raise
        kept = write_pending(path, d)
        where = (f"this run's counts are kept in {kept}" if kept is not None
                 else "this run's counts could not be kept anywhere")
        hint = ("spark profile MODEL --reset moves the broken profile aside; pending counts join at the next run"
                if isinstance(e, ProfileError) else "they join the profile at the next run")
        raise SaveError(f"profile {path} not updated: {e.message}; {where}", hint=hint) from None


def reset(path: Path | str) -> Path | None:
    """Move the profile at `path` aside (kept as `<path>.old-<utc>`); None when there is none."""
    path = Path(path)
    if not path.exists():
        return None
    aside = path.with_name(f"{path.name}.old-{_stamp()}")
    try:
        with file_lock(path, timeout=0):
            os.rename(path, aside)
    except OSError as e:
        raise SaveError(f"profile {path}: cannot move it aside ({e.strerror or e})") from None
    return aside
