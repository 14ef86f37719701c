"""The miss path of each cached layer: upload a missed expert and wait (`upload`), compute it on
the CPU from the host weights while a background upload admits it (`cpu`), or decide per expert
in every step (`auto`): the misses with most tokens are uploaded into staging slices for that
step while that ends it sooner, the rest run on the CPU (admitted as on the cpu path). `layer`
is the rule before issue 25, kept to compare against: the cheaper of cpu and upload per layer,
once. auto and layer calibrate on this machine (blocking upload time per missed expert; CPU time
per missed expert at decode and per token in a prompt step, per layer) and keep the measurement
under SPARK_HOME keyed by device, model and thread count, so later runs reuse it."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from ..core.simulator import FIXED_MISS_PATHS, MissCosts, MissPath
from ..files.atomic import atomic_write_text
from ..errors import SparkError

if TYPE_CHECKING:
    from ..native.expert_cache import CacheStats

CALIB_VERSION = 4  # 2: measured at a thread count; 3: the CPU cost per token of a prompt step; 4: pooled per shape
CALIB_DECODE = 8  # decode tokens measured per miss path


@dataclass(frozen=True)
class LayerCost:
    """Critical-path microseconds per missed expert in one layer (None: no miss seen): uploading it
    and waiting, computing it on the CPU in a decode step (one token), and the CPU cost's part
    that grows per token (from a prompt step; None: not measured, all of it per token)."""

    upload_us: float | None
    cpu_us: float | None
    cpu_token_us: float | None = None

    def costs(self) -> MissCosts:
        """The auto path's integer costs: CPU (a per-expert part and a per-token part, together
        cpu_us for one token) and upload; a side never measured is never chosen."""
        if self.cpu_us is None or self.upload_us is None:
            return MissCosts()  # no CPU cost: nothing is ever staged (the cpu path)
        per_token = self.cpu_us if self.cpu_token_us is None else min(max(self.cpu_token_us, 0.0), self.cpu_us)
        return MissCosts(cpu_ns=round(per_token * 1000), upload_ns=round(self.upload_us * 1000),
                         cpu_expert_ns=round((self.cpu_us - per_token) * 1000))

    def choice(self) -> MissPath:
        """The cheaper path; cpu (which never blocks on a copy) when a path saw no miss."""
        if self.cpu_us is None:
            return MissPath.UPLOAD if self.upload_us is not None else MissPath.CPU
        if self.upload_us is None:
            return MissPath.CPU
        return MissPath.CPU if self.cpu_us <= self.upload_us else MissPath.UPLOAD


@dataclass(frozen=True)
class Calibration:
    device: str
    model_fingerprint: str
    layers: dict[int, LayerCost]
    cpu_threads: int  # the CPU miss path's threads when measured: its cost depends on them

    def choose(self) -> dict[int, MissPath]:
        return {il: c.choice() for il, c in self.layers.items()}

    def costs(self) -> dict[int, MissCosts]:
        return {il: c.costs() for il, c in self.layers.items()}

    def median(self, field: str) -> float | None:
        """The median over layers of one LayerCost field in us (None when no layer measured it)."""
        v = sorted(x for c in self.layers.values() if (x := getattr(c, field)) is not None)
        return float(v[len(v) // 2]) if v else None

    def _median(self, field: str) -> str:
        v = self.median(field)
        return f"{v:.0f} us" if v is not None else "n/a"

    def _threads(self) -> str:
        return f"{self.cpu_threads} thread{'s' if self.cpu_threads != 1 else ''}"

    def why_auto(self) -> str:
        """One line: the per-expert rule and the medians of its costs."""
        return (f"miss path auto: per expert and step on {len(self.layers)} cached layers (per missed expert: "
                f"upload {self._median('upload_us')}, CPU {self._median('cpu_us')} at decode, "
                f"{self._median('cpu_token_us')} more per token, on {self._threads()}; median over layers)")

    def why(self) -> str:
        """One line: what was chosen and the medians it was chosen from."""
        picks = self.choose()
        n_cpu = sum(1 for p in picks.values() if p == "cpu")
        return (f"miss path layer: cpu on {n_cpu} of {len(picks)} cached layers, upload on {len(picks) - n_cpu} "
                f"(per missed expert: upload {self._median('upload_us')}, CPU {self._median('cpu_us')} on "
                f"{self._threads()}; median over layers)")

    def to_dict(self) -> dict:
        return {"version": CALIB_VERSION, "device": self.device, "model_fingerprint": self.model_fingerprint,
                "cpu_threads": self.cpu_threads, "layers": {str(il): asdict(c) for il, c in self.layers.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> "Calibration":
        if d.get("version") != CALIB_VERSION:
            raise ValueError("calibration version")
        return cls(str(d["device"]), str(d["model_fingerprint"]),
                   {int(il): LayerCost(c.get("upload_us"), c.get("cpu_us"), c.get("cpu_token_us"))
                    for il, c in d["layers"].items()},
                   int(d["cpu_threads"]))


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
    counters (blocking upload time per uploaded miss; CPU time per CPU-computed miss in decode
    steps; on the cpu path the prompt step's CPU time, experts and tokens), then price every
    cached layer from its expert shape's pooled figures (`pooled_costs`). Leaves the engine on
    the cpu path with its KV cache and counters reset."""
    from ..native.generate import StopRules

    per_path: dict[str, dict] = {}
    prompt_cpu: dict = {}
    for path in FIXED_MISS_PATHS:
        engine.cache.set_miss_path(path)
        engine.reset()
        engine.reset_stats()

        def prompt_done(_, path: str = path) -> None:
            if path == "cpu":
                prompt_cpu.update(engine.cache.stats())
            engine.reset_stats()

        for _ in engine.stream_generate(list(prompt), max_tokens=n_decode, stop=StopRules(eog=False),
                                        on_prompt=prompt_done):
            pass
        per_path[path] = engine.cache.stats()
    engine.reset()
    engine.reset_stats()
    cached = sorted(c.il for c in engine.opts.cache_layers)
    return pooled_costs({il: LayerSample(per_path["upload"].get(il), per_path["cpu"].get(il), prompt_cpu.get(il))
                         for il in cached})


