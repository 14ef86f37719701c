"""Options and helpers shared by the commands: llama.cpp's model flags, defined once."""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import Any, Callable, List, Optional

import typer
from rich.console import Console

from ..core.chat_template import TemplateSet, from_file, from_flag
from ..core.options import DEFAULT_CTX, LoadFlags
from ..core.profile import profile_path_for
from ..core.simulator import MissPath
from ..errors import UsageError

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)

RPC_HELP = "comma-separated list of RPC servers (HOST:PORT), as llama.cpp's --rpc"
PANEL = "llama.cpp flags"
JSON_HELP = "print the result as JSON on stdout (messages go to stderr)"


def _opt(default: Any, *names: str, **kw: Any) -> Any:
    return typer.Option(default, *names, rich_help_panel=PANEL, **kw)


# name -> (type, typer.Option): the flags of every command that loads a model, as llama.cpp spells them
MODEL_FLAGS: dict[str, tuple[Any, Any]] = {
    "ctx_size": (Optional[int], _opt(None, "--ctx-size", "-c", min=16, show_default=False,
                                     help=f"context size (default: the model's trained context, at most "
                                          f"{DEFAULT_CTX}; with --plan: the plan's)")),
    "threads": (Optional[int], _opt(None, "--threads", "-t", min=1, show_default=False,
                                    help="CPU threads for generation, the CPU miss path's included (default: "
                                         "all cores)")),
    "threads_batch": (Optional[int], _opt(None, "--threads-batch", "-tb", min=1, show_default=False,
                                          help="CPU threads for prompt processing and other multi-token steps "
                                               "(default: --threads)")),
    "type_k": (Optional[str], _opt(None, "--cache-type-k", "-ctk", show_default=False,
                                   help="KV cache type for K: f16, bf16, f32, q8_0, q4_0, q4_1, iq4_nl, q5_0, "
                                        "q5_1 (default: f16, or the plan's)")),
    "type_v": (Optional[str], _opt(None, "--cache-type-v", "-ctv", show_default=False,
                                   help="KV cache type for V (default: f16, or the plan's)")),
    "flash_attn": (str, _opt("auto", "--flash-attn", "-fa", help="flash attention: on, off or auto")),
    "batch_size": (int, _opt(2048, "--batch-size", "-b", min=1, help="logical batch size (tokens per decode call)")),
    "ubatch_size": (Optional[int], _opt(None, "--ubatch-size", "-ub", min=1, show_default=False,
                                        help="physical batch size (default: 512, or the plan's); a prefill "
                                             "ubatch goes through the expert cache when ubatch x k fits its "
                                             "LRU slots")),
    "parallel": (Optional[int], _opt(None, "--parallel", "-np", min=1, max=256, show_default=False,
                                     help="sequences the context holds at once: spark serve's slots, decoded "
                                          "together (-c is split between them unless --kv-unified); the plan "
                                          "prices their KV cache and state (default: 1, or the plan's)")),
    "kv_unified": (Optional[bool], _opt(None, "--kv-unified/--no-kv-unified", "-kvu/-no-kvu", show_default=False,
                                        help="one KV cache shared by every sequence: each may use all of -c "
                                             "(default: off, or the plan's)")),
    "ram": (Optional[str], _opt(None, "--ram", show_default=False,
                                help="RAM the weights may use, e.g. 8GiB (default: the available memory, or the "
                                     "memory cgroup's limit less its usage, less the KV cache and compute "
                                     "buffers). A model bigger than that keeps its non-expert weights and "
                                     "hottest experts in RAM and reads the rest from the model file "
                                     "(-dev none runs)")),
    "no_mmap": (bool, _opt(False, "--no-mmap", help="read the model into memory instead of mapping it")),
    "mlock": (bool, _opt(False, "--mlock", help="keep the model in RAM (no swapping)")),
    "no_repack": (bool, _opt(False, "--no-repack", "-nr", help="disable weight repacking for the CPU (AMX, "
                                                               "AVX layouts)")),
    "device": (Optional[str], _opt(None, "--device", "-dev", show_default=False,
                                   help="comma-separated devices to use (spark devices lists them), or none "
                                        "for the CPU only (default: the first GPU, or the --rpc servers)")),
    "rpc": (Optional[str], _opt(None, "--rpc", show_default=False, help=RPC_HELP)),
    "split_mode": (Optional[str], _opt(None, "--split-mode", "-sm", show_default=False,
                                       help="how to use several devices: layer (each layer, with its experts and "
                                            "banks, on one device, as llama.cpp splits layers) or none (the whole "
                                            "model on the --main-gpu device); row is not supported (default: "
                                            "layer, or the plan's)")),
    "tensor_split": (Optional[str], _opt(None, "--tensor-split", "-ts", show_default=False,
                                         help="proportions of the layers per device, in -dev order, e.g. 3,1 "
                                              "(default: proportional to each device's --vram budget, or the "
                                              "plan's)")),
    "main_gpu": (Optional[int], _opt(None, "--main-gpu", "-mg", show_default=False,
                                     help="with -sm none: the device (index in -dev order) that holds the model "
                                          "(default: 0, or the plan's)")),
    "n_gpu_layers": (Optional[str], _opt(None, "--n-gpu-layers", "-ngl", "--gpu-layers", show_default=False,
                                         help="accepted for llama.cpp's command lines and ignored: Spark places "
                                              "layers and experts itself (--vram, --plan)")),
    "override_tensor": (Optional[List[str]], _opt(None, "--override-tensor", "-ot", show_default=False,
                                                  help="PATTERN=BUFFER[,...]: put matching tensors in that "
                                                       "buffer type (e.g. CPU); experts are Spark's to place")),
}


