"""A card that is not at hand, priced for one model (`spark plan --predict-for NAME`): the card's
published figures (data/device_profiles.toml), constants fitted to public llama.cpp measurements
(data/public_measurements.toml) and, where Spark has calibrated this machine's CPU, the host's
measured expert rate, turned into the cost model's figures (core/cost_model.py prices the plan).

The model, per token of a model whose decode reads `device_bytes` (non-expert weights and k routed
experts per MoE layer) through `layers` blocks, on a card of bandwidth B GB/s and F FP32 TFLOPS:

    decode, all on the card  = device_bytes / (B * efficiency) + stop
                               + (layers * layer_us + moe_layers * moe_layer_us + recurrent_layers * recurrent_layer_us)
                                 * layer_scale
    layer_scale              = (REF_GB_S / B) ** layer_scaling on a GDDR card, 1 on an HBM card
    a host layer adds        = stop + host_layer_us + k * expert / host_rate - k * expert / (B * efficiency)
    prompt, all on the card  = (prompt_params + moe_layers * (prompt_moe_params + idle_tile_params))
                               / (F * share * prompt_params_per_tflop_us)
    idle_tile_params         = k * expert_params * max(0, prompt_tile_tokens / (ubatch * k / n_expert) - 1)
    a host layer adds (prompt) = its experts uploaded over the link once per ubatch (-ub, default 512 tokens)

- efficiency: the share of the bandwidth a decode token's weight reads get: device_efficiency, times
  rocm_bandwidth_share on AMD's ROCm backend (a figure measured there), times hbm_bandwidth_share on
  an HBM card (the data-centre parts: llama.cpp's decode kernels read their 2-5 TB/s memory at about
  half the rate they read GDDR at, an 8B model and a 70B one alike);
- layer_us, moe_layer_us, recurrent_layer_us: what bandwidth does not explain, per block and token
  (kernel launches and their gaps, attention, norms), more for a MoE layer (router, top-k, the expert
  matmuls by id) and a recurrent one (the delta-net state update), on a REF_GB_S card; a slower
  GDDR card takes longer for them by (REF_GB_S / B) ** layer_scaling (a consumer card's bandwidth
  goes with its generation and clocks); an HBM card takes the REF_GB_S card's (its 2-5 TB/s come from
  wide memory, not from faster kernels: its clocks are 1.4-2 GHz);
- host_rate: GB/s the CPU's expert matmuls stream at: measured on this machine where Spark has
  calibrated its CPU (runs/host_calibration.py), else host_efficiency of the host's memory
  bandwidth where it is given (--host-bandwidth), else unstated_host_gb_s (what the public rigs'
  CPUs streamed at: their geometric mean), at most HOST_GB_S_PER_CORE a core;
- host_layer_us: what a host layer's hand-over costs besides its stop (the graph split: activations
  down, the result up, the CPU threads woken);
- prompt_params_per_tflop_us, prompt_moe_params: a prompt token is compute-bound, its work the
  weights (elements, not bytes: an F16 file is no more work than its Q4_K_M) of the matrices it
  multiplies (prompt_params: not the token embeddings, nor the output matrix, which llama-bench's
  prompt test runs for the last token only); a MoE layer costs as much as that many more weights
  (routing, sorting tokens by expert); share: 1 on NVIDIA
  cards, on AMD's (whose FP32 figure counts dual issue) prompt_amd_share with llama.cpp's Vulkan
  backend and prompt_rocm_share with its ROCm one (rocBLAS and its own matrix kernels); times
  prompt_hbm_share on an HBM card (whose tensor cores the FP32 figure leaves out);
- prompt_tile_tokens: an expert's matmul runs in tiles of about this many tokens, so an expert that
  gets fewer of a ubatch's tokens (ubatch * k / n_expert on average: 16 for Qwen3.6's 256 experts at
  -ub 512, 64 for gpt-oss-20b's 32) still pays for a whole tile (idle_tile_params).

A card is priced for the llama.cpp backend Spark builds for it (scripts/build_native.py: CUDA on
NVIDIA, Vulkan on AMD and Intel); a public figure, for the backend it was measured on where the fit
tells backends apart: AMD's ROCm from its Vulkan. NVIDIA's Vulkan figures are priced as CUDA (the
eight fitted ones decode at 1.00 of that on average, CUDA's own at 0.96) and Intel's SYCL as Vulkan.

A public figure on another quantization of a fixture's shapes (Workload.rescaled) scales the routed
experts so the file has the reported size and keeps the rest as the fixture's.

The fitted constants are the [fit] table of data/public_measurements.toml, made by
scripts/fit_public.py from the figures marked "fit" (the card's constants with each rig's CPU rate
fitted beside them, then the host's from those rates); the "held-out" figures check them. Vendor
figures and the stop, link and per-core figures below are assumptions, stated in the output."""

from __future__ import annotations

import functools
import re
import sys
from dataclasses import dataclass, fields, replace
from importlib import resources

from ..errors import BundledDataError, UsageError
from .cost_model import DeviceCosts
from .gguf_info import ModelGeometry
from .options import DEFAULT_UBATCH

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib  # type: ignore[no-redef]

