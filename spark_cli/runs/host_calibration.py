"""This machine's CPU as Spark has calibrated it, for `spark plan --predict-for` (core/device_table.py):
the rate (GB/s) at which a missed expert's weights stream through the CPU's matmul, read from the
figures `spark bench` keeps under $SPARK_HOME/calibration (device-costs-*.json: the cost model's
CPU miss cost; else miss-path-*.json: the miss-path calibration's CPU cost per expert) and the
bytes of one expert of the model they were measured on (its GGUF under $SPARK_HOME/models, found by
fingerprint). The newest kept file whose model is found wins. None where nothing is kept."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from ..core.device_table import Host
from ..core.gguf_info import ModelGeometry, load_geometry


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
    moe = [l for l in g.layers if l.is_moe and not l.is_nextn]
    if layer is not None:
        moe = [l for l in moe if l.index == layer] or moe
    return statistics.fmean(l.expert_bytes_per_expert for l in moe) if moe else 0.0


def measured_host(home: Path) -> Host | None:
    """This CPU's measured expert rate as a device_table.Host (None: no usable calibration kept)."""
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
            return Host(cores=f.threads, measured_gb_s=gb_s,
                        measured_source=f"{f.path.name}: {f.cpu_us:.0f} us per {nbytes / 2**20:.1f} MiB expert of "
                                        f"{Path(g.path).name} on {f.threads} thread{'s' if f.threads != 1 else ''}")
    return None