# old spellings that still work, not shown in --help
HIDDEN_ALIASES = {"--ctx": "--ctx-size", "--system": "--system-prompt"}


def unalias(argv: list[str]) -> list[str]:
    """Old flag spellings (HIDDEN_ALIASES) to the current ones, up to a `--`."""
    out = []
    for i, a in enumerate(argv):
        if a == "--":
            return out + argv[i:]
        name, eq, value = a.partition("=")
        out.append(HIDDEN_ALIASES[name] + eq + value if name in HIDDEN_ALIASES else a)
    return out


def model_flags(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Give a command llama.cpp's model flags (MODEL_FLAGS); it receives them as `flags: LoadFlags`."""
    sig = inspect.signature(fn)
    own = [p for p in sig.parameters.values() if p.name != "flags"]
    added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=opt, annotation=typ)
             for name, (typ, opt) in MODEL_FLAGS.items()]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kw: Any) -> Any:
        got = {name: kw.pop(name) for name in MODEL_FLAGS}
        ngl = got.pop("n_gpu_layers")
        if ngl is not None:
            err_console.print(f"note: -ngl {ngl} ignored: Spark places every layer itself (non-expert weights on "
                              "the device, experts by the plan: --vram or --plan)", soft_wrap=True, markup=False)
        return fn(*args, flags=LoadFlags.from_cli(**got), **kw)

    wrapper.__signature__ = sig.replace(parameters=[
        *(p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own), *added])  # type: ignore[attr-defined]
    wrapper.__annotations__ = {**{k: v for k, v in fn.__annotations__.items() if k != "flags"},
                               **{name: typ for name, (typ, _) in MODEL_FLAGS.items()}}
    return wrapper


def model_or_demo(model: Path | None) -> Path:
    """The model path given, or the built-in demo model (built and cached on first use)."""
    if model is not None:
        return model
    from ..models.demo_model import build_demo_model

    with console.status("building the demo model (first run only) ..."):
        return build_demo_model()


def run_inputs(model: Path | None, *, profile: Path | None = None, plan: Path | None = None,
               trace: Path | None = None, corpus: Path | None = None) -> list[tuple[str, Path | None]]:
    """The files a run reads, for `check_output(..., inputs=)`: no output may replace one of them."""

    return [("model", model), ("profile", profile if profile is not None else
                                (profile_path_for(model) if model is not None else None)),
            ("plan", plan), ("trace", trace), ("corpus", corpus)]


MISS_PATH_HELP = ("where a cached layer computes an expert that is not on the device: auto (per expert and step: "
                  "uploaded for the step or computed on the CPU, whichever is cheaper on this machine, measured "
                  "once and remembered), cpu (computed on the CPU, admitted in the background), upload (uploaded "
                  "and waited for), or layer (the cheaper of cpu and upload per layer, the rule before auto)")


def parse_miss_path(text: str) -> MissPath:
    """--miss-path as its MissPath: the one place the flag's value is checked."""
    try:
        return MissPath(text)
    except ValueError:
        raise UsageError(f"--miss-path: unknown miss path {text!r}", hint="use " + ", ".join(MissPath)) from None


TEMPLATE_FILE_HELP = "Jinja chat template file to use instead of the GGUF's (llama-server's flag)"
JINJA_HELP = "render the GGUF's Jinja chat template (the default when it has one); --no-jinja: llama.cpp's built-in"


CHAT_TEMPLATE_HELP = ("llama.cpp's built-in template by name (chatml, llama3, command-r, ...) or a Jinja "
                      "template's text, instead of the GGUF's (llama-server's flag)")


def chat_templates(template_file: Path | None, jinja: bool, chat_template: str | None = None):
    """--chat-template-file / --chat-template / --jinja as the engine's TemplateSet (None: the GGUF's own)."""

    if template_file is not None:
        return from_file(template_file)
    if chat_template is not None:
        return from_flag(chat_template)
    return None if jinja else TemplateSet({})
