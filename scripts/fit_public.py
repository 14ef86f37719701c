#!/usr/bin/env python3
"""Fit `spark plan --predict-for`'s constants (core/device_table.py's module docstring) to the public
figures marked "fit" in spark_cli/data/public_measurements.toml, and print predicted over reported for
every figure, fitted and held out. With --write the [fit] table of the data file is replaced, and each
card's [checked] record with it.

The fit minimises the squared log of predicted over reported (Nelder-Mead; positive constants,
efficiencies at most 1), in two stages for decode, since a host's CPU is not the model's to know:
the card's constants on every fitted all-on-card figure and every fitted --n-cpu-moe figure of a rig
with several, each rig's CPU rate a free constant beside them (a rig's lone figure does not enter);
then the host's constants from the rate each fitted --n-cpu-moe figure implies (`host_prior`). The
prompt constants on every fitted prompt figure. Held-out figures are never seen by it.

It also checks the model with each rig's host calibrated, as `spark bench`'s CPU calibration gives a
user's own host: an --n-cpu-moe figure of a rig with others (one source, card and stated host
bandwidth) is predicted with the CPU expert rate that best fits the rig's other figures (leave one
out), so the only thing taken from the rig is its CPU's rate, never the figure itself.

With --records only each card's record is rewritten (how close the stored constants come on the
card's figures all on the card, on the backend Spark builds for it), which `spark plan --predict-for`
prints; after figures are added without a refit.

Usage: .venv/bin/python scripts/fit_public.py [--write | --records] [--markdown] [--png PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import statistics
import sys
from pathlib import Path

import numpy as np

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib  # type: ignore[no-redef]

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from spark_cli.core import device_table as dt  # noqa: E402
from spark_cli.errors import SparkError  # noqa: E402
from spark_cli.files.atomic import atomic_write_bytes, atomic_write_text, check_output  # noqa: E402
from spark_cli.core.gguf_info import load_geometry  # noqa: E402
from spark_cli.models.fixtures import build_fixture  # noqa: E402

DATA = Path(__file__).resolve().parent.parent / "spark_cli" / "data" / "public_measurements.toml"
MARK = "# ---- fitted by scripts/fit_public.py"
TG = ("device_efficiency", "layer_us", "moe_layer_us", "recurrent_layer_us", "layer_scaling", "host_layer_us",
      "rocm_bandwidth_share", "hbm_bandwidth_share")
PP = ("prompt_params_per_tflop_us", "prompt_moe_params", "prompt_amd_share", "prompt_tile_tokens", "prompt_rocm_share",
      "prompt_hbm_share")
BOUNDED = {"device_efficiency", "prompt_amd_share", "prompt_rocm_share", "hbm_bandwidth_share"}  # at most 1
RATE_RANGE = (0.5, 1000.0)  # GB/s: the CPU expert rates a figure may imply


def nelder_mead(fun, x0: np.ndarray, iters: int = 4000, tol: float = 1e-10) -> np.ndarray:
    """A plain Nelder-Mead minimiser (numpy only)."""
    n = len(x0)
    simplex = [x0] + [x0 + np.eye(n)[i] * 0.3 for i in range(n)]
    vals = [fun(x) for x in simplex]
    for _ in range(iters):
        order = np.argsort(vals)
        simplex, vals = [simplex[i] for i in order], [vals[i] for i in order]
        if abs(vals[-1] - vals[0]) < tol:
            break
        centroid = np.mean(simplex[:-1], axis=0)
        xr = centroid + (centroid - simplex[-1])
        fr = fun(xr)
        if fr < vals[0]:
            xe = centroid + 2 * (centroid - simplex[-1])
            fe = fun(xe)
            simplex[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            simplex[-1], vals[-1] = xr, fr
        else:
            xc = centroid + 0.5 * (simplex[-1] - centroid)
            fc = fun(xc)
            if fc < vals[-1]:
                simplex[-1], vals[-1] = xc, fc
            else:
                simplex = [simplex[0] + 0.5 * (s - simplex[0]) for s in simplex]
                vals = [fun(s) for s in simplex]
    return simplex[int(np.argmin(vals))]


def _params(names, x: np.ndarray) -> dict[str, float]:
    """Log-parametrised constants (positive), efficiencies capped at 1."""
    out = {}
    for name, v in zip(names, x):
        out[name] = min(math.exp(v), 1.0) if name in BOUNDED else math.exp(v)
    return out


def fit(figs, geos, start: dt.Fit) -> dt.Fit:
    """The constants from the "fit" figures. Decode: the card's constants on every all-on-card figure
    and every --n-cpu-moe figure of a rig with several, each rig's CPU rate fitted beside them (its
    CPU is not the model's to know); then the host's two constants from the rates the fitted figures
    imply (`host_prior`). Prompt: on every fitted prompt figure."""
    train = [x for x in figs if x.split == "fit"]
    prep = {x.id: (x.device(), x.workload(geos.get(x.model))) for x in train}
    resident, groups = [x for x in train if not x.n_cpu_moe and x.tg_tok_s], rigs(train)

    def loss_tg(v: np.ndarray) -> float:
        f_ = dataclasses.replace(start, **_params(TG, v[:len(TG)]))
        err = sum(math.log(dt.tg_tok_s(*prep[x.id], 0, f_, dt.Host()) / x.tg_tok_s) ** 2 for x in resident)
        for rate, xs in zip(np.exp(v[len(TG):]), groups):
            err += sum(math.log(dt.tg_tok_s(*prep[x.id], x.n_cpu_moe, f_, dt.Host(measured_gb_s=rate)) / x.tg_tok_s)
                       ** 2 for x in xs)
        return err

    v = np.log([0.7, 30.0, 50.0, 50.0, 0.5, 50.0, 1.0, 0.7] + [40.0] * len(groups))
    for _ in range(2):  # Nelder-Mead, restarted once from where it stopped
        v = nelder_mead(loss_tg, v, iters=20000)
    got = dataclasses.replace(start, **_params(TG, v[:len(TG)]))
    got = dataclasses.replace(got, **host_prior(train, prep, got))

    def loss_pp(v: np.ndarray) -> float:
        f_ = dataclasses.replace(got, **_params(PP, v))
        return sum(math.log(r) ** 2 for r in (dt.check(x, geos.get(x.model), f_).pp_ratio for x in train)
                   if r is not None)

    pp = nelder_mead(loss_pp, np.log([1e6, 1e8, 0.5, 64.0, 0.5, 2.0]), iters=20000)
    got = dataclasses.replace(got, **_params(PP, pp))
    return dataclasses.replace(got, n_fit=len(train), n_held_out=len(figs) - len(train))


def implied_rate(x: dt.Figure, card: dt.Card, w: dt.Workload, f: dt.Fit) -> float:
    """The CPU expert rate (GB/s) at which the model gives an --n-cpu-moe figure's decode exactly
    (bisection; clamped to RATE_RANGE)."""
    lo, hi = (math.log(r) for r in RATE_RANGE)
    for _ in range(60):
        mid = (lo + hi) / 2
        tg = dt.tg_tok_s(card, w, x.n_cpu_moe, f, dt.Host(measured_gb_s=math.exp(mid)))
        lo, hi = (mid, hi) if tg < x.tg_tok_s else (lo, mid)
    return math.exp((lo + hi) / 2)


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(map(math.log, xs)) / len(xs))


def host_prior(train, prep, f: dt.Fit) -> dict[str, float]:
    """The host's constants for a CPU Spark has not measured, from the rates the fitted --n-cpu-moe
    figures imply under `f`'s card constants: a rig's rate is its figures' geometric mean (one source,
    card and stated host bandwidth); `unstated_host_gb_s` is every rig's geometric mean (the rate that
    minimises the squared log error over them), `host_efficiency` the geometric mean share of the
    stated bandwidth where one is (at most 1)."""
    rig = {k: _geomean([implied_rate(x, *prep[x.id], f) for x in xs]) for k, xs in _by_rig(train).items()}
    stated = [r / k[2] for k, r in rig.items() if k[2]]
    if not rig or not stated:
        raise ValueError("the fit needs --n-cpu-moe figures, some with the host's bandwidth stated")
    return {"unstated_host_gb_s": _geomean(list(rig.values())), "host_efficiency": min(_geomean(stated), 1.0)}


def table(figs, geos, f: dt.Fit) -> list[str]:
    rows = ["| figure | card | model, placement | reported tg / pp tok/s | predicted / reported tg | pp | split "
            "| source |",
            "|---|---|---|---|---|---|---|---|"]
    for fig in figs:
        c = dt.check(fig, geos.get(fig.model), f)
        place = f"--n-cpu-moe {fig.n_cpu_moe}" if fig.n_cpu_moe else "all on the card"
        model = "dense" if fig.model == "dense" else fig.model
        rep = (f"{fig.tg_tok_s:g}" if fig.tg_tok_s else "-") + (f" / {fig.pp_tok_s:g}" if fig.pp_tok_s else "")
        tg, pp = (f"{r:.2f}" if r is not None else "-" for r in (c.tg_ratio, c.pp_ratio))
        size = f"{fig.size_bytes / 1e9:.1f} GB" if fig.size_bytes else "size not given"
        rows.append(f"| {fig.id} | {fig.card} | {model}, {size}, {place} | {rep} | "
                    f"{tg} | {pp} | {fig.split} | {fig.url} |")
    return rows


def calibrated_table(rows: list[tuple[dt.Figure, float, float]]) -> list[str]:
    out = ["", "| figure | split | host's CPU expert rate fitted to the rig's other figures | predicted / reported tg |",
           "|---|---|---|---|"]
    return out + [f"| {x.id} | {x.split} | {rate:.1f} GB/s | {r:.2f} |" for x, rate, r in rows]


def _inside(cs: list[dt.Check]) -> str:
    """How many of the checks' ratios (decode, and prompt where reported) are inside the band."""
    ratios = [c.tg_ratio for c in cs if c.tg_ratio is not None] + [c.pp_ratio for c in cs if c.pp_ratio is not None]
    if not ratios:
        return "no figures"
    lo, hi = dt.BAND
    inside = sum(1 for r in ratios if lo <= r <= hi)
    return f"{inside} of {len(ratios)} within {lo}-{hi} ({min(ratios):.2f}-{max(ratios):.2f})"


