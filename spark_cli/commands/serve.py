"""`spark serve [MODEL]`: an OpenAI-compatible server (llama-server's endpoints) on the
planned placement; the traffic it serves tunes the model's profile. With no MODEL, llama-server's
router mode (serve_router.py)."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from ..core.chat_output import REASONING_FORMATS
from ..core.embedding import POOLINGS, ranks
from ..core.options import LoadFlags
from ..core.reasoning import MODES as REASONING_MODES, ReasoningDefault
from ..errors import SparkError, UsageError
from ..runs import session
from .common import (CHAT_TEMPLATE_HELP, JINJA_HELP, MISS_PATH_HELP, TEMPLATE_FILE_HELP, chat_templates, err_console, model_flags,
                     parse_miss_path)
from .help import SparkCommand
from .serve_router import check_router_flags, run_router


@model_flags
def serve_cmd(
    ctx: typer.Context,
    model: Path = typer.Argument(None, help="GGUF model; none: router mode, as llama-server's: the models of "
                                 "--models-dir, --models-preset and llama.cpp's download cache, each served by a "
                                 "child spark serve started when a request names it", show_default=False),
    plan_path: Path = typer.Option(None, "--plan", help="placement from spark plan -o (default: plan now)"),
    vram_text: str = typer.Option(None, "--vram", help="device budget for planning now, e.g. 16GiB "
                                  "(default: the device's free memory minus a margin)"),
    host: str = typer.Option("127.0.0.1", "--host", help="address to listen on; several, comma-separated: "
                             "one port on each (as llama-server's; with several, :: takes IPv6 only)"),
    port: int = typer.Option(8080, "--port", min=0, max=65535, help="port to listen on (0: any free one)"),
    miss_path: str = typer.Option(None, "--miss-path", help=MISS_PATH_HELP + " (default: the plan's, else auto)",
                                  show_default=False),
    api_key: str = typer.Option(None, "--api-key", envvar="SPARK_API_KEY", show_envvar=True,
                                help="require 'Authorization: Bearer KEY' on every endpoint but /health"),
    allowed_hosts: str = typer.Option(None, "--allowed-hosts", help="comma-separated names a request's Host "
                                      "header may give besides IP addresses, localhost and --host ('*': any); "
                                      "others are refused (DNS rebinding)"),
    cors: str = typer.Option(None, "--cors", help="comma-separated browser origins allowed to call the API "
                             "(e.g. http://localhost:3000; '*': any; localhost: any on this machine, as "
                             "llama-server's --cors-origins localhost); other cross-origin requests are refused"),
    read_timeout: float = typer.Option(30.0, "--read-timeout", min=0.1, help="seconds a client may take to send "
                                       "a whole request (headers and body) before its connection is closed"),
    max_connections: int = typer.Option(256, "--max-connections", min=1, help="open connections at most "
                                        "(fewer under a low ulimit -n); more are answered 503 and closed"),
    max_queue: int = typer.Option(32, "--queue", min=1, help="requests waiting at most; more get 503"),
    learn_every: float = typer.Option(300.0, "--learn-every", min=0.0,
                                      help="seconds between folds of routing counts into the profile "
                                           "(0: only at exit)"),
    learn: bool = typer.Option(True, "--learn/--no-learn", help="fold the served routing into the model's "
                               "profile while serving and on exit"),
    template_file: Path = typer.Option(None, "--chat-template-file", help=TEMPLATE_FILE_HELP),
    chat_template: str = typer.Option(None, "--chat-template", help=CHAT_TEMPLATE_HELP, show_default=False),
    jinja: bool = typer.Option(True, "--jinja/--no-jinja", help=JINJA_HELP),
    reasoning_format: str = typer.Option("auto", "--reasoning-format", help="auto or deepseek: <think> text "
                                         "(and gpt-oss analysis) goes to reasoning_content; none: left inline"),
    reasoning: str = typer.Option("auto", "--reasoning", "-rea", help="thinking in chats: on, off, or auto (on "
                                  "where the template can think), as llama-server's; a request's "
                                  "chat_template_kwargs.enable_thinking or reasoning_effort: none overrides it"),
    reasoning_budget: int = typer.Option(-1, "--reasoning-budget", min=-1, help="thinking tokens at most: -1 no "
                                         "limit, 0 no thinking (the template's no-think form); a positive budget "
                                         "is refused (Spark cannot end thinking midway)"),
    alias: str = typer.Option(None, "--alias", "-a", help="the model's name in /v1/models, /props and responses "
                              "(default: the GGUF's file name); several, comma-separated: all listed as aliases, "
                              "the first in sorted order is the id (as llama-server's)", show_default=False),
    embedding: bool = typer.Option(False, "--embedding", "--embeddings", help="serve /embeddings and /v1/embeddings "
                                   "(as llama-server's); chats and completions are served as before"),
    reranking: bool = typer.Option(False, "--reranking", "--rerank", help="serve /rerank (as llama-server's): "
                                   "pooling rank, for a model with a classifier head (a reranker); another model "
                                   "is refused at start. A dense or encoder reranker (BERT's kind) is served too, "
                                   "for /rerank and /embeddings only: generating gets a 501"),
    pooling: str = typer.Option(None, "--pooling", help="with --embedding: none (a vector per token; "
                                "/embeddings only), mean, cls, last or rank (default: the GGUF's pooling_type, "
                                "else last)", show_default=False),
    slot_save_path: Path = typer.Option(None, "--slot-save-path", help="folder of slot files: POST "
                                        "/slots/N?action=save|restore|erase (as llama-server's); a file restores "
                                        "only into the model that saved it", show_default=False),
    tags: str = typer.Option(None, "--tags", help="comma-separated tags listed with the model in /v1/models",
                             show_default=False),
    context_shift: bool = typer.Option(False, "--context-shift/--no-context-shift", help="llama-server's context "
                                       "shift: when an answer fills its slot's context, half the tokens after the "
                                       "request's n_keep (or its n_discard) are dropped and it goes on (truncated: "
                                       "true). Without it, such an answer stops (finish_reason length, truncated). "
                                       "A model whose cache cannot shift (a recurrent state, M-RoPE: qwen35moe, "
                                       "qwen3next) stops as without it, with a warning at start, as llama-server's"),
    media_path: Path = typer.Option(None, "--media-path", help="llama-server's folder of local media files for "
                                    "multimodal input; accepted, no effect: spark serve takes no images or audio "
                                    "(a request with them gets a 400 either way)", show_default=False),
    cache_ram: int = typer.Option(None, "--cache-ram", min=-1, help="llama-server's host-memory prompt cache (MiB); "
                                  "accepted, no effect on answers: spark serve reuses prompts only from the slots' "
                                  "KV cache", show_default=False),
    cache_idle_slots: bool = typer.Option(True, "--cache-idle-slots/--no-cache-idle-slots", help="llama-server's "
                                          "saving of idle slots to --cache-ram; accepted, no effect (as --cache-ram)"),
    sleep_idle_seconds: int = typer.Option(-1, "--sleep-idle-seconds", help="after this many seconds with no "
                                           "request, free the model (and its expert cache) until the next one "
                                           "loads it again, as llama-server's; /health, /props (is_sleeping), "
                                           "/models and /metrics answer meanwhile without waking it (-1: never)"),
    backend_sampling: bool = typer.Option(False, "--backend-sampling", "-bs", help="llama-server's sampling on "
                                          "the device (experimental there; the same sampler chain, the same "
                                          "tokens); accepted, no effect: Spark samples on the CPU, as a "
                                          "request's backend_sampling"),
    ui_mcp_proxy: bool = typer.Option(False, "--ui-mcp-proxy/--no-ui-mcp-proxy", help="only for llama-server's web "
                                      "UI (its /cors-proxy); spark serve has no web UI: accepted, no effect"),
    n_predict: int = typer.Option(-1, "--n-predict", "-n", min=-1, help="tokens per answer at most when a "
                                  "request gives no max_tokens (-1: until done or the context is full)"),
    temp: float = typer.Option(0.8, "--temp", min=0.0, max=2.0, help="temperature when a request gives none "
                               "(0: greedy)"),
    seed: int = typer.Option(-1, "--seed", "-s", min=-1, max=(1 << 32) - 1,
                             help="sampling seed when a request gives none (-1: random per request)"),
    metrics_on: bool = typer.Option(True, "--metrics/--no-metrics", help="serve GET /metrics (llama-server "
                                    "serves it only with --metrics; Spark by default)"),
    slots_on: bool = typer.Option(True, "--slots/--no-slots", help="serve GET /slots (as llama-server's)"),
    verbose: bool = typer.Option(False, "--verbose", help="every OpenAI answer carries __verbose, llama-server's "
                                 "/completion body of it (the rendered prompt, the raw text; a request's "
                                 "verbose: false leaves it out), as llama-server --verbose"),
    grammar_max_bytes: int = typer.Option(256 * 1024, "--grammar-max-bytes", min=1, help="bytes a request's "
                                          "grammar (raw, or made from a JSON schema) may have"),
    grammar_max_depth: int = typer.Option(64, "--grammar-max-depth", min=1, help="parentheses a grammar, or groups "
                                          "a schema's pattern, may nest"),
    grammar_max_width: int = typer.Option(16, "--grammar-max-width", min=1, help="optional items a grammar may "
                                          "chain (a wide class or . counts 2): each costs the sampler time on "
                                          "every token"),
    models_dir: Path = typer.Option(None, "--models-dir", help="router mode (no MODEL): a folder of GGUF files, "
                                    "each NAME.gguf (or folder NAME holding one) served as model NAME, as "
                                    "llama-server's", show_default=False),
    models_preset: Path = typer.Option(None, "--models-preset", help="router mode: an INI file of models, "
                                       "llama-server's: [NAME] sections whose keys are spark serve's flags "
                                       "(ctx-size = 4096) and the GGUF (model = PATH, or hf-repo = OWNER/NAME[:TAG] "
                                       "from llama.cpp's cache); [*]: keys for every model", show_default=False),
    models_max: int = typer.Option(4, "--models-max", min=0, help="router mode: models loaded at once at most "
                                   "(0: no limit); past it the least recently used idle one is unloaded, and a "
                                   "request waits in line while every model is busy"),
    models_autoload: bool = typer.Option(True, "--models-autoload/--no-models-autoload", help="router mode: load a "
                                         "model when a request names it (--no-models-autoload: a 400 until POST "
                                         "/models/load)"),
    flags: LoadFlags = None,
) -> None:
    """Serve the model over HTTP with OpenAI's API, as llama-server does; with no MODEL, several models
    (router mode: a child server per model, loaded when a request names it)."""
    # NOTE: imported here, not at the top: the server stack (starlette, pydantic, jsonschema) costs
    # spark --help about 0.4 s (python -X importtime)
    from ..serve import server
    from ..serve.chat import Defaults, GrammarLimits
    from ..serve.guard import is_loopback
    from ..serve.vertex import Vertex
    from ..serve.wiring import Access, names, wire

    if api_key is not None and not api_key.strip() or api_key is None and os.environ.get("SPARK_API_KEY") == "":
        where = "--api-key" if api_key is not None else "SPARK_API_KEY"
        raise UsageError(f"{where}: the key is empty (an unset variable?); it would leave the server open",
                         hint="give a key, or drop --api-key and unset SPARK_API_KEY to serve without one")
    miss_choice = parse_miss_path(miss_path) if miss_path is not None else None
    if reasoning_format not in REASONING_FORMATS:
        raise UsageError(f"--reasoning-format {reasoning_format}: expected one of {', '.join(REASONING_FORMATS)}")
    _ = (media_path, cache_ram, cache_idle_slots, ui_mcp_proxy, backend_sampling)  # accepted, no effect (--help)
    if sleep_idle_seconds == 0 or sleep_idle_seconds < -1:
        raise UsageError(f"--sleep-idle-seconds {sleep_idle_seconds}: give a number of seconds, or -1 (never sleep)")
    if pooling is not None and pooling not in POOLINGS:
        raise UsageError(f"--pooling {pooling}: expected one of {', '.join(POOLINGS)}")
    if reasoning not in REASONING_MODES:
        raise UsageError(f"--reasoning {reasoning}: expected one of {', '.join(REASONING_MODES)}")
    if reasoning_budget > 0:
        raise UsageError(f"--reasoning-budget {reasoning_budget}: spark serve cannot end thinking after a number "
                         "of tokens", hint="give -1 (no limit) or 0 (no thinking), or --reasoning off")
    check_router_flags(ctx, model)
    hosts = tuple(h.strip() for h in (allowed_hosts or "").split(",") if h.strip())
    origins = tuple(o.strip() for o in (cors or "").split(",") if o.strip())
    listen = server.hosts(host)
    hosts += tuple(listen[1:])  # NOTE: a Host header may name any address served
    public = [h for h in listen if not is_loopback(h)]
    if not api_key and public:
        err_console.print(f"[yellow]warning:[/] --host {','.join(public)} is reachable from other machines and there "
                          "is no --api-key: anyone who can reach it can use the model", soft_wrap=True)
    if model is None:
        code = run_router(ctx, models_dir=models_dir, models_preset=models_preset, models_max=models_max,
                          autoload=models_autoload, listen=listen, port=port, api_key=api_key, allowed_hosts=hosts,
                          cors=origins, read_timeout=read_timeout, max_connections=max_connections)
        if code:
            raise SparkError("the router's HTTP server stopped", exit_code=code)
        err_console.print("stopped")
        return
    templates = chat_templates(template_file, jinja, chat_template)
    vertex = Vertex.from_env(os.environ)  # AIP_MODE=PREDICTION: Vertex AI's predict route, on AIP_HTTP_PORT
    if vertex is not None and vertex.port != port:
        err_console.print(f"[yellow]warning:[/] AIP_MODE=PREDICTION: serving on AIP_HTTP_PORT {vertex.port}, "
                          f"not --port {port}", soft_wrap=True)
        port = vertex.port
    path = model
    # NOTE: a dense model only to rerank (no MoE arch in llama.cpp has a classifier head); it generates nothing
    geometry = session.open_geometry(path, require_moe=not ranks(pooling, reranking))
    info = session.load_profile(path, geometry)
    if info.warning():
        err_console.print(f"[yellow]warning:[/] {info.warning()}", soft_wrap=True, markup=False)
    where = session.resolve_placement(path, geometry, info, flags, plan_path=plan_path, vram_text=vram_text,
                                      miss_path=miss_choice)
    for w in where.warnings:
        err_console.print(f"warning: {w}", soft_wrap=True, markup=False)
    served = wire(path, geometry, where, flags, Access(api_key or None, listen[0], hosts, origins),
                  templates=templates, chat_defaults=Defaults(temp, seed, n_predict, verbose),
                  reasoning_format=reasoning_format, thinking=ReasoningDefault(reasoning, reasoning_budget),
                  alias=alias, tags=names(tags), slot_save_path=slot_folder(slot_save_path), embedding=embedding or reranking or pooling is not None, pooling=pooling,
                  reranking=reranking, context_shift=context_shift, learn=learn, learn_every=learn_every,
                  max_queue=max_queue, metrics=metrics_on, slots=slots_on, vertex=vertex,
                  grammar_limits=GrammarLimits(grammar_max_bytes, grammar_max_depth, grammar_max_width),
                  on_why=lambda why: err_console.print(f"[dim]{why}[/]", soft_wrap=True),
                  sleep_idle=sleep_idle_seconds if sleep_idle_seconds > 0 else None)
    socks = server.bind_all(listen, port)
    bound_port = socks[0].getsockname()[1]
    urls = ", ".join(f"http://{server.url_host(s.getsockname()[0])}:{bound_port}/v1" for s in socks)
    device = f"{where.devices[0].name}" if where.devices else f"CPU ({where.cpu_reason})"
    placement = (f"{len(served.cached)} cached MoE layers, plan {where.budget_source}" if where.plan is not None
                 else "stock CPU path")
    err_console.print(f"loading {path.name} on {device}: {placement}, context {where.n_ctx} ...", soft_wrap=True)

    def ready() -> None:
        n_slots = len(served.worker.slots)
        err_console.print(f"spark serve: {path.name} on {urls} "
                          f"({n_slots} slot{'s' if n_slots != 1 else ''}, queue {max_queue}; "
                          f"{'learning' if learn else 'not learning'}; Ctrl-C stops)", soft_wrap=True)

    # NOTE: a router's child (SPARK_ROUTER_PORT) stops when the router's end of its stdin closes: no orphans
    out = server.serve(served.state, served.learner, socks, on_ready=ready, read_timeout=read_timeout,
                       max_connections=max_connections, watch_stdin=bool(os.environ.get("SPARK_ROUTER_PORT")))
    if out.folded_tokens:
        err_console.print(f"[dim]learned: {out.folded_tokens:.0f} decode tokens folded into "
                          f"{session.profile_path_for(path).name}[/]", soft_wrap=True)
    if out.code:
        prefix = "the engine failed: " if out.code == 1 else ""
        raise SparkError(prefix + (out.message or "the server stopped"), exit_code=out.code)
    err_console.print("stopped")


def slot_folder(path: Path | None) -> Path | None:
    """--slot-save-path: the folder, made if missing; UsageError when it cannot be one."""
    if path is None:
        return None
    path = path.expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--slot-save-path {path}: {e.strerror or e}", hint="give a folder spark serve may write") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"--slot-save-path {path}: not writable", hint="give a folder spark serve may write")
    return path


def register(app: typer.Typer) -> None:
    app.command("serve", cls=SparkCommand)(serve_cmd)
