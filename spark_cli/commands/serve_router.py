"""`spark serve` with no MODEL: router mode's command side. It reads the models' sources, turns the
router's own command line into the flags every child gets (and spark serve's flags into the keys a
--models-preset may set), and runs serve/router.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from ..errors import UsageError
from .common import err_console

# spark serve's parameters that are the router's own: never a child's flag, nor a preset key
ROUTER_ONLY = ("models_dir", "models_preset", "models_max", "models_autoload")
NOT_PASSED = {"model", "host", "port", "api_key", "allowed_hosts", "cors", *ROUTER_ONLY}
# flags that name one model: refused in router mode (a preset section gives them per model)
ONE_MODEL = {"plan_path": "--plan", "alias": "--alias", "tags": "--tags"}
# runs `spark` in a child (then: serve MODEL ...), from this Python and this spark_cli
LAUNCHER = (sys.executable, "-c", "from spark_cli.cli import run; run()")


def _long(names: list[str]) -> str:
    return next((n for n in names if n.startswith("--")), names[0])


def _options(command: Any) -> list[Any]:
    """The command's options (typer vendors click: its classes are duck-typed here)."""
    return [p for p in command.params if getattr(p, "param_type_name", "") == "option" and p.name]


def _on_command_line(ctx: Any, name: str) -> bool:
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "COMMANDLINE"


def flag_specs(command: Any) -> dict[str, Any]:
    """Every spelling of spark serve's flags without its dashes (ctx-size, c, no-jinja) -> its FlagSpec:
    the keys a --models-preset section may set."""
    from ..serve.router_models import FlagSpec

    specs: dict[str, FlagSpec] = {}
    for p in _options(command):
        if p.name in NOT_PASSED or p.name in ONE_MODEL:
            continue
        flag = _long(p.opts)
        if p.is_flag:
            off = _long(p.secondary_opts) if p.secondary_opts else None
            specs.update({o.lstrip("-"): FlagSpec(p.name, flag, True, off) for o in p.opts})
            specs.update({o.lstrip("-"): FlagSpec(p.name, flag, True, off, negated=True) for o in p.secondary_opts})
        else:
            specs.update({o.lstrip("-"): FlagSpec(p.name, flag) for o in p.opts})
    return specs


def given_flags(ctx: Any) -> dict[str, tuple[str, ...]]:
    """The flags given on the router's command line, by parameter, as a child's argv (NOT_PASSED
    left out): what every child gets, over its preset's."""
    out: dict[str, tuple[str, ...]] = {}
    for p in _options(ctx.command):
        if p.name in NOT_PASSED or not _on_command_line(ctx, p.name):
            continue
        value, flag = ctx.params.get(p.name), _long(p.opts)
        if p.is_flag:
            off = _long(p.secondary_opts) if p.secondary_opts else None
            out[p.name] = (flag,) if value else ((off,) if off else ())
        elif p.multiple:
            out[p.name] = tuple(a for v in (value or ()) for a in (flag, str(v)))
        elif value is not None:
            out[p.name] = (flag, str(value))
    return out


def check_router_flags(ctx: Any, model: Path | None) -> None:
    """Router flags need router mode (no MODEL); flags that name one model are refused in it."""
    set_on_cli = {n for n in ctx.params if _on_command_line(ctx, n)}
    if model is not None:
        for name in ROUTER_ONLY:
            if name in set_on_cli:
                flag = _long(next(p for p in ctx.command.params if p.name == name).opts)
                raise UsageError(f"{flag}: only in router mode (spark serve with no MODEL)",
                                 hint=f"drop {flag}, or the MODEL to serve several models")
        return
    for name, flag in ONE_MODEL.items():
        if name in set_on_cli:
            raise UsageError(f"{flag}: names one model; router mode (no MODEL) serves several",
                             hint="give it per model in a --models-preset section, or serve one MODEL")


def run_router(ctx: Any, *, models_dir: Path | None, models_preset: Path | None, models_max: int, autoload: bool,
               listen: list[str], port: int, api_key: str | None, allowed_hosts: tuple[str, ...],
               cors: tuple[str, ...], read_timeout: float, max_connections: int) -> int:
    """Router mode: the models found, the children's flags, the sockets bound, served until a signal."""
    from ..serve import router, router_models
    from ..serve.listen import bind_all, url_host
    from ..serve.protocol import build_fingerprint
    from ..serve.router_pool import PoolConfig

    sources = router_models.Sources(router_models.llama_cache_dir(), models_dir, models_preset)
    specs = flag_specs(ctx.command)

    def discover() -> dict[str, router_models.RouterModel]:
        return router_models.discover(sources, specs)

    models = discover()
    startup = [m.name for m in models.values() if m.load_on_startup]
    if models_max > 0 and len(startup) > models_max:
        raise UsageError(f"--models-preset {models_preset}: {len(startup)} models to load on startup, over "
                         f"--models-max {models_max}")
    if os.environ.get("AIP_MODE") == "PREDICTION":
        err_console.print("[yellow]warning:[/] AIP_MODE=PREDICTION: Vertex AI's predict route is not served in "
                          "router mode (serve one MODEL for it)", soft_wrap=True)
    socks = bind_all(listen, port)
    bound = socks[0].getsockname()[1]
    root = str(Path(__file__).resolve().parents[2])  # NOTE: the children import this spark_cli, not another
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}

    def log(line: str) -> None:
        err_console.print(f"spark serve: {line}", soft_wrap=True, markup=False, highlight=False)

    pool = PoolConfig(LAUNCHER, given_flags(ctx), models_max,
                      fake_timing=bool(os.environ.get("LLAMA_SERVER_DEBUG_FAKE_TIMING")), router_port=bound, env=env,
                      log=log)
    config = router.RouterConfig(sources, discover, pool, autoload=autoload, build_info=build_fingerprint(),
                                 api_key=api_key, host=listen[0], allowed_hosts=allowed_hosts, cors=cors,
                                 read_timeout=read_timeout, max_connections=max_connections)
    urls = ", ".join(f"http://{url_host(s.getsockname()[0])}:{bound}/v1" for s in socks)
    listed = [m.name for m in models.values() if not m.hidden]
    where = ", ".join(f"{k} {v}" for k, v in (("--models-dir", models_dir), ("--models-preset", models_preset),
                                              ("llama.cpp's cache", sources.cache)) if v is not None)

    def ready() -> None:
        shown = ", ".join(listed[:6]) + (f" and {len(listed) - 6} more" if len(listed) > 6 else "")
        err_console.print(f"spark serve: router on {urls}: {len(listed)} model{'s' if len(listed) != 1 else ''} "
                          f"({shown or 'none: give a MODEL to serve one, or --models-dir DIR'}; from {where}), at most "
                          f"{models_max if models_max > 0 else 'any number'} loaded at once"
                          f"{'' if autoload else ', loaded by POST /models/load only'}; Ctrl-C stops",
                          soft_wrap=True, markup=False)

    return router.serve_router(config, models, socks, on_ready=ready)