def summary(figs, geos, f: dt.Fit) -> list[str]:
    """Per split: every figure, then all on the card and with experts on the CPU apart (a host's CPU
    rate is rarely stated, so the second kind carries an unknown the first does not)."""
    out = []
    for split in ("fit", "held-out"):
        cs = [dt.check(x, geos.get(x.model), f) for x in figs if x.split == split]
        card = [c for c in cs if not c.figure.n_cpu_moe]
        host = [c for c in cs if c.figure.n_cpu_moe]
        out.append(f"{split}: {_inside(cs)}; all on the card: {_inside(card)}; --n-cpu-moe: {_inside(host)}")
    return out


def _by_rig(figs) -> dict[tuple, list[dt.Figure]]:
    """The --n-cpu-moe decode figures by rig: one source, card and stated host bandwidth."""
    by: dict[tuple, list[dt.Figure]] = {}
    for x in figs:
        if x.n_cpu_moe and x.tg_tok_s:
            by.setdefault((x.url, x.card, x.host_gb_s), []).append(x)
    return by


def rigs(figs) -> list[list[dt.Figure]]:
    """The --n-cpu-moe figures of every rig with two or more."""
    return [xs for xs in _by_rig(figs).values() if len(xs) > 1]


def host_rate(figs, geos, f: dt.Fit) -> float:
    """The CPU expert rate (GB/s) that best fits these figures of one rig (least squared log ratio)."""
    prepared = [(x, x.device(), x.workload(geos.get(x.model))) for x in figs]

    def err(rate: float) -> float:
        return sum(math.log(dt.tg_tok_s(c, w, x.n_cpu_moe, f, dt.Host(measured_gb_s=rate)) / x.tg_tok_s) ** 2
                   for x, c, w in prepared)

    grid = np.exp(np.linspace(math.log(1.0), math.log(400.0), 241))
    best = min(grid, key=err)
    lo, hi = best / 1.03, best * 1.03  # then golden section between the neighbours
    for _ in range(40):
        a, b = hi - (hi - lo) / 1.618034, lo + (hi - lo) / 1.618034
        lo, hi = (lo, b) if err(a) < err(b) else (a, hi)
    return (lo + hi) / 2