PCIE_GB_S_PER_LANE = {3: 0.985, 4: 1.969, 5: 3.938}  # one direction, after encoding
PCIE_LANES = (1, 2, 4, 8, 16)
LINK_EFFICIENCY = 0.8  # share of the link a pinned upload gets
HOST_GB_S_PER_CORE = 12.0  # what one core's matmul streams at most
DEFAULT_HOST_CORES = 8  # a figure that names no CPU
REF_GB_S = 1000.0  # the card the block figures are given for
SPARK_BACKEND = {"nvidia": "cuda", "amd": "vulkan", "intel": "vulkan"}  # what scripts/build_native.py builds
VENDORS = {"nvidia": "NVIDIA", "amd": "AMD", "intel": "Intel"}
MEMORIES = {"gddr": "GDDR", "hbm": "HBM"}  # the card's memory (device_profiles.toml's memory)
BACKENDS = {"cuda": "CUDA", "rocm": "ROCm", "vulkan": "Vulkan", "sycl": "SYCL", "metal": "Metal"}  # llama-bench's names
BAND = (0.8, 1.25)  # predicted over reported: inside counts as reproduced
KINDS = {"tg": "decode", "pp": "prompt"}  # a figure's two speeds, as llama-bench names them and in words
ASSUMPTIONS = (f"uploads at {LINK_EFFICIENCY:.0%} of the link, at most {HOST_GB_S_PER_CORE:g} GB/s a CPU core, "
               "a prompt's host layers uploaded once per ubatch")


@functools.lru_cache(maxsize=None)
def _data(name: str) -> dict:
    """A bundled table, parsed once (a fit prices every figure's card thousands of times; read only)."""
    return tomllib.loads(resources.files("spark_cli").joinpath(f"data/{name}").read_text())


@dataclass(frozen=True)
class Card:
    key: str  # --predict-for's name
    name: str
    vram_gib: float
    memory_gb_s: float
    link_gb_s: float  # host -> device, one direction, the link's figure
    stop_us: float
    second_queue: bool = True  # uploads run beside compute (CUDA, ROCm, Vulkan; not over RPC)
    fp32_tflops: float = 0.0  # 0: not known (no prompt prediction)
    vendor: str = "nvidia"  # nvidia | amd | intel
    memory: str = "gddr"  # gddr | hbm (the data-centre parts')
    backend: str = ""  # llama.cpp's backend it runs (a BACKENDS key; "": the one Spark builds for the vendor)
    int8_matrix: bool = True  # int8 matrix units, which llama.cpp's quantized prompt kernels run on
    link_given: str = ""  # where link_gb_s comes from when not the card's own (e.g. "--pcie 4x8")

    def on_pcie(self, text: str) -> "Card":
        """The card on a slot that links it at `text`, --pcie's GENxLANES (a board may give it fewer
        lanes or an older generation than the card has); ValueError where `text` is not a link."""
        return replace(self, link_gb_s=pcie_gb_s(*parse_pcie(text)), link_given=f"--pcie {text}")

    def runs(self) -> str:
        """The llama.cpp backend it is priced for."""
        return self.backend or SPARK_BACKEND[self.vendor]

    def describe(self) -> str:
        return (f"{self.name} ({self.vram_gib:g} GiB {MEMORIES[self.memory]}, {self.memory_gb_s:g} GB/s, link {self.link_gb_s:.1f} GB/s, "
                f"llama.cpp's {BACKENDS[self.runs()]} backend)")


def pcie_gb_s(gen: int, lanes: int) -> float:
    """A PCIe link's GB/s in one direction (ValueError naming what is wrong with it)."""
    if gen not in PCIE_GB_S_PER_LANE:
        raise ValueError(f"PCIe generation {gen} is not one of {', '.join(map(str, PCIE_GB_S_PER_LANE))}")
    if lanes not in PCIE_LANES:
        raise ValueError(f"{lanes} lanes is not one of {', '.join(map(str, PCIE_LANES))}")
    return PCIE_GB_S_PER_LANE[gen] * lanes


