"""Published figures of cards that are not at hand (data/device_profiles.toml), turned into the cost
model's figures for one model (`spark plan --predict-for NAME`). A prediction, not a measurement:
memory bandwidths are the vendors', the efficiencies and per-layer overhead below are assumptions
(stated in the output), and prompt speed is not predicted (it is compute-bound: `spark bench`
measures it on the card)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from importlib import resources

from ..errors import UsageError
from .cost_model import DeviceCosts
from .gguf_info import ModelGeometry

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib  # type: ignore[no-redef]

PCIE_GB_S_PER_LANE = {3: 0.985, 4: 1.969, 5: 3.938}  # one direction, after encoding
LINK_EFFICIENCY = 0.8  # share of the link a pinned upload gets
DEVICE_EFFICIENCY = 0.7  # share of the memory bandwidth a decode step's matmuls get
HOST_EFFICIENCY = 0.6  # share of the host's memory bandwidth the CPU's matmuls get
HOST_GB_S_PER_CORE = 12.0  # what one core's matmul streams at most
LAYER_US = 40.0  # kernel launches and small ops per layer and decode token (an assumption)
DEFAULT_HOST_GB_S = 60.0  # dual-channel DDR5
ASSUMPTIONS = (f"device matmuls at {DEVICE_EFFICIENCY:.0%} of the memory bandwidth, the CPU's at "
               f"{HOST_EFFICIENCY:.0%} of the host's (at most {HOST_GB_S_PER_CORE:g} GB/s a core), uploads at "
               f"{LINK_EFFICIENCY:.0%} of the link, {LAYER_US:g} us per layer and token besides")


@dataclass(frozen=True)
class Card:
    key: str  # --predict-for's name
    name: str
    vram_gib: float
    memory_gb_s: float
    link_gb_s: float  # host -> device, one direction, the link's figure
    stop_us: float
    second_queue: bool = True  # uploads run beside compute (CUDA, ROCm, Vulkan; not over RPC)

    def describe(self) -> str:
        return f"{self.name} ({self.vram_gib:g} GiB, {self.memory_gb_s:g} GB/s, link {self.link_gb_s:.1f} GB/s)"


def _link(d: dict, key: str) -> float:
    if "link_gb_s" in d:
        return float(d["link_gb_s"])
    gen, lanes = int(d["pcie_gen"]), int(d["pcie_lanes"])
    if gen not in PCIE_GB_S_PER_LANE:
        raise ValueError(f"device_profiles.toml: cards.{key}.pcie_gen: {gen} is not one of 3, 4, 5")
    return PCIE_GB_S_PER_LANE[gen] * lanes


def cards() -> dict[str, Card]:
    """Every card of the bundled table, by --predict-for name."""
    doc = tomllib.loads(resources.files("spark_cli").joinpath("data/device_profiles.toml").read_text())
    return {k: Card(k, str(d["name"]), float(d["vram_gib"]), float(d["memory_gb_s"]), _link(d, k), float(d["stop_us"]),
                    bool(d.get("second_queue", True)))
            for k, d in doc["cards"].items()}


def card(name: str) -> Card:
    table = cards()
    if name not in table:
        raise UsageError(f"--predict-for: unknown card {name!r}", hint="one of " + ", ".join(table))
    return table[name]


def host_bandwidth(host_gb_s: float, host_cores: int) -> float:
    """GB/s the CPU's expert matmuls stream at: a share of the memory's, capped by the cores."""
    return min(host_gb_s * HOST_EFFICIENCY, host_cores * HOST_GB_S_PER_CORE)


def predicted_costs(c: Card, g: ModelGeometry, host_gb_s: float = DEFAULT_HOST_GB_S, host_cores: int = 8) -> DeviceCosts:
    """The cost model's decode figures for `g` on card `c` with this host (prompt: not predicted)."""
    moe = [l for l in g.layers if l.is_moe and not l.is_nextn]
    bpe = sum(l.expert_bytes_per_expert for l in moe) / max(len(moe), 1)  # bytes of one expert, mean
    k = g.n_expert_used
    dev = c.memory_gb_s * DEVICE_EFFICIENCY * 1e3  # bytes per us
    host = host_bandwidth(host_gb_s, host_cores) * 1e3
    link = c.link_gb_s * LINK_EFFICIENCY * 1e3
    nonexpert = g.device_global_bytes + sum(l.nonexpert_bytes for l in g.layers if not l.is_nextn)
    loaded = sum(1 for l in g.layers if not l.is_nextn)
    base = (nonexpert + len(moe) * k * bpe) / dev + loaded * LAYER_US + c.stop_us  # the logits read-back
    host_layer = c.stop_us + k * bpe / host - k * bpe / dev
    return DeviceCosts(device=c.name, source=f"published figures: {c.describe()}; host {host_gb_s:g} GB/s, "
                       f"{host_cores} cores; {ASSUMPTIONS}", threads=0, base_tg_us=base, base_pp_us=0.0,
                       stop_us=c.stop_us, host_tg_us=max(host_layer, 0.0), host_pp_us=0.0, cached_pp_us=0.0,
                       miss_cpu_us=bpe / host, miss_upload_us=bpe / link, concurrent=c.second_queue,
                       predicted=True)
