"""This machine's CPU as Spark has calibrated it, for `spark plan --predict-for` (core/device_table.py):
the rate (GB/s) at which a missed expert's weights stream through the CPU's matmul, read from the
figures `spark bench` keeps under $SPARK_HOME/calibration (device-costs-*.json: the cost model's
CPU miss cost; else miss-path-*.json: the miss-path calibration's CPU cost per expert) and the
bytes of one expert of the model they were measured on (its GGUF under $SPARK_HOME/models, found by
fingerprint). The newest kept file whose model is found wins. None where nothing is kept.

A prediction for another model whose experts are of other types (the demo's are Q4_1, a user's
Q4_K_M or IQ3_XXS) scales that rate by this CPU's ggml matmul rates of the two models' expert types
(native/cpu_matmul.py): the calibration says how fast this CPU's miss path runs, the types how much
work a byte of each model's experts is."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from ..core.device_table import Host
from ..core.gguf_info import ModelGeometry, load_geometry
from ..errors import NativeError
from ..native import cpu_matmul


@dataclass(frozen=True)
class CpuFigure:
    """One kept CPU figure: microseconds per missed expert on `threads` threads, on one model."""

    path: Path
    fingerprint: str
    threads: int
    cpu_us: float
    layer: int | None = None  # the layer the figure is for (None: a mean over the model's MoE layers)


def _read(path: Path) -> CpuFigure | None:
    """A kept file's CPU figure (None: not readable, or no CPU cost in it)."""
    try:
        d = json.loads(path.read_text())
        if path.name.startswith("device-costs-"):
            c = d["costs"]
            fig = CpuFigure(path, str(d["fingerprint"]), int(c["threads"]), float(c["miss_cpu_us"]))
        else:
            costs = {int(il): float(v["cpu_us"]) for il, v in d["layers"].items() if v.get("cpu_us")}
            il = sorted(costs, key=costs.get)[len(costs) // 2]  # the median layer
            fig = CpuFigure(path, str(d["model_fingerprint"]), int(d["cpu_threads"]), costs[il], il)
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None
    return fig if fig.cpu_us > 0 and fig.threads > 0 else None


def _models(home: Path) -> dict[str, ModelGeometry]:
    """The GGUF headers under $SPARK_HOME/models, by fingerprint (unreadable ones skipped)."""
    out = {}
    for p in sorted((home / "models").glob("**/*.gguf")):
        try:
            g = load_geometry(p)
        except Exception:  # noqa: BLE001 - a file that is not a readable GGUF is not a candidate
            continue
        out.setdefault(g.fingerprint, g)
    return out


def _expert_bytes(g: ModelGeometry, layer: int | None) -> float:
    return sum(expert_mix(g, layer).values())


def _moe_layers(g: ModelGeometry, layer: int | None):
    moe = [l for l in g.layers if l.is_moe and not l.is_nextn]
    if layer is not None:
        moe = [l for l in moe if l.index == layer] or moe
    return moe


def expert_mix(g: ModelGeometry, layer: int | None = None) -> dict[str, float]:
    """Bytes of one expert by ggml type: the mean over the model's MoE layers (or `layer`'s)."""
    moe = _moe_layers(g, layer)
    mix: dict[str, float] = {}
    for l in moe:
        for t in l.experts:
            mix[t.ggml_type] = mix.get(t.ggml_type, 0.0) + t.bytes_per_expert / len(moe)
    return mix


def same_types(a: dict[str, float], b: dict[str, float], tolerance: float = 0.02) -> bool:
    """Whether two models' experts are the same work a byte: the same types in the same shares."""
    ta, tb = sum(a.values()), sum(b.values())
    return set(a) == set(b) and all(abs(a[t] / ta - b[t] / tb) <= tolerance for t in a)


def type_scale(calibrated: dict[str, float], target: dict[str, float], threads: int,
               rate: cpu_matmul.RateFn = cpu_matmul.expert_rate) -> float | None:
    """How much faster this CPU streams `target`'s experts than `calibrated`'s, a byte for a byte
    (None: a type ggml could not time)."""
    a = cpu_matmul.mix_rate(calibrated, threads, rate)
    b = cpu_matmul.mix_rate(target, threads, rate)
    return b / a if a and b else None


def _types(mix: dict[str, float]) -> str:
    return "/".join(sorted(mix, key=mix.get, reverse=True))


def measured_host(home: Path, target: ModelGeometry | None = None,
                  rate: cpu_matmul.RateFn = cpu_matmul.expert_rate) -> Host | None:
    """This CPU's measured expert rate as a device_table.Host, for `target`'s experts where given
    (None: no usable calibration kept)."""
    cal = home / "calibration"
    files = sorted((p for pat in ("device-costs-*.json", "miss-path-*.json") for p in cal.glob(pat)),
                   key=lambda p: p.stat().st_mtime, reverse=True) if cal.is_dir() else []
    figs = [f for f in map(_read, files) if f is not None]
    if not figs:
        return None
    models = _models(home)
    for f in figs:
        g = models.get(f.fingerprint)
        nbytes = _expert_bytes(g, f.layer) if g is not None else 0.0
        if nbytes > 0:
            gb_s = nbytes / f.cpu_us / 1e3
            source = (f"{f.path.name}: {f.cpu_us:.0f} us per {nbytes / 2**20:.1f} MiB expert of "
                      f"{Path(g.path).name} on {f.threads} thread{'s' if f.threads != 1 else ''}")
            mix, target_mix = expert_mix(g, f.layer), expert_mix(target) if target is not None else {}
            if target_mix and not same_types(mix, target_mix):
                gb_s, source = _for_target(gb_s, source, mix, target_mix, f.threads, rate)
            return Host(cores=f.threads, measured_gb_s=gb_s, measured_source=source)
    return None


def _for_target(gb_s: float, source: str, calibrated: dict[str, float], target: dict[str, float], threads: int,
                rate: cpu_matmul.RateFn) -> tuple[float, str]:
    """The calibrated rate carried over to the target's expert types, and what was done."""
    try:
        scale = type_scale(calibrated, target, threads, rate)
    except NativeError as e:
        return gb_s, f"{source}; not scaled to this model's {_types(target)} experts ({e})"
    if scale is None:
        return gb_s, f"{source}; not scaled to this model's {_types(target)} experts (a type ggml cannot time)"
    return gb_s * scale, (f"{source}, x{scale:.2f} for this model's {_types(target)} experts over its "
                          f"{_types(calibrated)} (this CPU's ggml mul_mat_id by type)")