def parse_pcie(text: str) -> tuple[int, int]:
    """A link as people write it, GENxLANES (4x8, 4.0x8, gen4 x8: PCIe 4.0 x8) -> (gen, lanes); ValueError
    where it is not one."""
    m = re.fullmatch(r"\s*(?:gen\s*)?(\d+)(?:\.0)?\s*x\s*(\d+)\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError("not GENxLANES")
    gen, lanes = int(m.group(1)), int(m.group(2))
    pcie_gb_s(gen, lanes)
    return gen, lanes


def _pcie(d: dict, where: str) -> float:
    """A row's pcie_gen and pcie_lanes as GB/s; a missing or impossible one is refused naming the row."""
    try:
        return pcie_gb_s(int(d["pcie_gen"]), int(d["pcie_lanes"]))
    except (KeyError, TypeError, ValueError) as e:
        why = f"{e.args[0]} missing" if isinstance(e, KeyError) else e
        raise BundledDataError(f"{where}: pcie_gen and pcie_lanes: {why}") from None


def _link(d: dict, key: str) -> float:
    """A card's link: link_gb_s, or its PCIe generation and lanes."""
    return float(d["link_gb_s"]) if "link_gb_s" in d else _pcie(d, f"device_profiles.toml: cards.{key}")


def _stated_link(d: dict, fid: str) -> float:
    """The link a figure's source says the card's slot gave it (0: not stated)."""
    return _pcie(d, f"public_measurements.toml: {fid}") if "pcie_gen" in d or "pcie_lanes" in d else 0.0


def _choice(d: dict, key: str, field: str, default: str, allowed) -> str:
    """A card's named choice (vendor, memory), checked against what the model knows."""
    value = str(d.get(field, default))
    if value not in allowed:
        raise BundledDataError(f"device_profiles.toml: cards.{key}.{field}: {value!r} is not one of "
                               f"{', '.join(allowed)}")
    return value


def _vendor(d: dict, key: str) -> str:
    return _choice(d, key, "vendor", "nvidia", SPARK_BACKEND)


def _memory(d: dict, key: str) -> str:
    return _choice(d, key, "memory", "gddr", MEMORIES)


def _flag(d: dict, key: str, field: str, default: bool) -> bool:
    value = d.get(field, default)
    if not isinstance(value, bool):
        raise BundledDataError(f"device_profiles.toml: cards.{key}.{field}: {value!r} is not true or false")
    return value


def cards() -> dict[str, Card]:
    """Every card of the bundled table, by --predict-for name."""
    return {k: Card(k, str(d["name"]), float(d["vram_gib"]), float(d["memory_gb_s"]),
                    _link(d, k), float(d["stop_us"]),
                    _flag(d, k, "second_queue", True), float(d.get("fp32_tflops", 0.0)), _vendor(d, k), _memory(d, k),
                    int8_matrix=_flag(d, k, "int8_matrix", True))
            for k, d in _data("device_profiles.toml")["cards"].items()}


def card(name: str) -> Card:
    table = cards()
    if name not in table:
        raise UsageError(f"--predict-for: unknown card {name!r}", hint="one of " + ", ".join(table))
    return table[name]


# ---------------------------------------------------------------- the fitted model


@dataclass(frozen=True)
class Fit:
    """The constants fitted to public measurements (the module docstring's formulas)."""

    device_efficiency: float
    layer_us: float
    moe_layer_us: float
    recurrent_layer_us: float
    layer_scaling: float  # the block figures are for a REF_GB_S card, times (REF_GB_S / B) ** this on GDDR
    host_efficiency: float  # the share of a stated host bandwidth the CPU's experts stream at
    host_layer_us: float
    unstated_host_gb_s: float  # what the CPU's experts stream at beside a host whose bandwidth is not given
    prompt_params_per_tflop_us: float
    prompt_moe_params: float
    prompt_amd_share: float  # AMD's share with llama.cpp's Vulkan backend
    prompt_tile_tokens: float
    rocm_bandwidth_share: float  # on AMD's ROCm backend, decode reads at this times device_efficiency
    prompt_rocm_share: float  # AMD's share with llama.cpp's ROCm backend
    hbm_bandwidth_share: float = 1.0  # on an HBM card, decode reads at this times device_efficiency
    prompt_hbm_share: float = 1.0  # an HBM card's prompt share of its FP32 figure (its tensor cores)
    n_fit: int = 0  # figures it was fitted to
    n_held_out: int = 0  # figures kept out of the fit

    @classmethod
    def from_dict(cls, d: dict) -> "Fit":
        return cls(**{f.name: type(f.default)(d[f.name]) if f.name in ("n_fit", "n_held_out") else float(d[f.name])
                      for f in fields(cls) if f.name in d})

    def describe(self) -> str:
        return (f"fitted to {self.n_fit} public llama.cpp figures ({self.n_held_out} more held out): decode reads at "
                f"{self.device_efficiency:.0%} of the card's bandwidth, {self.layer_us:.0f} us a block, "
                f"{self.moe_layer_us:.0f} us more a MoE layer, {self.recurrent_layer_us:.0f} us more a recurrent one "
                f"(on a {REF_GB_S:g} GB/s card and on an HBM card; x (1000 / GB/s)^{self.layer_scaling:.2f} on other GDDR cards), "
                f"{self.host_layer_us:.0f} us a host layer's hand-over, {self.hbm_bandwidth_share:.0%} of that "
                f"bandwidth share on an HBM card; the CPU's experts at "
                f"{self.host_efficiency:.0%} of a host bandwidth given, {self.unstated_host_gb_s:.0f} GB/s where none is")


def fitted() -> Fit:
    """The bundled fit (data/public_measurements.toml's [fit])."""
    return Fit.from_dict(_data("public_measurements.toml")["fit"])


@dataclass(frozen=True)
class Record:
    """How the fitted model did on one card's public figures of one kind (all on the card, on the
    backend Spark builds for it; fitted and held out alike): predicted over reported, lowest and
    highest, and how many inside BAND."""

    kind: str  # "tg" | "pp"
    lo: float
    hi: float
    inside: int
    n: int

    def describe(self) -> str:
        lo, hi = f"{self.lo:.2f}", f"{self.hi:.2f}"
        return f"{KINDS[self.kind]} {lo if lo == hi else f'{lo}-{hi}'} ({self.inside} of {self.n} within {BAND[0]}-{BAND[1]})"


def _record(key: str, kind: str, v: object) -> Record:
    """One [checked] row, checked: kind tg or pp, [lowest, highest, inside, figures]."""
    where = f"public_measurements.toml: checked.{key}.{kind}"
    if kind not in KINDS:
        raise BundledDataError(f"{where}: the kind must be tg or pp")
    if not (isinstance(v, list) and len(v) == 4 and all(isinstance(x, (int, float)) for x in v)):
        raise BundledDataError(f"{where}: must be [lowest, highest, inside, figures], got {v!r}")
    r = Record(kind, float(v[0]), float(v[1]), int(v[2]), int(v[3]))
    if not (0 < r.lo <= r.hi and 0 <= r.inside <= r.n and r.n > 0):
        raise BundledDataError(f"{where}: {v!r} is not a lowest <= highest ratio with 0 <= inside <= figures")
    return r


def all_records() -> dict[str, list[Record]]:
    """Every card's public record (data/public_measurements.toml's [checked], written by
    scripts/fit_public.py with the fit), by --predict-for name; a record of an unknown card is refused."""
    got = _data("public_measurements.toml").get("checked", {})
    unknown = sorted(set(got) - set(_data("device_profiles.toml")["cards"]))
    if unknown:
        raise BundledDataError(f"public_measurements.toml: checked.{unknown[0]}: not a card of device_profiles.toml")
    return {key: [_record(key, kind, v) for kind, v in rows.items()] for key, rows in got.items()}


def records(c: Card) -> list[Record]:
    """The card's public record: decode and prompt, where it has figures."""
    return all_records().get(c.key, [])


def card_class(c: Card, kind: str) -> tuple:
    """What makes cards alike for a kind of figure: vendor, backend and memory; for a prompt, also
    whether it has int8 matrix units (its kernels run on them)."""
    return (c.vendor, c.runs(), c.memory) + ((c.int8_matrix,) if kind == "pp" else ())


def describe_class(c: Card, kind: str) -> str:
    units = "" if kind != "pp" else " with int8 matrix units" if c.int8_matrix else " without int8 matrix units"
    return f"{VENDORS[c.vendor]} {MEMORIES[c.memory]} cards{units} on llama.cpp's {BACKENDS[c.runs()]} backend"


def class_record(c: Card, kind: str) -> tuple[Record, int] | None:
    """The public record of the other cards of `c`'s class for `kind`, pooled (lowest, highest, inside,
    figures), and how many cards it pools (None: none has figures of that kind)."""
    table = cards()
    got = [r for key, rs in all_records().items() if key != c.key
           and card_class(table[key], kind) == card_class(c, kind) for r in rs if r.kind == kind]
    if not got:
        return None
    return Record(kind, min(r.lo for r in got), max(r.hi for r in got), sum(r.inside for r in got),
                  sum(r.n for r in got)), len(got)


@dataclass(frozen=True)
class Workload:
    """What one token of a model reads and runs, as the formulas take it."""

    device_bytes: float  # a decode token's weight reads with every expert on the card
    layers: int  # blocks a token runs through
    moe_layers: int = 0
    recurrent_layers: int = 0
    k: int = 0  # routed experts per token and MoE layer
    expert_bytes: float = 0.0  # one routed expert (mean over MoE layers)
    layer_expert_bytes: float = 0.0  # one MoE layer's routed experts, all of them (mean)
    prompt_params: float = 0.0  # a prompt token's matrix weights (elements): every block's, k experts a MoE layer
    expert_params: float = 0.0  # one routed expert's weights (mean over MoE layers)

    @classmethod
    def of(cls, g: ModelGeometry, expert_scale: float = 1.0, rest_scale: float = 1.0) -> "Workload":
        """A model's workload; `expert_scale`, `rest_scale`: another quantization of the same shapes
        whose routed experts, and whose other weights, take that many times the bytes (`rescaled`)."""
        blocks = [l for l in g.layers if not l.is_nextn]
        moe = [l for l in blocks if l.is_moe]
        bpe = sum(l.expert_bytes_per_expert for l in moe) / max(len(moe), 1) * expert_scale
        per_layer = sum(l.expert_bytes for l in moe) / max(len(moe), 1) * expert_scale
        nonexpert = (g.device_global_bytes + sum(l.nonexpert_bytes for l in blocks)) * rest_scale
        k = g.n_expert_used
        ppe = sum(l.expert_params_per_expert for l in moe) / max(len(moe), 1)
        matrices = sum(l.matrix_params for l in blocks)
        return cls(nonexpert + len(moe) * k * bpe, len(blocks), len(moe), sum(1 for r in g.recurrent_layers if r), k,
                   bpe, per_layer, matrices + len(moe) * k * ppe, ppe)

    @classmethod
    def rescaled(cls, g: ModelGeometry, size_bytes: float, lands_on: str = "experts") -> "Workload":
        """The workload of another quantization of `g`'s shapes, `size_bytes` on disk. The difference
        from the fixture's file lands on the routed experts: low-bit MoE quantizations (Unsloth's UD,
        mudler's APEX) shrink the experts and keep attention, shared experts, embeddings and output
        at 3-8 bits (e.g. APEX Nano: IQ2_XXS/IQ2_S/Q3_K experts, Q3_K/Q4_K attention, Q4_K/Q5_K shared
        experts, https://github.com/mudler/apex-quant/tree/main/configs), so scaling every byte would
        shrink a token's non-expert reads with them. `lands_on="rest"`: a file that keeps the
        fixture's experts and stores the rest at another width (gpt-oss's "BF16" files: MXFP4 experts,
        BF16 attention, embeddings and output)."""
        experts = sum(l.expert_bytes for l in g.layers if l.is_moe and not l.is_nextn)
        if experts <= 0:
            raise ValueError("a rescaled workload needs routed experts")
        if lands_on == "rest":
            scale = (size_bytes - experts) / (g.file_size - experts)
            if scale <= 0:
                raise ValueError(f"{size_bytes / 1e9:.2f} GB is less than the fixture's routed experts")
            return cls.of(g, rest_scale=scale)
        scale = (size_bytes - (g.file_size - experts)) / experts
        if scale <= 0:
            raise ValueError(f"{size_bytes / 1e9:.2f} GB is less than the fixture's non-expert bytes")
        return cls.of(g, scale)


@dataclass(frozen=True)
class Host:
    """The CPU beside the card: its expert rate measured here, or its memory bandwidth (None: not
    given) and cores."""

    gb_s: float | None = None
    cores: int = DEFAULT_HOST_CORES
    measured_gb_s: float | None = None  # GB/s a missed expert streams at on this CPU (Spark's calibration)
    measured_source: str = ""

    def rate(self, f: Fit) -> float:
        """GB/s the CPU's expert matmuls stream at."""
        if self.measured_gb_s is not None:
            return self.measured_gb_s
        base = f.unstated_host_gb_s if self.gb_s is None else self.gb_s * f.host_efficiency
        return min(base, self.cores * HOST_GB_S_PER_CORE)

    def describe(self, f: Fit) -> str:
        if self.measured_gb_s is not None:
            return f"host measured: {self.measured_gb_s:.1f} GB/s for the CPU's experts ({self.measured_source})"
        bandwidth = "bandwidth not given" if self.gb_s is None else f"{self.gb_s:g} GB/s"
        return f"host {bandwidth}, {self.cores} cores: {self.rate(f):.1f} GB/s for the CPU's experts"


def efficiency(c: Card, f: Fit) -> float:
    """The share of the card's bandwidth a decode token's weight reads get on its backend and memory."""
    return min(1.0, f.device_efficiency * (f.rocm_bandwidth_share if c.runs() == "rocm" else 1.0)
               * (f.hbm_bandwidth_share if c.memory == "hbm" else 1.0))


def prompt_share(c: Card, f: Fit) -> float:
    """The share of the card's FP32 figure a prompt gets, by vendor, backend and memory."""
    hbm = f.prompt_hbm_share if c.memory == "hbm" else 1.0
    if c.vendor != "amd":
        return hbm
    return hbm * (f.prompt_rocm_share if c.runs() == "rocm" else f.prompt_amd_share)


def layer_scale(c: Card, f: Fit) -> float:
    """What the block figures (given for a REF_GB_S card) are multiplied by on this card."""
    return 1.0 if c.memory == "hbm" else (REF_GB_S / c.memory_gb_s) ** f.layer_scaling


def decode_us(c: Card, w: Workload, f: Fit) -> float:
    """A decode token with every expert on the card."""
    blocks = w.layers * f.layer_us + w.moe_layers * f.moe_layer_us + w.recurrent_layers * f.recurrent_layer_us
    return w.device_bytes / (c.memory_gb_s * efficiency(c, f) * 1e3) + c.stop_us + blocks * layer_scale(c, f)


def host_layer_us(c: Card, w: Workload, f: Fit, host: Host) -> float:
    """What a host layer (stock --n-cpu-moe's) adds to a decode token (< 0: the CPU is faster)."""
    k_bytes = w.k * w.expert_bytes
    return c.stop_us + f.host_layer_us + k_bytes / (host.rate(f) * 1e3) - \
        k_bytes / (c.memory_gb_s * efficiency(c, f) * 1e3)


def idle_tile_params(w: Workload, f: Fit, ubatch: int = DEFAULT_UBATCH) -> float:
    """What a MoE layer's part-filled tiles cost a prompt token, in weights: each expert gets
    ubatch * k / n_expert of a ubatch's tokens on average and pays for prompt_tile_tokens."""
    if not w.k or w.expert_bytes <= 0:
        return 0.0
    per_expert = ubatch * w.k / (w.layer_expert_bytes / w.expert_bytes)
    return w.k * w.expert_params * max(0.0, f.prompt_tile_tokens / per_expert - 1.0)


def prompt_us(c: Card, w: Workload, f: Fit, ubatch: int = DEFAULT_UBATCH) -> float:
    """A prompt token with every expert on the card, in ubatches of `ubatch` tokens (0: the card's
    compute, or the model's weight count, is not known)."""
    if c.fp32_tflops <= 0 or w.prompt_params <= 0:
        return 0.0
    moe = w.moe_layers * (f.prompt_moe_params + idle_tile_params(w, f, ubatch))
    return (w.prompt_params + moe) / (c.fp32_tflops * prompt_share(c, f) * f.prompt_params_per_tflop_us)


def host_layer_prompt_us(c: Card, w: Workload, ubatch: int = DEFAULT_UBATCH) -> float:
    """What a host layer adds to a prompt token: its experts uploaded once per ubatch of `ubatch`
    tokens (an assumption: llama.cpp runs a large batch's host experts on the card, uploading them)."""
    return w.layer_expert_bytes / (c.link_gb_s * LINK_EFFICIENCY * 1e3) / ubatch


def tg_tok_s(c: Card, w: Workload, n_host: int, f: Fit, host: Host) -> float:
    """Predicted decode tok/s of stock's placement with `n_host` host layers."""
    return 1e6 / (decode_us(c, w, f) + n_host * host_layer_us(c, w, f, host))


def pp_tok_s(c: Card, w: Workload, n_host: int, f: Fit, ubatch: int = DEFAULT_UBATCH) -> float | None:
    """Predicted prompt tok/s of stock's placement with `n_host` host layers at -ub `ubatch` (None:
    not predicted)."""
    base = prompt_us(c, w, f, ubatch)
    return 1e6 / (base + n_host * host_layer_prompt_us(c, w, ubatch)) if base > 0 else None


def predicted_costs(c: Card, g: ModelGeometry, host_gb_s: float | None = None,
                    host_cores: int = DEFAULT_HOST_CORES, host: Host | None = None,
                    fit: Fit | None = None, ubatch: int = DEFAULT_UBATCH) -> DeviceCosts:
    """The cost model's figures for `g` on card `c` beside this host (`host` overrides the
    bandwidth and cores, e.g. with a measured rate), a prompt in ubatches of `ubatch` tokens (-ub)."""
    f = fit or fitted()
    h = host or Host(host_gb_s, host_cores)
    w = Workload.of(g)
    rate = h.rate(f) * 1e3  # bytes per us
    pp_host = host_layer_prompt_us(c, w, ubatch) if c.fp32_tflops > 0 else 0.0
    return DeviceCosts(device=c.name, source=f"published figures: {c.describe()} and a fit to {f.n_fit} public "
                       f"measurements; {h.describe(f)}", threads=0, base_tg_us=decode_us(c, w, f),
                       base_pp_us=prompt_us(c, w, f, ubatch), stop_us=c.stop_us,
                       host_tg_us=max(host_layer_us(c, w, f, h), 0.0), host_pp_us=pp_host, cached_pp_us=pp_host,
                       miss_cpu_us=w.expert_bytes / rate,
                       miss_upload_us=w.expert_bytes / (c.link_gb_s * LINK_EFFICIENCY * 1e3),
                       concurrent=c.second_queue, predicted=True)


def provenance(c: Card, h: Host, f: Fit | None = None) -> list[str]:
    """Which figures of a --predict-for prediction are measured, fitted from public reports and assumed."""
    f = f or fitted()
    measured = f"this CPU's experts at {h.measured_gb_s:.1f} GB/s ({h.measured_source})" \
        if h.measured_gb_s is not None else \
        ("nothing: the host below is the flags' or the defaults (without --host-bandwidth and --host-cores, a CPU "
         "calibration kept under $SPARK_HOME/calibration by `spark bench` is used)")
    bandwidth = "bandwidth not given (the public rigs' CPU rate)" if h.gb_s is None else f"{h.gb_s:g} GB/s"
    host = "" if h.measured_gb_s is not None else \
        f"; the host's {bandwidth} and {h.cores} cores (--host-bandwidth, --host-cores)"
    return [f"measured: {measured}",
            f"fitted from public reports: {f.describe()} (data/public_measurements.toml)",
            f"assumed: {c.name}'s vendor bandwidth {c.memory_gb_s:g} GB/s, {c.fp32_tflops:g} FP32 TFLOPS and "
            f"link {c.link_gb_s:.1f} GB/s ({c.link_given or 'its own: --pcie GENxLANES for the one its slot gives it'}), "
            f"a {c.stop_us:g} us stop, llama.cpp's {BACKENDS[c.runs()]} backend"
            f"{'' if c.backend else f' (the one Spark builds for {VENDORS[c.vendor]} cards)'}{host}; {ASSUMPTIONS}",
            checked_line(c)]


def checked_line(c: Card) -> str:
    """How far the model's predictions were from what people measured on this card, or that none did."""
    got = records(c)
    where = f"with every weight on {c.name} and llama.cpp's {BACKENDS[c.runs()]} backend"
    own = f"checked against the public figures {where} (fitted and held out): predicted over reported " \
        f"{', '.join(r.describe() for r in got)}" if got else f"checked: no public figure {where}"
    missing = [k for k in KINDS if k not in {r.kind for r in got}]
    pooled = [(k, p) for k in missing for p in [class_record(c, k)] if p is not None]
    others = "; ".join(f"on {n} other {describe_class(c, k)}, {r.describe()}" for k, (r, n) in pooled)
    if not got and not pooled:
        return f"{own}: nothing shows how close this card's prediction comes"
    if pooled:
        own += f"{f', no {KINDS[pooled[0][0]]} figure on it' if got else ''}; {others}"
    return f"{own} (docs/cost-model.md)"


# ---------------------------------------------------------------- the public figures


@dataclass(frozen=True)
class Figure:
    """One published measurement (data/public_measurements.toml)."""

    id: str
    card: str
    model: str  # a fixture name, or "dense"
    size_bytes: float
    n_cpu_moe: int
    tg_tok_s: float | None  # None: a prompt-only figure (llama-bench -n 0)
    split: str  # fit | held-out
    url: str
    layers: int = 0  # dense only
    embd_bytes: float = 0.0  # dense only: the untied token embeddings, which a token does not read
    pp_tok_s: float | None = None
    host_gb_s: float | None = None
    host_cores: int | None = None
    tg_test: str = ""
    pp_test: str = ""
    ubatch: int = DEFAULT_UBATCH  # -ub of the prompt figure
    prompt_tokens: int = 512  # the prompt figure's length (llama-bench's default pp512)
    backend: str = ""  # the llama.cpp backend it ran (a BACKENDS key; "": the one Spark builds)
    size_lands_on: str = "experts"  # where its file's size differs from the fixture's: "experts" | "rest"
    prompt_params: float = 0.0  # dense only: a prompt token's matrix weights (all but embeddings and output)
    link_gb_s: float = 0.0  # the link the source says its slot gave the card (0: not stated: the card's own)

    def device(self) -> Card:
        """The card as the figure ran it: on its backend, and on its slot's link where the source states it."""
        c = replace(card(self.card), backend=self.backend)
        return replace(c, link_gb_s=self.link_gb_s, link_given="the source's") if self.link_gb_s else c

    def prompt_ubatch(self) -> int:
        """Tokens a prompt figure's host layers are uploaded once for: its ubatch, or the whole prompt
        where that is shorter (a 512-token prompt at -ub 2048 is one ubatch of 512)."""
        return min(self.ubatch, self.prompt_tokens)

    def host(self) -> Host:
        return Host(self.host_gb_s, self.host_cores or DEFAULT_HOST_CORES)

    def workload(self, geometry: ModelGeometry | None) -> Workload:
        """The run's workload: a fixture's shapes at the reported size, or a dense model's size."""
        if self.model == "dense":
            return Workload(self.size_bytes - self.embd_bytes, self.layers, prompt_params=self.prompt_params)
        if geometry is None:
            raise ValueError(f"public_measurements.toml: {self.id}: needs the geometry of {self.model}")
        if not self.size_bytes:
            return Workload.of(geometry)
        try:
            return Workload.rescaled(geometry, self.size_bytes, self.size_lands_on)
        except ValueError as e:
            raise ValueError(f"public_measurements.toml: {self.id}: {e}") from None


def _size(d: dict, fid: str) -> float:
    """The file's size in bytes; 0 where a source does not give it and the figure needs none: a
    fixture's own quantization, or a dense model's prompt alone (priced by its weight count)."""
    if "size_gib" in d:
        return float(d["size_gib"]) * 2 ** 30
    if "size_gb" in d:
        return float(d["size_gb"]) * 1e9
    if d["model"] == "dense" and "tg_tok_s" in d:
        raise ValueError(f"public_measurements.toml: {fid}: no size_gib or size_gb (a dense decode needs it)")
    return 0.0


def _lands_on(d: dict, fid: str) -> str:
    where = str(d.get("size_lands_on", "experts"))
    if where not in ("experts", "rest"):
        raise ValueError(f"public_measurements.toml: {fid}: size_lands_on must be \"experts\" or \"rest\"")
    return where


BACKEND_VENDORS = {"cuda": {"nvidia"}, "rocm": {"amd"}, "vulkan": {"nvidia", "amd", "intel"}, "sycl": {"intel"},
                   "metal": set()}  # the cards each backend runs on


def _backend(d: dict, fid: str, vendor: str) -> str:
    """The backend a figure ran: its `backend` text's first word, as llama-bench's backend column
    names it (HIP is ROCm's), one that runs on the card's vendor."""
    if "backend" not in d:
        raise ValueError(f"public_measurements.toml: {fid}: no backend (the llama-bench backend column's word)")
    word = re.match(r"[A-Za-z]*", str(d["backend"])).group(0).lower()
    word = "rocm" if word == "hip" else word
    if word not in BACKENDS:
        raise ValueError(f"public_measurements.toml: {fid}: backend {d['backend']!r} must start with one of "
                         f"{', '.join(BACKENDS.values())} or HIP (llama-bench's backend column)")
    if vendor not in BACKEND_VENDORS[word]:
        raise ValueError(f"public_measurements.toml: {fid}: backend {BACKENDS[word]} does not run on "
                         f"{VENDORS[vendor]} cards")
    return word


def _embd_bytes(d: dict, fid: str) -> float:
    """A dense decode figure's token embeddings: llama.cpp reads one row of them a token (get_rows), so
    they are not a token's weight reads, unless the output shares them (`tied`). Sized by gguf's block
    table from the model's vocabulary, width and the tensor's type (an untied token_embd keeps the
    file's type in llama.cpp's Q4_0 and Q4_K_M recipes: llama-quant.cpp)."""
    if d.get("tied", False):
        return 0.0
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[str(d["embd_type"]).upper()]]
        return int(d["vocab"]) * int(d["n_embd"]) / block * size
    except KeyError as e:
        raise ValueError(f"public_measurements.toml: {fid}: a dense figure needs vocab, n_embd and embd_type "
                         f"(a ggml type), or tied = true ({e})") from None


