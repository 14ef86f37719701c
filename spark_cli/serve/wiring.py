"""`spark serve`'s wiring: the engine options, the worker that opens the engine, the server state
and the chat configuration of one model on its placement. The command parses flags and prints;
this builds what `server.serve` runs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..core.chat_template import TemplateSet
from ..core.embedding import cannot_generate, choose_pooling
from ..core.gguf_info import ModelGeometry
from ..core.options import LoadFlags
from ..core.reasoning import ReasoningDefault
from ..native.engine import EngineOptions
from ..runs import session
from ..runs.miss_path import initial_path
from ..runs.run import open_engine
from ..runs.session import Placement
from .app import ServerState
from .chat import ChatConfig, Defaults, GrammarLimits
from .learn import Learner
from .stats import ServerStats
from .vertex import Vertex
from .worker import Worker


@dataclass(frozen=True)
class Access:
    """Who may call the server: --api-key, the bound --host, --allowed-hosts, --cors."""

    api_key: str | None
    host: str
    allowed_hosts: tuple[str, ...] = ()
    cors: tuple[str, ...] = ()


@dataclass
class Served:
    """What `server.serve` runs: the state the routes read, the learner it folds with."""

    state: ServerState
    learner: Learner
    worker: Worker
    cached: set[int]  # the cached MoE layers


def engine_options(path: Path, geometry: ModelGeometry, where: Placement, flags: LoadFlags,
                   learn: bool) -> EngineOptions:
    opts = session.engine_options(path, geometry, where.plan, flags, n_ctx=where.n_ctx, learn=learn)
    # NOTE: auto starts on the cpu path; miss_path.resolve then calibrates and sets each layer
    start = initial_path(where.miss_path)
    opts.cache_layers = [dataclasses.replace(c, miss_path=start) for c in opts.cache_layers]
    return session.with_ram_tier(opts, where.ram, geometry, where.ahead, where.mapped)


def placement_summary(where: Placement, cached: set[int]) -> dict[str, Any]:
    """What /props reports of where the model runs."""
    plan = where.plan
    if plan is None:
        return {"device": "cpu", "why": where.cpu_reason, "cached_moe_layers": 0}
    return {"device": where.devices[0].name if where.devices else "cpu", "cached_moe_layers": len(cached),
            "budget": where.budget_source, "miss_path": where.miss_path,
            "planned_device_bytes": int(plan.breakdown["total"])}


def wire(path: Path, geometry: ModelGeometry, where: Placement, flags: LoadFlags, access: Access, *,
         templates: TemplateSet | None, chat_defaults: Defaults, reasoning_format: str, alias: str | None,
         thinking: ReasoningDefault = ReasoningDefault(), tags: tuple[str, ...] = (), embedding: bool = False,
         pooling: str | None = None, reranking: bool = False, slot_save_path: Path | None = None,
         context_shift: bool = False,
         learn: bool, learn_every: float, max_queue: int, metrics: bool, slots: bool, vertex: Vertex | None,
         on_why: Callable[[str], None], grammar_limits: GrammarLimits = GrammarLimits(),
         sleep_idle: float | None = None) -> Served:
    """The server of `path` on `where`: its engine opens in the worker (each cached layer on the
    placement's miss path), its chat format comes from the templates (--chat-template-file, else
    the GGUF's); `sleep_idle`: seconds idle before the engine is freed, to open again the same way;
    `context_shift`: llama-server's --context-shift, where the model's cache can shift (else a warning)."""
    opts = engine_options(path, geometry, where, flags, learn)
    opts.chat_templates = templates
    if embedding:
        opts.pooling = choose_pooling(pooling, reranking, geometry.pooling_type, geometry.has_classifier, path.name)
    cached = {c.il for c in opts.cache_layers}
    plan = where.plan
    stats = ServerStats(cached_layers=cached, planned_bytes=int(plan.breakdown["total"]) if plan else 0)
    learner = Learner(path, geometry, interval=learn_every, enabled=learn)
    warned: list[str] = []  # NOTE: the engine opens again after each sleep: the warning is said once

    def opened() -> Any:
        engine = open_engine(opts, where.miss_path, geometry.fingerprint, on_why=on_why)
        if context_shift and not engine.can_shift and not warned:
            warned.append("context-shift")
            on_why(f"warning: --context-shift: the KV cache of {path.name} ({geometry.arch}) cannot shift (a "
                   "recurrent state or M-RoPE): an answer that fills the context stops, as without it")
        return engine

    worker = Worker(opened, cached, stats, learner, max_queue=max_queue, sleep_idle=sleep_idle,
                    no_generation=cannot_generate(geometry.arch, geometry.causal, bool(geometry.moe_layers), path.name),
                    context_shift=context_shift)
    chat = ChatConfig.for_model(templates if templates is not None else TemplateSet(dict(geometry.chat_templates)),
                                geometry.arch, reasoning_format, defaults=chat_defaults,
                                grammar_limits=grammar_limits, thinking=thinking)
    aliases = names(alias)
    state = ServerState(worker, stats, aliases[0] if aliases else path.name, api_key=access.api_key, host=access.host,
                        allowed_hosts=access.allowed_hosts, cors=access.cors, chat=chat, model_path=str(path),
                        placement=placement_summary(where, cached), metrics=metrics, slots_endpoint=slots,
                        vertex=vertex, meta={"n_ctx_train": geometry.context_length, "n_embd": geometry.n_embd,
                                             "size": geometry.file_size},
                        aliases=aliases, tags=tags, pooling=opts.pooling, slot_save_path=slot_save_path,
                        model_id=geometry.fingerprint)
    return Served(state, learner, worker, cached)


def names(text: str | None) -> tuple[str, ...]:
    """--alias or --tags: comma-separated names, sorted and once each (llama-server's: the model's
    id is the first alias in that order)."""
    return tuple(sorted({n.strip() for n in (text or "").split(",") if n.strip()}))
