"""Routing traces: the expert ids of every step, kept to replay through cache policies.

File format (`.npz`, written atomically, read with `allow_pickle=False`):

- `ids`          int16  [n_rows, n_layer, k]  expert ids per token row; -1 for non-MoE layers
- `phase`        uint8  [n_rows]              0 prefill, 1 decode
- `step`         int32  [n_rows]              rows of one ubatch share it; non-decreasing
- `n_expert`     int64  scalar
- `fingerprint`  str    scalar                model identity (see gguf_info)
- `format`       str    "spark-trace", `version` int64 = 1
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from ..files.atomic import atomic_write_with
from ..files.regular import not_a_file
from ..errors import ProfileError

TRACE_FORMAT = "spark-trace"
TRACE_VERSION = 1
PREFILL, DECODE = 0, 1
_PHASES = {"prefill": PREFILL, "decode": DECODE, PREFILL: PREFILL, DECODE: DECODE}


def phase_code(phase: int | str) -> int:
    """0/1 or "prefill"/"decode" -> 0/1."""
    try:
        return _PHASES[phase]
    except (KeyError, TypeError):
        raise ProfileError(f"unknown phase {phase!r}: expected 'prefill' or 'decode'") from None


def _integers(name: str, a: np.ndarray, lo: int, hi: int) -> str | None:
    """A problem when `a` is not integers within [lo, hi] (checked before a cast could wrap them)."""
    if not a.size:
        return None
    if a.dtype.kind not in "iubf" or a.dtype.kind == "f" and not np.all(np.isfinite(a) & (a == np.round(a))):
        return f"{name}: dtype {a.dtype}, expected integers"
    if a.size and (int(a.min()) < lo or int(a.max()) > hi):
        return f"{name}: values outside [{lo}, {hi}] (min {int(a.min())}, max {int(a.max())})"
    return None


def _raw_problem(ids, phase, step, n_expert) -> str | None:
    n = np.asarray(n_expert)
    if n.ndim != 0 or n.dtype.kind not in "iu":
        return f"n_expert: expected one integer, got {n.dtype} of shape {list(n.shape)}"
    if not 1 <= int(n) <= np.iinfo(np.int16).max:
        return f"n_expert: {int(n)} is outside [1, {np.iinfo(np.int16).max}]"
    ids = np.asarray(ids)
    if ids.ndim == 3 and ids.shape[2] == 0:
        return "ids: k = 0 (a token routes to at least one expert)"
    return (_integers("ids", ids, -1, int(n) - 1) or _integers("phase", np.asarray(phase), PREFILL, DECODE)
            or _integers("step", np.asarray(step), np.iinfo(np.int32).min, np.iinfo(np.int32).max))


@dataclass
class RoutingTrace:
    ids: np.ndarray  # int16 [n_rows, n_layer, k], -1 where the layer is not MoE
    phase: np.ndarray  # uint8 [n_rows]
    step: np.ndarray  # int32 [n_rows]
    n_expert: int
    fingerprint: str

    def __post_init__(self) -> None:
        problem = _raw_problem(self.ids, self.phase, self.step, self.n_expert)
        if problem:
            raise ProfileError(f"invalid routing trace: {problem}")
        self.ids = np.asarray(self.ids, dtype=np.int16)
        self.phase = np.asarray(self.phase, dtype=np.uint8)
        self.step = np.asarray(self.step, dtype=np.int32)
        self.n_expert = int(self.n_expert)
        self.fingerprint = str(self.fingerprint)
        problem = self._problem()
        if problem:
            raise ProfileError(f"invalid routing trace: {problem}")

    def _problem(self) -> str | None:
        if self.ids.ndim != 3:
            return f"ids has shape {self.ids.shape}, expected [n_rows, n_layer, k]"
        n = self.ids.shape[0]
        if self.phase.shape != (n,) or self.step.shape != (n,):
            return f"phase {self.phase.shape} and step {self.step.shape} must be [{n}]"
        if n and np.any(np.diff(self.step) < 0):
            return "step numbers decrease"
        if self.ids.size and (self.ids.min() < -1 or self.ids.max() >= self.n_expert):
            return f"expert ids outside [0, {self.n_expert})"
        if n and self.phase.max() > DECODE:
            return "phase values other than 0 (prefill) and 1 (decode)"
        return None

    @property
    def n_rows(self) -> int:
        return int(self.ids.shape[0])

    @property
    def n_layer(self) -> int:
        return int(self.ids.shape[1])

    @property
    def k(self) -> int:
        return int(self.ids.shape[2])

    @property
    def n_decode(self) -> int:
        return int(np.count_nonzero(self.phase == DECODE))

    def moe_layers(self) -> list[int]:
        """Layers that routed at least one token."""
        if self.n_rows == 0:
            return []
        return [int(i) for i in np.flatnonzero((self.ids[:, :, 0] >= 0).any(axis=0))]

    def step_bounds(self) -> np.ndarray:
        """[n_steps + 1] row offsets; step i covers rows bounds[i]:bounds[i+1]."""
        if self.n_rows == 0:
            return np.zeros(1, dtype=np.int64)
        starts = np.flatnonzero(np.diff(self.step) != 0) + 1
        return np.concatenate(([0], starts, [self.n_rows])).astype(np.int64)

    def steps(self, layer: int) -> Iterator[tuple[int, np.ndarray]]:
        """Yield (phase, ids [n_tokens, k]) per step of `layer`, in order."""
        b = self.step_bounds()
        col = self.ids[:, layer, :]
        for lo, hi in zip(b[:-1], b[1:]):
            yield int(self.phase[lo]), col[lo:hi]

    def counts(self, phase: int | str | None = None) -> np.ndarray:
        """Routed (token, slot) occurrences per expert: float64 [n_layer, n_expert]."""
        rows = self.ids if phase is None else self.ids[self.phase == phase_code(phase)]
        out = np.zeros((self.n_layer, self.n_expert), dtype=np.float64)
        for layer in range(self.n_layer):
            col = rows[:, layer, :].ravel()
            col = col[col >= 0]
            out[layer] = np.bincount(col, minlength=self.n_expert)[: self.n_expert]
        return out

    def decode_steps(self) -> "RoutingTrace":
        """Only the one-token decode steps (what a profile's ring of recent steps keeps)."""
        b = self.step_bounds()
        one = np.flatnonzero((np.diff(b) == 1) & (self.phase[b[:-1]] == DECODE)) if self.n_rows else []
        rows = b[:-1][one] if len(one) else np.zeros(0, dtype=np.int64)
        return RoutingTrace(self.ids[rows], self.phase[rows], self.step[rows], self.n_expert, self.fingerprint)

    def rows(self, lo: int, hi: int) -> "RoutingTrace":
        return RoutingTrace(self.ids[lo:hi], self.phase[lo:hi], self.step[lo:hi],
                            self.n_expert, self.fingerprint)

    def split(self, frac: float) -> tuple["RoutingTrace", "RoutingTrace"]:
        """(train, test): cut at the first step boundary at or after `frac * n_rows`."""
        if not 0.0 <= frac <= 1.0:
            raise ProfileError(f"split fraction {frac} outside [0, 1]")
        b = self.step_bounds()
        cut = int(b[np.searchsorted(b, frac * self.n_rows, side="left")])
        return self.rows(0, cut), self.rows(cut, self.n_rows)

    def save(self, path: Path | str, flag: str | None = None) -> Path:
        def write(f: object) -> None:
            np.savez(f, ids=self.ids, phase=self.phase, step=self.step,
                     n_expert=np.int64(self.n_expert), fingerprint=np.str_(self.fingerprint),
                     format=np.str_(TRACE_FORMAT), version=np.int64(TRACE_VERSION))

        return atomic_write_with(path, write, flag)

    @classmethod
    def load(cls, path: Path | str, expect_fingerprint: str | None = None,
             expect_shape: tuple[int, int] | None = None) -> "RoutingTrace":
        path = Path(path)
        why = not_a_file(path)
        if why is not None:
            raise ProfileError(f"trace {path} not found" if why == "no such file" else f"trace {path}: {why}")
        try:
            with np.load(path, allow_pickle=False) as z:
                missing = [key for key in ("ids", "phase", "step", "n_expert", "fingerprint")
                           if key not in z.files]
                if missing:
                    raise ProfileError(f"trace {path} is not a Spark trace: lacks {', '.join(missing)}")
                if "format" in z.files and str(z["format"]) != TRACE_FORMAT:
                    raise ProfileError(f"trace {path} is not a Spark trace: format {z['format']}")
                if "version" in z.files and int(z["version"]) != TRACE_VERSION:
                    raise ProfileError(f"trace {path} has format version {int(z['version'])}; "
                                       f"this Spark reads version {TRACE_VERSION}")
                ids, phase, step = z["ids"], z["phase"], z["step"]
                n_expert, fingerprint = z["n_expert"], str(z["fingerprint"])
        except ProfileError:
            raise
        except (OSError, ValueError, zipfile.BadZipFile, EOFError, KeyError) as e:
            why = f"{type(e).__name__}: {e}".splitlines()[0]
            raise ProfileError(f"trace {path} is unreadable: {why}") from None
        try:
            trace = cls(ids, phase, step, n_expert, fingerprint)
        except ProfileError as e:
            raise ProfileError(f"trace {path} is corrupt: {e.message}") from None
        if expect_fingerprint is not None and fingerprint != expect_fingerprint:
            raise ProfileError(
                f"trace {path} is a trace of another model (fingerprint {fingerprint[:16]}, "
                f"expected {expect_fingerprint[:16]})")
        if expect_shape is not None and (trace.n_layer, trace.n_expert) != tuple(expect_shape):
            raise ProfileError(f"trace {path} has {trace.n_layer} layers x {trace.n_expert} experts; "
                               f"the model has {expect_shape[0]} x {expect_shape[1]}",
                               hint="record the trace again with spark profile --trace")
        return trace


def concat(traces: Sequence[RoutingTrace]) -> RoutingTrace:
    """Join traces of one model; later steps are renumbered to follow earlier ones."""
    if not traces:
        raise ProfileError("cannot concatenate zero traces")
    first = traces[0]
    for t in traces[1:]:
        if t.fingerprint != first.fingerprint:
            raise ProfileError("cannot concatenate a trace of another model")
        if (t.n_expert, t.n_layer, t.k) != (first.n_expert, first.n_layer, first.k):
            raise ProfileError("cannot concatenate traces of different shapes")
    steps, offset = [], 0
    for t in traces:
        if t.n_rows:
            s = t.step.astype(np.int64) - int(t.step[0]) + offset
            steps.append(s)
            offset = int(s[-1]) + 1
    step = np.concatenate(steps) if steps else np.zeros(0, dtype=np.int64)
    if step.size and step[-1] > np.iinfo(np.int32).max:
        raise ProfileError("concatenated trace has more steps than int32 holds")
    return RoutingTrace(np.concatenate([t.ids for t in traces]),
                        np.concatenate([t.phase for t in traces]), step.astype(np.int32),
                        first.n_expert, first.fingerprint)


class TraceBuilder:
    """Collects (layer, n_tokens, k, phase, ids) records as the engine reports them.

    Records of one ubatch arrive layer by layer; a layer seen again starts a new step.
    """

    def __init__(self, n_layer: int, k: int, n_expert: int, fingerprint: str):
        self.n_layer, self.k, self.n_expert, self.fingerprint = n_layer, k, n_expert, fingerprint
        self._ids: list[np.ndarray] = []
        self._phase: list[int] = []
        self._ntok: list[int] = []
        self._layers: set[int] = set()  # layers already filled in the open step

    def add(self, layer: int, n_tokens: int, k: int, phase: int | str, ids: object) -> None:
        if not 0 <= layer < self.n_layer:
            raise ProfileError(f"trace record for layer {layer}; model has {self.n_layer}")
        if k != self.k:
            raise ProfileError(f"trace record with k={k}; trace has k={self.k}")
        arr = np.asarray(ids, dtype=np.int64).reshape(n_tokens, k)
        if arr.size and (arr.min() < 0 or arr.max() >= self.n_expert):
            raise ProfileError(f"trace record for layer {layer} routes outside [0, {self.n_expert})")
        p = phase_code(phase)
        if not self._ids or layer in self._layers:
            self._ids.append(np.full((n_tokens, self.n_layer, k), -1, dtype=np.int16))
            self._phase.append(p)
            self._ntok.append(n_tokens)
            self._layers = set()
        elif n_tokens > self._ntok[-1] or p != self._phase[-1]:
            raise ProfileError(f"trace record for layer {layer} has {n_tokens} tokens ({phase}) "
                               f"inside a step of {self._ntok[-1]} tokens")
        # NOTE: llama.cpp runs the last layer on the output rows only: they fill the first rows
        self._ids[-1][:n_tokens, layer, :] = arr
        self._layers.add(layer)

    def __len__(self) -> int:
        return len(self._ids)

    def build(self) -> RoutingTrace:
        if not self._ids:
            ids = np.zeros((0, self.n_layer, self.k), dtype=np.int16)
            return RoutingTrace(ids, np.zeros(0), np.zeros(0), self.n_expert, self.fingerprint)
        ntok = np.asarray(self._ntok)
        return RoutingTrace(np.concatenate(self._ids),
                            np.repeat(np.asarray(self._phase, dtype=np.uint8), ntok),
                            np.repeat(np.arange(len(ntok), dtype=np.int32), ntok),
                            self.n_expert, self.fingerprint)
