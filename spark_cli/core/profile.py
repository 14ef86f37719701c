"""Routing profiles: how often each (layer, expert) is routed, prefill and decode apart.

A profile lives beside its model as `<model>.spark-profile.json`:

    {
      "format": "spark-routing-profile",
      "version": 1,
      "model": {"arch": "qwen3moe", "n_layer": 48, "n_expert": 128, "n_expert_used": 8,
                "fingerprint": "<hex>", "tensor_layout_hash": "<hex>"},
      "half_life_tokens": 1000000,        # decode tokens; 0 = never age
      "tokens_prefill": 5120.0,           # aged like the counts
      "tokens_decode": 2048.0,
      "created": "2025-01-01T12:00:00+00:00",
      "updated": "2025-01-02T08:30:00+00:00",
      "sources": ["profile corpus wiki", "chat"],
      "prefill": [[...n_expert floats...], ...n_layer rows],
      "decode":  [[...n_expert floats...], ...n_layer rows],
      "recent":  {"layers": [1, 2, ...], "k": 8, "dtype": "uint8", "steps": 512,
                  "ids": "<base64>"}          # version 2, optional
    }

Version 2 adds `recent`: a bounded ring of the most recent decode steps (one token each),
kept so that a plan can replay real traffic without a separate trace. `ids` is the
base64 of a C-order array [steps, len(layers), k] of `dtype` (uint8 when n_expert <= 256,
else little-endian uint16): the routed ids of each listed MoE layer, oldest step first.
The ring holds at most `recent_capacity()` steps: RECENT_MAX_BYTES of ids, at most
RECENT_MAX_STEPS. Version 1 files (no ring) are read as they are.

Counts are routed (token, slot k) occurrences; non-MoE layers hold zeros. Floats are
written with Python's shortest round-trip repr, so save/load is exact.

Ageing: adding a batch with `n` new tokens (its decode tokens, or its prefill tokens
when it has none) first multiplies every existing count and token total by
`0.5 ** (n / half_life_tokens)`, so a batch of one half-life halves the old history.
"""

from __future__ import annotations

import base64
import binascii
import copy
import json
import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from ..files.atomic import atomic_write_text, check_output, file_lock, lock_timeout_default
from ..files.regular import read_regular_text
from ..errors import ProfileError

FORMAT = "spark-routing-profile"
FORMAT_VERSION = 2
READ_VERSIONS = (1, 2)
RECENT_MAX_BYTES = 256 << 10
RECENT_MAX_STEPS = 4096
DEFAULT_HALF_LIFE_TOKENS = 1_000_000
MODEL_KEYS = ("arch", "n_layer", "n_expert", "n_expert_used", "fingerprint", "tensor_layout_hash")
MAX_SOURCES = 32
RESET_HINT = "spark profile MODEL --reset moves it aside, keeping it, and starts a fresh profile"


def profile_path_for(model_path: Path | str) -> Path:
    """`<model>.spark-profile.json`, beside the model file."""
    return Path(str(model_path) + ".spark-profile.json")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def model_identity(model: Mapping[str, Any] | object) -> dict[str, Any]:
    """The identity dict of a model: from a mapping or an object with those attributes."""
    get = model.get if isinstance(model, Mapping) else (lambda key, d=None: getattr(model, key, d))
    out: dict[str, Any] = {}
    for key in MODEL_KEYS:
        value = get(key, None)
        if value is None and key in ("n_layer", "n_expert", "fingerprint"):
            raise ProfileError(f"model identity lacks {key}")
        if key in ("n_layer", "n_expert", "n_expert_used"):
            value = int(value or 0)
        else:
            value = str(value or "")
        out[key] = value
    return out


def _describe(model: Mapping[str, Any]) -> str:
    return f"{model.get('arch') or '?'} {model.get('n_layer')}x{model.get('n_expert')}"


def _num(x: float) -> float | int:
    return int(x) if float(x).is_integer() else float(x)


def _aging(new_tokens: float, half_life: float) -> float:
    return 1.0 if half_life <= 0 else 0.5 ** (new_tokens / half_life)