@dataclass(frozen=True)
class LayerSample:
    """One cached layer's calibration counters (None: the layer reported none): the upload path's
    decode steps, the cpu path's decode steps and the cpu path's prompt step."""

    upload: "CacheStats | None"
    cpu: "CacheStats | None"
    prompt: "CacheStats | None"

    def expert_bytes(self) -> int | None:
        """Bytes of one of the layer's experts: its shape, which its costs depend on."""
        if self.upload is not None and self.upload.misses and self.upload.blocking_upload_bytes:
            return self.upload.blocking_upload_bytes // self.upload.misses
        for s in (self.cpu, self.prompt):
            if s is not None and s.cpu_experts and s.cpu_expert_bytes:
                return s.cpu_expert_bytes // s.cpu_experts
        return None


def pooled_costs(samples: dict[int, LayerSample]) -> dict[int, LayerCost]:
    """Every layer's costs from the sums over the cached layers of its expert shape (same bytes
    per expert: the same kernels and copies), not from its own few steps: a layer sees one or
    two misses a decode step, and timing noise of one step would decide its split (a per-token
    CPU cost measured as 0 stages nothing in a prompt). A layer that saw no miss on either path
    (shape unknown) gets no costs: it stays on the CPU side, as a side never measured does."""
    by_shape: dict[int | None, list[LayerSample]] = {}
    for s in samples.values():
        by_shape.setdefault(s.expert_bytes(), []).append(s)
    shape_cost = {nb: _shape_cost(group) for nb, group in by_shape.items() if nb is not None}
    out = {}
    for il, s in samples.items():
        nb = s.expert_bytes()
        out[il] = shape_cost[nb] if nb is not None else LayerCost(None, None)
    return out


