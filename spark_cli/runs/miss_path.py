"""The miss path of each cached layer: upload a missed expert and wait (`upload`), or compute
it on the CPU from the host weights while a background upload admits it (`cpu`). `auto`
measures both on this machine (blocking upload time and CPU time per missed expert, per
layer), picks the cheaper one for each layer, and keeps the measurement under SPARK_HOME
keyed by device and model, so later runs reuse it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from ..core.simulator import MISS_PATH_CHOICES, MISS_PATHS
from ..files.atomic import atomic_write_text
from ..errors import SparkError, UsageError

CALIB_VERSION = 2  # 2: measured at a thread count
CALIB_DECODE = 8  # decode tokens measured per miss path


@dataclass(frozen=True)
class LayerCost:
    """Critical-path microseconds per missed expert in one layer (None: no miss seen)."""

    upload_us: float | None
    cpu_us: float | None

    def choice(self) -> str:
        """The cheaper path; cpu (which never blocks on a copy) when a path saw no miss."""
        if self.cpu_us is None:
            return "upload" if self.upload_us is not None else "cpu"
        if self.upload_us is None:
            return "cpu"
        return "cpu" if self.cpu_us <= self.upload_us else "upload"


@dataclass(frozen=True)
class Calibration:
    device: str
    model_fingerprint: str
    layers: dict[int, LayerCost]
    cpu_threads: int  # the CPU miss path's threads when measured: its cost depends on them

    def choose(self) -> dict[int, str]:
        return {il: c.choice() for il, c in self.layers.items()}

    def why(self) -> str:
        """One line: what was chosen and the medians it was chosen from."""
        picks = self.choose()
        n_cpu = sum(1 for p in picks.values() if p == "cpu")
        up = sorted(c.upload_us for c in self.layers.values() if c.upload_us is not None)
        cpu = sorted(c.cpu_us for c in self.layers.values() if c.cpu_us is not None)
        med = lambda v: f"{v[len(v) // 2]:.0f} us" if v else "n/a"  # noqa: E731
        return (f"miss path auto: cpu on {n_cpu} of {len(picks)} cached layers, upload on {len(picks) - n_cpu} "
                f"(per missed expert: upload {med(up)}, CPU {med(cpu)} on {self.cpu_threads} "
                f"thread{'s' if self.cpu_threads != 1 else ''}; median over layers)")

    def to_dict(self) -> dict:
        return {"version": CALIB_VERSION, "device": self.device, "model_fingerprint": self.model_fingerprint,
                "cpu_threads": self.cpu_threads, "layers": {str(il): asdict(c) for il, c in self.layers.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> "Calibration":
        if d.get("version") != CALIB_VERSION:
            raise ValueError("calibration version")
        return cls(str(d["device"]), str(d["model_fingerprint"]),
                   {int(il): LayerCost(c.get("upload_us"), c.get("cpu_us")) for il, c in d["layers"].items()},
                   int(d["cpu_threads"]))


def check_choice(value: str, flag: str = "--miss-path") -> str:
    if value not in MISS_PATH_CHOICES:
        raise UsageError(f"{flag}: unknown miss path {value!r}", hint="use " + ", ".join(MISS_PATH_CHOICES))
    return value


def cache_file(home: Path, device: str, fingerprint: str, cpu_threads: int) -> Path:
    key = hashlib.sha1(f"{device}\n{fingerprint}\n{cpu_threads}".encode()).hexdigest()[:16]
    return home / "calibration" / f"miss-path-{key}.json"


def load_cached(path: Path, device: str, fingerprint: str, cpu_threads: int) -> Calibration | None:
    try:
        cal = Calibration.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return cal if (cal.device, cal.model_fingerprint, cal.cpu_threads) == (device, fingerprint, cpu_threads) else None


def save(path: Path, cal: Calibration) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(cal.to_dict(), indent=1) + "\n")


def measure(engine, prompt: Sequence[int], n_decode: int = CALIB_DECODE) -> dict[int, LayerCost]:
    """Decode n_decode greedy tokens after `prompt` once per miss path and read the native
    counters: blocking upload time per uploaded miss, CPU time per CPU-computed miss. Leaves
    the engine on the cpu path with its KV cache and counters reset."""
    from ..native.generate import StopRules

    per_path: dict[str, dict] = {}
    for path in MISS_PATHS:
        engine.set_miss_path(path)
        engine.reset()
        for _ in engine.stream_generate(list(prompt), max_tokens=n_decode, stop=StopRules(eog=False),
                                        on_prompt=lambda _: engine.reset_stats()):
            pass
        per_path[path] = engine.cache_stats()
    engine.reset()
    engine.reset_stats()
    out = {}
    cached = {c.il for c in engine.opts.cache_layers}
    for il, up in per_path["upload"].items():
        cpu = per_path["cpu"].get(il)
        if il not in cached:
            continue
        out[il] = LayerCost(up.upload_us / up.misses if up.misses else None,
                            cpu.cpu_us / cpu.cpu_experts if cpu is not None and cpu.cpu_experts else None)
    return out


CALIB_TEXT = ("Calibration text for the expert cache: it routes tokens through every layer so that "
              "missed experts can be timed on both paths. The quick brown fox jumps over the lazy dog.")


def resolve(engine, choice: str, fingerprint: str, home: Path) -> tuple[dict[int, str], str]:
    """Put every cached layer of `engine` on its miss path and say why. `auto` reuses the
    calibration cached for this device and model, or measures it (a few seconds) and caches it."""
    check_choice(choice)
    layers = [c.il for c in engine.opts.cache_layers]
    if not layers:
        return {}, ""
    if choice != "auto":
        picks = {il: choice for il in layers}
        engine.set_miss_path(picks)
        return picks, f"miss path {choice} on {len(layers)} cached layers"
    dev = engine.devices[0] if engine.devices else None
    device = f"{dev.name} {dev.description}" if dev else "CPU"
    threads = engine.cpu_threads  # calibration times decode steps
    path = cache_file(home, device, fingerprint, threads)
    cal = load_cached(path, device, fingerprint, threads)
    source = "cached calibration"
    if cal is None or set(cal.layers) != set(layers):
        measured = measure(engine, engine.tokenize(CALIB_TEXT))
        # NOTE: stats come back for every MoE layer (zeros where uncached): keep the cached ones
        cal = Calibration(device, fingerprint, {il: c for il, c in measured.items() if il in layers}, threads)
        source = "calibrated now"
        try:
            save(path, cal)
        except (OSError, SparkError):
            source += " (not saved)"
    picks = cal.choose()
    engine.set_miss_path(picks)
    return picks, f"{cal.why()}; {source}"