@dataclass
class RoutingProfile:
    model: dict[str, Any]
    prefill: np.ndarray  # float64 [n_layer, n_expert]
    decode: np.ndarray  # float64 [n_layer, n_expert]
    tokens_prefill: float = 0.0
    tokens_decode: float = 0.0
    half_life_tokens: float = DEFAULT_HALF_LIFE_TOKENS
    created: str = field(default_factory=_now)
    updated: str = field(default_factory=_now)
    sources: list[str] = field(default_factory=list)
    version: int = FORMAT_VERSION
    recent: np.ndarray | None = None  # [steps, len(recent_layers), k] routed ids, oldest first
    recent_layers: tuple[int, ...] = ()

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.model["n_layer"]), int(self.model["n_expert"])

    @property
    def fingerprint(self) -> str:
        return str(self.model["fingerprint"])

    @classmethod
    def empty(cls, model: Mapping[str, Any] | object,
              half_life_tokens: float = DEFAULT_HALF_LIFE_TOKENS) -> "RoutingProfile":
        ident = model_identity(model)
        shape = (ident["n_layer"], ident["n_expert"])
        return cls(ident, np.zeros(shape), np.zeros(shape), half_life_tokens=half_life_tokens)

    @classmethod
    def uniform(cls, model: Mapping[str, Any] | object) -> "RoutingProfile":
        """Prior without data: one token per phase routed evenly (k / E per expert)."""
        p = cls.empty(model)
        n_layer, n_expert = p.shape
        share = (p.model["n_expert_used"] or 1) / n_expert
        p.prefill = np.full((n_layer, n_expert), share)
        p.decode = np.full((n_layer, n_expert), share)
        p.tokens_prefill = p.tokens_decode = 1.0
        p.sources = ["uniform prior"]
        return p

    def copy(self) -> "RoutingProfile":
        return copy.deepcopy(self)

    def same_model(self, model: Mapping[str, Any] | object) -> bool:
        other = model_identity(model)
        return (other["fingerprint"] == self.fingerprint
                and (other["n_layer"], other["n_expert"]) == self.shape)

    def _add_source(self, source: str) -> None:
        if source and source not in self.sources:
            self.sources.append(source)
            del self.sources[:-MAX_SOURCES]

    def age(self, new_tokens: float) -> None:
        f = _aging(new_tokens, self.half_life_tokens)
        self.prefill = self.prefill * f
        self.decode = self.decode * f
        self.tokens_prefill *= f
        self.tokens_decode *= f

    def add(self, prefill_counts: np.ndarray | None, decode_counts: np.ndarray | None,
            tokens_prefill: float, tokens_decode: float, source: str = "") -> "RoutingProfile":
        """Age the history by the new tokens, then add the new counts. Returns self."""
        zeros = np.zeros(self.shape)
        pre = zeros if prefill_counts is None else np.asarray(prefill_counts, dtype=np.float64)
        dec = zeros if decode_counts is None else np.asarray(decode_counts, dtype=np.float64)
        for name, arr in (("prefill", pre), ("decode", dec)):
            if arr.shape != self.shape:
                raise ProfileError(f"{name} counts have shape {arr.shape}, profile has {self.shape}")
            if not np.all(np.isfinite(arr)) or np.any(arr < 0):
                raise ProfileError(f"{name} counts must be finite and non-negative")
        if tokens_prefill < 0 or tokens_decode < 0:
            raise ProfileError("token counts must be non-negative")
        self.age(tokens_decode if tokens_decode > 0 else tokens_prefill)
        self.prefill = self.prefill + pre
        self.decode = self.decode + dec
        self.tokens_prefill += float(tokens_prefill)
        self.tokens_decode += float(tokens_decode)
        self._add_source(source)
        self.updated = _now()
        return self

    def add_trace(self, trace: Any, source: str = "") -> "RoutingProfile":
        """Add the counts of a RoutingTrace of this model, and its decode steps to the ring."""
        if trace.fingerprint != self.fingerprint:
            raise ProfileError("cannot add a trace of another model to this profile")
        n_dec = trace.n_decode
        self.add(trace.counts("prefill"), trace.counts("decode"), trace.n_rows - n_dec, n_dec, source)
        return self.add_recent(trace)

    def recent_capacity(self, n_layers: int, k: int) -> int:
        """Steps the ring holds for `n_layers` MoE layers of `k` ids each."""
        item = 1 if self.shape[1] <= 256 else 2
        return max(1, min(RECENT_MAX_STEPS, RECENT_MAX_BYTES // max(1, n_layers * k * item)))

    def add_recent(self, trace: Any) -> "RoutingProfile":
        """Append the one-token decode steps of a RoutingTrace of this model to the ring
        (the oldest fall out). A trace with other MoE layers or k restarts the ring."""
        if trace.fingerprint != self.fingerprint:
            raise ProfileError("cannot add a trace of another model to this profile")
        dec = trace.decode_steps()
        layers = tuple(trace.moe_layers())
        if not dec.n_rows or not layers:
            return self
        ids = dec.ids[:, list(layers), :].astype(np.int16)
        ids = ids[(ids >= 0).all(axis=(1, 2))]  # steps where every MoE layer ran
        if self.recent is not None and (self.recent_layers != layers or self.recent.shape[2] != trace.k):
            self.recent, self.recent_layers = None, ()
        ring = ids if self.recent is None else np.concatenate([self.recent, ids])
        cap = self.recent_capacity(len(layers), trace.k)
        self.recent, self.recent_layers = ring[-cap:], layers
        return self

    def recent_trace(self) -> Any:
        """The ring as a RoutingTrace of decode steps (None when empty)."""
        from .trace import DECODE, RoutingTrace

        if self.recent is None or not len(self.recent):
            return None
        n, n_layer = len(self.recent), self.shape[0]
        ids = np.full((n, n_layer, self.recent.shape[2]), -1, dtype=np.int16)
        ids[:, list(self.recent_layers), :] = self.recent
        return RoutingTrace(ids, np.full(n, DECODE), np.arange(n), self.shape[1], self.fingerprint)

    def _recent_json(self) -> dict[str, Any] | None:
        if self.recent is None or not len(self.recent):
            return None
        dtype = "uint8" if self.shape[1] <= 256 else "uint16"
        raw = np.ascontiguousarray(self.recent.astype("<u2" if dtype == "uint16" else np.uint8)).tobytes()
        return {"layers": list(self.recent_layers), "k": int(self.recent.shape[2]), "dtype": dtype,
                "steps": int(len(self.recent)), "ids": base64.b64encode(raw).decode("ascii")}

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": self.version,
            "model": dict(self.model),
            "half_life_tokens": _num(self.half_life_tokens),
            "tokens_prefill": float(self.tokens_prefill),
            "tokens_decode": float(self.tokens_decode),
            "created": self.created,
            "updated": self.updated,
            "sources": list(self.sources),
            "prefill": self.prefill.tolist(),
            "decode": self.decode.tolist(),
            **({"recent": r} if (r := self._recent_json()) is not None else {}),
        }

    def _write(self, path: Path, flag: str | None = None) -> None:
        atomic_write_text(path, json.dumps(self.to_json(), separators=(",", ":")) + "\n", flag)

    def save(self, path: Path | str, flag: str | None = None) -> None:
        """Atomic write under the profile's lock: readers see the old or the new file.
        The path is checked first (OutputError names `flag`); a failed write is a SaveError."""
        path = check_output(path, flag, make_parent=True)
        with file_lock(path, timeout=lock_timeout_default()):
            self._write(path, flag)

    @classmethod
    def from_json(cls, d: Any, where: str) -> "RoutingProfile":
        bad = f"profile {where} is corrupt"
        if not isinstance(d, dict) or d.get("format", FORMAT) != FORMAT:
            raise ProfileError(f"{bad}: not a Spark routing profile")
        if d.get("version") not in READ_VERSIONS:
            raise ProfileError(f"profile {where} has format version {d.get('version')}; "
                               f"this Spark reads versions {', '.join(map(str, READ_VERSIONS))}",
                               hint=RESET_HINT)
        try:
            model = model_identity(d["model"])
            shape = (model["n_layer"], model["n_expert"])
            counts = {k: np.asarray(d[k], dtype=np.float64) for k in ("prefill", "decode")}
            nums = {k: float(d[k]) for k in ("tokens_prefill", "tokens_decode", "half_life_tokens")}
            sources = [str(s) for s in d.get("sources", [])]
            created, updated = str(d["created"]), str(d["updated"])
        except (KeyError, TypeError, ValueError, ProfileError) as e:
            raise ProfileError(f"{bad}: {type(e).__name__}: {e}".splitlines()[0]) from None
        for k, arr in counts.items():
            if arr.shape != shape:
                raise ProfileError(f"{bad}: {k} has shape {arr.shape}, model is {shape}")
            if not np.all(np.isfinite(arr)) or np.any(arr < 0):
                raise ProfileError(f"{bad}: {k} holds negative or non-finite counts")
        if any(not math.isfinite(v) or v < 0 for v in nums.values()):
            raise ProfileError(f"{bad}: negative or non-finite token totals")
        recent, recent_layers = _recent_from_json(d.get("recent"), shape, bad)
        return cls(model, counts["prefill"], counts["decode"], nums["tokens_prefill"],
                   nums["tokens_decode"], nums["half_life_tokens"], created, updated, sources,
                   recent=recent, recent_layers=recent_layers)

    @classmethod
    def load(cls, path: Path | str, expect: Mapping[str, Any] | object | None = None) -> "RoutingProfile":
        path = Path(path)
        try:
            text = read_regular_text(path)
        except FileNotFoundError:
            raise ProfileError(f"profile {path} not found") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ProfileError(f"profile {path} is unreadable: {e}".splitlines()[0]) from None
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ProfileError(f"profile {path} is corrupt: {e}".splitlines()[0]) from None
        p = cls.from_json(d, str(path))
        if expect is not None and not p.same_model(expect):
            raise ProfileError(
                f"profile {path} belongs to model {_describe(p.model)} (fingerprint "
                f"{p.fingerprint[:16]}); run spark profile on this model or pass --profile")
        return p


def _recent_from_json(r: Any, shape: tuple[int, int], bad: str) -> tuple[np.ndarray | None, tuple[int, ...]]:
    if r is None:
        return None, ()
    try:
        layers = tuple(int(x) for x in r["layers"])
        k, steps, dtype = int(r["k"]), int(r["steps"]), str(r["dtype"])
        raw = base64.b64decode(r["ids"], validate=True)
    except (KeyError, TypeError, ValueError, binascii.Error) as e:
        raise ProfileError(f"{bad}: recent: {type(e).__name__}: {e}".splitlines()[0]) from None
    if dtype not in ("uint8", "uint16") or k < 1 or steps < 0:
        raise ProfileError(f"{bad}: recent: dtype {dtype!r}, k {k}, steps {steps}")
    item = 1 if dtype == "uint8" else 2
    if len(raw) != steps * len(layers) * k * item or any(not 0 <= l < shape[0] for l in layers):
        raise ProfileError(f"{bad}: recent: {len(raw)} bytes for {steps} steps x {len(layers)} layers x {k}")
    ids = np.frombuffer(raw, dtype=np.uint8 if item == 1 else "<u2").astype(np.int16)
    if ids.size and ids.max() >= shape[1]:
        raise ProfileError(f"{bad}: recent: expert ids outside [0, {shape[1]})")
    return ids.reshape(steps, len(layers), k), layers


def merge(a: RoutingProfile, b: RoutingProfile) -> RoutingProfile:
    """`a` aged by b's new tokens, plus `b`: b is taken as the more recent history.

    Exactly: f = 0.5 ** (n_b / a.half_life_tokens) with n_b = b.tokens_decode, or
    b.tokens_prefill when b has no decode tokens; counts = a * f + b, tokens likewise.
    The result keeps a's half-life, the earlier `created`, and a's then b's sources.
    """
    if not (a.same_model(b.model) and b.same_model(a.model)):
        raise ProfileError(f"cannot merge profiles of different models: {_describe(a.model)} "
                           f"({a.fingerprint[:16]}) and {_describe(b.model)} ({b.fingerprint[:16]})")
    out = a.copy()
    out.add(b.prefill, b.decode, b.tokens_prefill, b.tokens_decode)
    rb = b.recent_trace()
    if rb is not None:  # b's steps are the more recent ones
        out.add_recent(rb)
    for s in b.sources:
        out._add_source(s)
    out.created = min(a.created, b.created)
    return out


def update_file(path: Path | str, model: Mapping[str, Any] | object,
                fn: Callable[[RoutingProfile], RoutingProfile | None]) -> RoutingProfile:
    """Lock, load (or start empty), apply `fn`, save atomically; returns the saved profile.

    A profile of another model or a corrupt one raises instead of being overwritten.
    """
    path = Path(path)
    with file_lock(path):
        p = RoutingProfile.load(path, expect=model) if path.exists() else RoutingProfile.empty(model)
        result = fn(p)
        p = p if result is None else result
        p._write(path)  # NOTE: the lock is already held; save() would wait on itself
    return p


def uniform(model: Mapping[str, Any] | object) -> RoutingProfile:
    return RoutingProfile.uniform(model)