def calibrated(figs, geos, f: dt.Fit) -> list[tuple[dt.Figure, float, float]]:
    """Each --n-cpu-moe figure of a rig with others, its decode predicted with the host's CPU expert rate
    fitted to the rig's other figures (leave one out), as `spark bench` calibrates a user's own CPU:
    (figure, that rate, predicted over reported)."""
    out = []
    for xs in rigs(figs):
        for i, x in enumerate(xs):
            rate = host_rate(xs[:i] + xs[i + 1:], geos, f)
            tg = dt.tg_tok_s(x.device(), x.workload(geos.get(x.model)), x.n_cpu_moe, f,
                             dt.Host(measured_gb_s=rate))
            out.append((x, rate, tg / x.tg_tok_s))
    return out


def calibrated_summary(rows: list[tuple[dt.Figure, float, float]]) -> list[str]:
    """Per split: how many decode ratios are inside the band with the host calibrated."""
    lo, hi = dt.BAND
    out = []
    for split in ("fit", "held-out"):
        rs = [r for x, _, r in rows if x.split == split]
        inside = sum(1 for r in rs if lo <= r <= hi)
        span = f" ({min(rs):.2f}-{max(rs):.2f})" if rs else ""
        out.append(f"{split}, --n-cpu-moe with the host calibrated from the rig's other figures: "
                    f"{inside} of {len(rs)} within {lo}-{hi}{span}")
    return out