def _prompt_params(d: dict, fid: str) -> float:
    """A dense figure's prompt work in weights: its parameter count (params_b, llama-bench's params
    column) less the token embeddings (one row read a token) and the output matrix (llama-bench's
    prompt test asks for the last token's logits only), which a tied model shares with them."""
    try:
        params, embd = float(d["params_b"]) * 1e9, int(d["vocab"]) * int(d["n_embd"])
    except KeyError as e:
        raise ValueError(f"public_measurements.toml: {fid}: a dense figure needs params_b, vocab and n_embd ({e})") from None
    left = params - embd * (1 if d.get("tied", False) else 2)
    if left <= 0:
        raise ValueError(f"public_measurements.toml: {fid}: params_b leaves no weights beside the embeddings")
    return left


def figures() -> list[Figure]:
    """Every bundled public figure (ValueError on a malformed row)."""
    out, known = [], cards()
    for d in _data("public_measurements.toml")["figure"]:
        fid = str(d["id"])
        if str(d["card"]) not in known:
            raise ValueError(f"public_measurements.toml: {fid}: card {d['card']!r} is not in device_profiles.toml")
        if d["split"] not in ("fit", "held-out") or (d["model"] == "dense") != ("layers" in d):
            raise ValueError(f"public_measurements.toml: {fid}: split, or layers for a dense model")
        if "tg_tok_s" not in d and "pp_tok_s" not in d:
            raise ValueError(f"public_measurements.toml: {fid}: neither tg_tok_s nor pp_tok_s")
        if any(float(d[k]) <= 0 for k in ("tg_tok_s", "pp_tok_s") if k in d):
            raise ValueError(f"public_measurements.toml: {fid}: tg_tok_s and pp_tok_s must be above 0")
        out.append(Figure(fid, str(d["card"]), str(d["model"]), _size(d, fid), int(d["n_cpu_moe"]),
                          float(d["tg_tok_s"]) if "tg_tok_s" in d else None, str(d["split"]), str(d["url"]),
                          int(d.get("layers", 0)),
                          _embd_bytes(d, fid) if d["model"] == "dense" and "tg_tok_s" in d else 0.0,
                          float(d["pp_tok_s"]) if "pp_tok_s" in d else None,
                          float(d["host_gb_s"]) if "host_gb_s" in d else None,
                          int(d["host_cores"]) if "host_cores" in d else None,
                          str(d.get("tg_test", "")), str(d.get("pp_test", "")),
                          int(d.get("ubatch", DEFAULT_UBATCH)), int(d.get("prompt_tokens", 512)),
                          _backend(d, fid, known[str(d["card"])].vendor), _lands_on(d, fid),
                          _prompt_params(d, fid) if d["model"] == "dense" else 0.0,
                          _stated_link(d, fid)))
    return out


@dataclass(frozen=True)
class Check:
    """One figure predicted: predicted over reported, decode and prompt (each where reported)."""

    figure: Figure
    tg_ratio: float | None
    pp_ratio: float | None

    def ratios(self) -> list[float]:
        return [r for r in (self.tg_ratio, self.pp_ratio) if r is not None]


def check(fig: Figure, geometry: ModelGeometry | None, f: Fit | None = None) -> Check:
    """`fig` predicted with the fit: the ratios of predicted to reported."""
    f = f or fitted()
    c, w = fig.device(), fig.workload(geometry)
    pp = pp_tok_s(c, w, fig.n_cpu_moe, f, fig.prompt_ubatch()) if fig.pp_tok_s else None
    tg = tg_tok_s(c, w, fig.n_cpu_moe, f, fig.host()) / fig.tg_tok_s if fig.tg_tok_s else None
    return Check(fig, tg, pp / fig.pp_tok_s if pp and fig.pp_tok_s else None)