def _shape_cost(group: list[LayerSample]) -> LayerCost:
    """One expert shape's costs from its layers' summed counters."""
    up_us = sum(s.upload.upload_us for s in group if s.upload is not None)
    up_n = sum(s.upload.misses for s in group if s.upload is not None)
    cpu_us = sum(s.cpu.cpu_us for s in group if s.cpu is not None)
    cpu_n = sum(s.cpu.cpu_experts for s in group if s.cpu is not None)
    decode = cpu_us / cpu_n if cpu_n else None
    prompts = [s.prompt for s in group if s.prompt is not None]
    prompt = PromptSum(sum(p.cpu_us for p in prompts), sum(p.cpu_experts for p in prompts),
                       sum(p.cpu_entries for p in prompts)) if prompts else None
    return LayerCost(up_us / up_n if up_n else None, decode, per_token_us(decode, prompt))


@dataclass(frozen=True)
class PromptSum:
    """A prompt step's CPU counters summed over layers (what per_token_us reads)."""

    cpu_us: float
    cpu_experts: int
    cpu_entries: int


def per_token_us(decode_us: float | None, p) -> float | None:
    """The part of a missed expert's CPU time that grows per token: with d (one token, a decode
    step) = a + b and a prompt step's experts E, tokens T and time U = a E + b T, b = (U - a E) / T;
    None when the prompt step computed no expert with more than one token."""
    if decode_us is None or p is None or not p.cpu_experts or p.cpu_entries <= p.cpu_experts:
        return None
    a = (decode_us * p.cpu_entries - p.cpu_us) / (p.cpu_entries - p.cpu_experts)
    a = min(max(a, 0.0), decode_us)
    return decode_us - a


CALIB_TEXT = ("Calibration text for the expert cache: it routes tokens through every layer so that "
              "missed experts can be timed on both paths. The quick brown fox jumps over the lazy dog.")


def initial_path(choice: MissPath) -> MissPath:
    """The miss path a cache starts on before `resolve` (auto and layer calibrate from cpu)."""
    return MissPath.CPU if choice in (MissPath.AUTO, MissPath.LAYER) else choice


def resolve(engine, choice: MissPath, fingerprint: str, home: Path) -> tuple[dict[int, MissPath], str]:
    """Put every cached layer of `engine` on its miss path and say why. `auto` and `layer` reuse
    the calibration cached for this device, model and thread count, or measure it (a few seconds)
    and cache it; auto hands its costs to each layer, layer picks the cheaper fixed path."""
    layers = [c.il for c in engine.opts.cache_layers]
    if not layers:
        return {}, ""
    if choice in FIXED_MISS_PATHS:
        picks = {il: choice for il in layers}
        engine.cache.set_miss_path(picks)
        return picks, f"miss path {choice} on {len(layers)} cached layers"
    cal, source = calibration(engine, fingerprint, home, layers)
    if choice == MissPath.LAYER:
        picks = cal.choose()
        engine.cache.set_miss_path(picks)
        return picks, f"{cal.why()}; {source}"
    picks = {il: MissPath.AUTO for il in layers}
    engine.cache.set_miss_costs(cal.costs())
    engine.cache.set_miss_path(picks)
    return picks, f"{cal.why_auto()}; {source}"


def device_key(dev) -> str:
    """The device a calibration belongs to: its name and description, less an RPC server's port
    (`--rpc auto` starts the stand-in on a new port each run: the same device)."""
    desc = re.sub(r":\d+$", "", dev.description) if dev.name.startswith("RPC") else dev.description
    return f"{dev.name} {desc}"


def calibration(engine, fingerprint: str, home: Path, layers: list[int]) -> tuple[Calibration, str]:
    """The calibration cached for this device, model and thread count, or a new one (saved)."""
    device = device_key(engine.devices[0]) if engine.devices else "CPU"
    threads = engine.cpu_threads  # calibration times decode steps
    path = cache_file(home, device, fingerprint, threads)
    cal = load_cached(path, device, fingerprint, threads)
    source = "cached calibration"
    if cal is None or set(cal.layers) != set(layers):
        measured = measure(engine, engine.vocab.tokenize(CALIB_TEXT))
        engine.restart_cache()  # NOTE: a run that calibrates starts from the slots a cached calibration's run has
        # NOTE: stats come back for every MoE layer (zeros where uncached): keep the cached ones
        cal = Calibration(device, fingerprint, {il: c for il, c in measured.items() if il in layers}, threads)
        source = "calibrated now"
        try:
            save(path, cal)
        except (OSError, SparkError):
            source += " (not saved)"
    return cal, source