def chart(figs, geos, f: dt.Fit, path: Path, rows: list[tuple[dt.Figure, float, float]] | None = None) -> int:
    """Predicted over reported for every figure, as a PNG (atomically): decode and prompt, fitted and
    held out, all on the card and with --n-cpu-moe apart, an offload figure's decode again with its
    rig's host calibrated (`calibrated`, or `rows` where the caller has them), the band shaded.
    Returns the points drawn."""
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    checks = [dt.check(x, geos.get(x.model), f) for x in figs]
    calibrated_ratio = {x.id: r for x, _, r in (rows if rows is not None else calibrated(figs, geos, f))}
    order = sorted(range(len(checks)), key=lambda i: (checks[i].figure.split != "fit",
                                                      bool(checks[i].figure.n_cpu_moe), i))
    fig = Figure(figsize=(11, 4.8), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    lo, hi = dt.BAND
    ax.axhspan(lo, hi, color="0.9", zorder=0, label=f"band {lo}-{hi}")
    ax.axhline(1.0, color="0.6", lw=0.8, zorder=1)
    drawn = 0
    for x, i in enumerate(order):
        c = checks[i]
        colour = "tab:blue" if c.figure.split == "fit" else "tab:red"
        if c.tg_ratio is not None:
            ax.scatter([x], [c.tg_ratio], marker="o" if not c.figure.n_cpu_moe else "s", color=colour, zorder=3)
            drawn += 1
        if c.pp_ratio is not None:
            ax.scatter([x], [c.pp_ratio], marker="^", facecolors="none", edgecolors=colour, zorder=3)
            drawn += 1
        if c.figure.id in calibrated_ratio:
            ax.scatter([x], [calibrated_ratio[c.figure.id]], marker="x", color=colour, zorder=3)
            drawn += 1
    for label, kw in (("fit", dict(color="tab:blue")), ("held-out", dict(color="tab:red")),
                      ("tg, all on the card", dict(color="0.3", marker="o")),
                      ("tg, --n-cpu-moe", dict(color="0.3", marker="s")),
                      ("pp", dict(facecolors="none", edgecolors="0.3", marker="^")),
                      ("tg, --n-cpu-moe, host calibrated from the rig's other figures", dict(color="0.3", marker="x"))):
        ax.scatter([], [], label=label, **kw)
    ax.set_yscale("log")
    ax.set_xticks(range(len(order)))
    ax.set_xticklabels([checks[i].figure.id for i in order], rotation=90, fontsize=6)
    ax.set_ylabel("predicted / reported tok/s")
    ax.set_title(f"spark plan --predict-for against {len(figs)} public llama.cpp figures")
    ax.legend(fontsize=7, ncol=3, loc="upper left")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    atomic_write_bytes(path, buf.getvalue(), "--png")
    return drawn


@dataclasses.dataclass(frozen=True)
class Replicate:
    """Two reports of one configuration from different sources: how far public figures disagree
    with each other, whatever a model predicts."""

    kind: str  # "tg" | "pp"
    a: dt.Figure
    b: dt.Figure

    def spread(self) -> float:
        """The faster report over the slower one (>= 1)."""
        x, y = (_speed(fig, self.kind) for fig in (self.a, self.b))
        return max(x, y) / min(x, y)


def _speed(x: dt.Figure, kind: str) -> float:
    return x.tg_tok_s if kind == "tg" else x.pp_tok_s


def _source(x: dt.Figure) -> str:
    """A figure's source: its url without the anchor (a thread, a page, a repository folder)."""
    return x.url.split("#")[0]


def _test(x: dt.Figure, kind: str) -> str | None:
    """The llama-bench test that measured a figure's kind ("tg128", "pp512"); None for another tool."""
    m = re.match(rf"llama-bench ({kind}\d+)\b", x.tg_test if kind == "tg" else x.pp_test)
    return m.group(1) if m else None


def _configuration(x: dt.Figure, kind: str) -> tuple:
    """What two reports must share, besides a file size within SIZE_TOLERANCE, to be of one run: card,
    backend, model's shapes, llama-bench test, placement (and for --n-cpu-moe the host as given), and for
    a prompt its ubatch."""
    host = (x.host_gb_s, x.host_cores) if x.n_cpu_moe else ()
    prompt = (x.prompt_ubatch(),) if kind == "pp" else ()
    return (x.card, x.device().runs(), x.model, x.layers, _test(x, kind), x.n_cpu_moe) + host + prompt


SIZE_TOLERANCE = 0.01  # two files of one configuration: sizes within 1% (log)


def configurations(figs, kind: str) -> list[list[dt.Figure]]:
    """The figures of `kind` measured by llama-bench, by configuration: `_configuration` alike and each
    file within SIZE_TOLERANCE of the configuration's smallest (a figure whose size is not given is
    of no configuration: its file is not known)."""
    by: dict[tuple, list[dt.Figure]] = {}
    for x in figs:
        if _speed(x, kind) and _test(x, kind) and x.size_bytes > 0:
            by.setdefault(_configuration(x, kind), []).append(x)
    out = []
    for xs in by.values():
        xs = sorted(xs, key=lambda x: x.size_bytes)
        while xs:
            same = [x for x in xs if math.log(x.size_bytes / xs[0].size_bytes) <= SIZE_TOLERANCE]
            out.append(same)
            xs = xs[len(same):]
    return out


def replicates(figs) -> list[Replicate]:
    """Every pair of figures of one configuration (`configurations`) read from different sources."""
    return [Replicate(kind, a, b) for kind in dt.KINDS for xs in configurations(figs, kind)
            for i, a in enumerate(xs) for b in xs[i + 1:] if _source(a) != _source(b)]


@dataclasses.dataclass(frozen=True)
class Scatter:
    """One kind's reports of configurations that two or more sources measured: how far they disagree,
    and what that leaves a model."""

    name: str  # decode | prompt
    pair_spreads: list[float]  # each pair's faster over slower, sorted
    sigma: float  # one report's scatter (log): pooled over configurations, a source's reports averaged

    def exact_inside(self) -> float:
        """The share of reports a model that knew each configuration's true speed would find in the band,
        under a log-normal error per report."""
        if self.sigma == 0:
            return 1.0
        lo, hi = dt.BAND
        return 0.5 * (math.erf(math.log(hi) / (self.sigma * math.sqrt(2)))
                      - math.erf(math.log(lo) / (self.sigma * math.sqrt(2))))

    def cells(self) -> list[str]:
        s = self.pair_spreads
        return [self.name, str(len(s)), f"{s[0]:.2f}-{s[-1]:.2f}", f"{statistics.median(s):.2f}",
                f"{self.sigma:.3f}", f"{self.exact_inside():.0%}"]


def pooled_sigma(groups: list[list[float]]) -> float:
    """The scatter of one report (log) from groups of reports of one configuration, one value a source:
    the squared deviations from each group's mean over the groups' degrees of freedom."""
    dev = sum((math.log(v) - sum(map(math.log, g)) / len(g)) ** 2 for g in groups for v in g)
    dof = sum(len(g) - 1 for g in groups)
    return math.sqrt(dev / dof) if dof else 0.0


def scatters(figs) -> list[Scatter]:
    """Per kind, over every configuration two or more sources measured (a source's figures of one
    configuration count once, at their geometric mean)."""
    out = []
    pairs = replicates(figs)
    for kind, name in dt.KINDS.items():
        groups = []
        for xs in configurations(figs, kind):
            by: dict[str, list[float]] = {}
            for x in xs:
                by.setdefault(_source(x), []).append(_speed(x, kind))
            if len(by) > 1:
                groups.append([_geomean(v) for v in by.values()])
        spread = sorted(p.spread() for p in pairs if p.kind == kind)
        if spread:
            out.append(Scatter(name, spread, pooled_sigma(groups)))
    return out


def replicate_summary(figs) -> list[str]:
    """Per kind: the pairs' spread, the scatter of one report it implies, and the share of reports a
    model that knew each configuration's true speed would still find inside the band at that scatter."""
    lo, hi = dt.BAND
    out = []
    for sc in scatters(figs):
        name, n, span, median, sigma, share = sc.cells()
        out.append(f"{name}: {n} pairs of reports of one configuration from different sources, the faster {span}x "
                   f"the slower (median {median}x): one report's scatter {sigma} (log), so an exact model would "
                   f"find about {share} of reports within {lo}-{hi}")
    return out


def replicate_table(figs) -> list[str]:
    out = ["", "| kind | pairs | faster over slower | median | one report's scatter (log) | an exact model inside "
           "the band |", "|---|---|---|---|---|---|"]
    for sc in scatters(figs):
        *cells, share = sc.cells()
        out.append("| " + " | ".join(cells + [f"about {share}"]) + " |")
    out += ["", "| kind | figure | other report of its configuration | faster over slower |", "|---|---|---|---|"]
    return out + [f"| {p.kind} | {p.a.id} | {p.b.id} | {p.spread():.2f} |" for p in replicates(figs)]


def card_records(figs, geos, f: dt.Fit) -> dict[str, list[dt.Record]]:
    """Per card: predicted over reported for its figures all on the card and on the backend Spark builds
    for it (what `--predict-for` prices), decode and prompt, fitted and held out alike."""
    ratios: dict[str, dict[str, list[float]]] = {}
    for x in figs:
        if x.n_cpu_moe or x.device().runs() != dt.card(x.card).runs():
            continue
        c = dt.check(x, geos.get(x.model), f)
        for kind, r in (("tg", c.tg_ratio), ("pp", c.pp_ratio)):
            if r is not None:
                ratios.setdefault(x.card, {}).setdefault(kind, []).append(r)
    lo, hi = dt.BAND
    return {card: [dt.Record(kind, min(rs), max(rs), sum(lo <= r <= hi for r in rs), len(rs))
                   for kind, rs in by.items()] for card, by in sorted(ratios.items())}


def _fit_text(f: dt.Fit) -> str:
    """The [fit] table as the data file keeps it (six significant digits)."""
    return "[fit]\n" + "".join(f"{fl.name} = {getattr(f, fl.name)!r}\n" if isinstance(getattr(f, fl.name), int)
                               else f"{fl.name} = {getattr(f, fl.name):.6g}\n" for fl in dataclasses.fields(f))


def _records_text(records: dict[str, list[dt.Record]]) -> str:
    """Each card's [checked] record as the data file keeps it."""
    if not records:
        return ""
    return ("\n# each card's figures all on the card, on the backend Spark builds for it: predicted over reported, "
            "lowest, highest, inside the band, figures\n" +
            "".join(f"\n[checked.{card}]\n" + "".join(f"{r.kind} = [{r.lo:.2f}, {r.hi:.2f}, {r.inside}, {r.n}]\n"
                                                     for r in rs) for card, rs in records.items()))


def write(f: dt.Fit, figs, geos) -> None:
    """The [fit] table and each card's [checked] record under MARK, the figures above it kept. The records
    are priced with the constants as stored (rounded), so that they are what a reader of the file gets."""
    text = _fit_text(f)
    stored = dt.Fit.from_dict(tomllib.loads(text)["fit"])
    head = DATA.read_text()
    head = head[:head.index(MARK)]
    atomic_write_text(DATA, head + MARK + " from the \"fit\" figures (do not edit by hand below this line)\n" + text
                      + _records_text(card_records(figs, geos, stored)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    how = ap.add_mutually_exclusive_group()
    how.add_argument("--write", action="store_true", help="replace the data file's [fit] table and card records")
    how.add_argument("--records", action="store_true",
                     help="rewrite only each card's [checked] record, from the stored constants (no refit); alone")
    ap.add_argument("--markdown", action="store_true", help="print the table of every figure")
    ap.add_argument("--png", type=Path, help="draw predicted over reported for every figure here")
    a = ap.parse_args(argv)
    if a.records and (a.markdown or a.png):
        ap.error("--records rewrites the card records only: give it alone")
    if a.png:
        try:
            check_output(a.png, "--png", make_parent=True)  # before the fit's half minute
        except SparkError as e:
            print(f"fit_public: {e.one_line()}", file=sys.stderr)
            return 2
    figs = dt.figures()
    geos = {m: load_geometry(build_fixture(m)) for m in {x.model for x in figs if x.model != "dense"}}
    if a.records:
        write(dt.fitted(), figs, geos)
        print(f"wrote {DATA}'s card records from the stored constants")
        return 0
    f = fit(figs, geos, dt.fitted())
    print("\n".join(f"{fl.name} = {getattr(f, fl.name):.6g}" for fl in dataclasses.fields(f)))
    print("\n".join(summary(figs, geos, f)))
    rows = calibrated(figs, geos, f)
    print("\n".join(calibrated_summary(rows)))
    print("\n".join(replicate_summary(figs)))
    if a.markdown:
        print("\n".join(table(figs, geos, f)))
        print("\n".join(calibrated_table(rows)))
        print("\n".join(replicate_table(figs)))
    if a.write:
        write(f, figs, geos)
    if a.png:
        print(f"wrote {a.png} ({chart(figs, geos, f, a.png, rows)} points)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
