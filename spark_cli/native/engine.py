"""A small engine over llama.cpp's low-level API: devices, tensor overrides, the expert cache.

llama-cpp-python's `Llama` class exposes neither `model_params.devices` nor
`tensor_buft_overrides`; this engine owns the model and context itself.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from . import devices as devices_mod
from . import faults, llama_lib
from ..core import split as split_mod
from ..core import vram
from ..errors import DeviceError, ModelFileError, NativeError, SparkError, UsageError
from ..core.capture import TopkRecord
from ..core.trace import DECODE, PREFILL
from .generate import GenerationStep, NativeSampler, stream_generate
from .cache_control import CacheControl
from .expert_cache import CacheLayer, ExpertCache
from .vocab import Vocab
from . import embed as embed_mod
from . import seq_state as seq_state_mod
from .embed import POOLING
from ..core.chat_template import TemplateSet
from ..core.gguf_info import ModelGeometry, load_geometry
from ..core.placement import CPU, HOST, TensorOverride, cached_expert_overrides, stock_overrides

class KVFullError(SparkError):
    """llama_decode found no room in the KV cache for a batch (it evaluated nothing)."""


FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}  # enum llama_flash_attn_type
LOAD_MODE_NONE, LOAD_MODE_MLOCK, LOAD_MODE_MMAP_MLOCK = 0, 2, 3  # enum llama_load_mode


def repack_is_safe() -> bool:
    """False on CPUs that advertise AMX: ggml's AMX weight buffer (an extra buffer type) crashes
    in its matmul there (seen in a VM), so weights keep the plain layout. SPARK_REPACK=1 forces it."""
    env = os.environ.get("SPARK_REPACK")
    if env is not None:
        return env not in ("", "0")
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return "amx_tile" not in line.split()
    except OSError:
        pass
    return True




@dataclass
class EngineOptions:
    model_path: Path
    n_ctx: int = 2048
    n_batch: int = 512
    n_ubatch: int = 512
    n_seq: int = 1                     # -np: sequences the context holds (llama.cpp's n_seq_max)
    kv_unified: bool = False           # -kvu: one KV buffer for every sequence (else n_ctx / n_seq each)
    n_threads: int | None = None        # -t: decode steps (None: all cores)
    n_threads_batch: int | None = None  # -tb: multi-token steps (None: n_threads)
    device: str | None = None          # -dev: device names, comma-separated, or none (see devices.py)
    rpc: list[str] = field(default_factory=list)
    tensor_split: tuple[float, ...] | None = None  # -ts: layer proportions per device (None: llama.cpp's, by free memory)
    split_mode: str = "layer"          # -sm layer | none (row, tensor: refused; core/split.py)
    main_gpu: int = 0                  # -mg: the device -sm none keeps, among the selected ones
    host_layers: list[int] = field(default_factory=list)  # stock --n-cpu-moe: these layers' experts on the CPU
    cache_layers: list[CacheLayer] = field(default_factory=list)
    expert_overrides: tuple[TensorOverride, ...] | None = None  # a plan's; None: derived from cache_layers
    tensor_overrides: tuple[TensorOverride, ...] = ()  # -ot pass-through (expert-free tensors)
    count_experts: bool = False        # native routing counters without a cache
    trace: bool = False                # native trace of routed ids
    trace_uncached: bool = True        # with trace: layers not cached are traced too (a counting stop each)
    trace_max: int | None = None       # trace capacity (None: the library's default)
    capture_topk: bool = False         # eval-callback capture of ffn_moe_topk-<il> (no native needed)
    capture_scores: bool = False       # with capture_topk: each record's selection scores (ffn_moe_probs*)
    capture_hidden: str | None = None  # eval-callback capture of f32 tensors `<name>-<il>` (e.g. ffn_norm)
    # NOTE: one value for every device; 0 (each device's own free memory less a margin) is the right
    # one over several devices: the plan checks each device against its own budget before this
    device_budget: int = 0             # bytes the expert banks may take per device (0: its free memory)
    stage_slices: int = 0              # staging slices per expert shape (a plan's stage_slices)
    # the file tier (--ram): cached layers on the CPU hold their slots in RAM and read misses from the
    # model file (preads, file_readers in flight); host_budget: bytes those RAM banks may take
    file_tier: bool = False
    file_readers: int = 4
    host_budget: int = 0
    read_ahead: int = 0                # experts of the next RAM-tier layer read ahead per decode step (0: off)
    ahead_min_prob: int = 0            # ... at a predicted chance of at least this (fixed point, 1 << 16 = 1)
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: str = "auto"           # -fa on|off|auto
    use_mmap: bool = True
    use_mlock: bool = False
    repack: bool = True                # allow CPU weight repacking where no cache needs plain layout
    dry_run: bool = False              # llama.cpp's no_alloc: metadata only, nothing allocated or read (memory_breakdown)
    chat_templates: TemplateSet | None = None  # None: the GGUF's own; empty: llama.cpp's built-in matcher
    pooling: str | None = None         # --embedding's pooling (native/embed.POOLING); None: no embeddings

    @property
    def threads(self) -> int:
        """CPU threads of decode steps (-t): llama.cpp's and the CPU miss path's."""
        return self.n_threads or os.cpu_count() or 1

    @property
    def threads_batch(self) -> int:
        """CPU threads of multi-token steps (-tb; default -t)."""
        return self.n_threads_batch or self.threads




# the selection scores a MoE layer ranks (not the views llama.cpp derives from them, "... (reshaped)")
_SCORES_RE = re.compile(rb"ffn_moe_probs(?:_biased|_masked)?-\d+")
# a layer's routed ids; the scheduler's copies of it ("ffn_moe_topk-29 (copy)", the same ids on
# another backend) are not asked for: each step's ids are read once
_TOPK_RE = re.compile(rb"ffn_moe_topk-(\d+)")
_OVERRIDE_RE = re.compile(r"tensor (?P<name>\S+) \(.*\) buffer type overridden to (?P<buft>\S+)")
_SPLITS_RE = re.compile(r"graph.*: nodes = [^,]+, splits = (\d+)(?: / (\d+))?,")
_LAYER_DEV_RE = re.compile(r"load_tensors: layer\s+(?P<il>\d+) assigned to device (?P<dev>[^,\s]+)")
_BUFFER_RE = re.compile(r"(?P<buf>\S+)\s+(?P<kind>model|KV|RS|compute|output) buffer size\s*=\s*(?P<mib>[\d.]+) MiB")


class _Logs:
    """llama.cpp log lines, kept (not printed) so errors can quote the last one."""

    def __init__(self) -> None:
        self.lines: deque[str] = deque(maxlen=200)
        self.capture: list[str] | None = None  # every line while an engine loads
        self.reserve: list[str] | None = None  # the scheduler's graph summaries of the open engine
        self.verbose = bool(os.environ.get("SPARK_VERBOSE"))
        self._partial = ""

    def __call__(self, level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        s = self._partial + text.decode(errors="replace")
        *done, self._partial = s.split("\n")
        for line in done:
            self.lines.append(line)
            if self.capture is not None:
                self.capture.append(line)
            if self.reserve is not None and line.startswith("sched_reserve: graph"):
                self.reserve.append(line)
            if self.verbose:
                print(line, file=sys.stderr)


    def last_error(self) -> str:
        for line in reversed(self.lines):
            if "error" in line.lower() or "failed" in line.lower():
                return line.strip()
        return self.lines[-1].strip() if self.lines else ""


_logs = _Logs()
_log_cb = None
_lock = threading.Lock()


def _install_logger(lc) -> None:
    global _log_cb
    with _lock:
        if _log_cb is None:
            _log_cb = lc.llama_log_callback(_logs)
            lc.llama_log_set(_log_cb, ctypes.c_void_p(0))


class Engine:
    """A loaded model and context. Use as a context manager or call close()."""

    def __init__(self, opts: EngineOptions):
        self.opts = opts
        self.lib = llama_lib.load()
        faults.install(self.lib.libdir)  # a lost device: one line, kept counts, no backtrace
        lc = self.lib.lc
        _install_logger(lc)
        self.model = None
        self.ctx = None
        self.cache = CacheControl(None, 0, lambda: self.geometry.n_expert, opts.cache_layers)
        self._load_log: list[str] = []  # llama.cpp's log while loading (debug level included)
        self._reserve_log: list[str] = []  # the scheduler's graph summaries, at load and whenever it reserves again
        self._batch = None
        self._keep: list[object] = []
        self.records: list[TopkRecord] = []
        self.hidden: list[tuple[int, np.ndarray]] = []  # capture_hidden: (layer, [n_tokens, n_embd] f32)
        self._pos = [0]  # per sequence: positions held (the next token's position)
        self._last_il = 1 << 30  # eval-callback capture: layer seen last, to find ubatch starts
        self._scores: np.ndarray | None = None  # capture_scores: the last ffn_moe_probs* tensor seen
        self._ubatch_tokens = 0

        path = Path(opts.model_path)
        if not path.is_file():
            raise ModelFileError(f"{path}: no such model file", hint="pass the path of a .gguf file")
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ModelFileError(f"{path}: not a GGUF file")
        self._geometry: ModelGeometry | None = None
        # checked before anything is loaded
        type_k = vram.kv_type(opts.type_k, "--cache-type-k").ggml_id
        type_v = vram.kv_type(opts.type_v, "--cache-type-v").ggml_id
        if opts.flash_attn not in FLASH_ATTN:
            raise UsageError(f"--flash-attn {opts.flash_attn}: expected on, off or auto")

        selected = devices_mod.select(devices_mod.parse(opts.device, opts.rpc))
        mode = split_mod.parse_split_mode(opts.split_mode)
        if selected and not 0 <= opts.main_gpu < len(selected):
            raise UsageError(f"--main-gpu {opts.main_gpu}: {len(selected)} device{'s' * (len(selected) != 1)} selected")
        # -sm none: llama.cpp keeps the main device alone (llama_prepare_model_devices)
        self.devices = [selected[opts.main_gpu]] if mode == "none" and selected else selected
        mp = lc.llama_model_default_params()
        dev_arr = (ctypes.c_void_p * (len(selected) + 1))(*[d.handle for d in selected], None)
        self._keep.append(dev_arr)
        mp.devices = ctypes.cast(dev_arr, ctypes.c_void_p)
        mp.n_gpu_layers = -1 if self.devices else 0
        mp.split_mode, mp.main_gpu = split_mod.SPLIT_MODES[mode], opts.main_gpu
        if opts.tensor_split and len(selected) > 1:
            n_max = int(lc.llama_max_devices())
            if len(opts.tensor_split) > min(n_max, len(selected)):
                raise UsageError(f"--tensor-split: {len(opts.tensor_split)} proportions for {len(selected)} devices")
            ts = (ctypes.c_float * n_max)(*opts.tensor_split)
            self._keep.append(ts)
            mp.tensor_split = ts
        self._set_overrides(mp, self._overrides())
        # NOTE: the cache copies expert slices byte for byte: host weights must keep plain layout
        # (the file tier overrides its experts to the plain CPU type, so the other weights may repack)
        mp.use_extra_bufts = bool(opts.repack and (not opts.cache_layers or opts.file_tier) and repack_is_safe())
        if opts.use_mlock or not opts.use_mmap:  # else llama.cpp's default (auto: mmap)
            mp.load_mode = ((LOAD_MODE_MMAP_MLOCK if opts.use_mmap else LOAD_MODE_MLOCK) if opts.use_mlock
                            else LOAD_MODE_NONE)
        if opts.dry_run:  # NOTE: no_alloc maps nothing: llama.cpp asserts on mmap (common/fit.cpp does the same)
            mp.no_alloc, mp.load_mode = True, LOAD_MODE_NONE
        _logs.capture = self._load_log
        _logs.reserve = self._reserve_log
        try:
            self._load(path, mp, opts, type_k, type_v)
        finally:
            _logs.capture = None
        if opts.cache_layers or opts.count_experts or opts.trace:
            self._init_cache()

    # -- set-up ---------------------------------------------------------------------------

    def _load(self, path: Path, mp, opts: EngineOptions, type_k: int, type_v: int) -> None:
        lc = self.lib.lc
        self.model = lc.llama_model_load_from_file(os.fsencode(path), mp)
        if not self.model:
            raise ModelFileError(f"{path}: llama.cpp could not load it ({_logs.last_error() or 'see SPARK_VERBOSE=1'})")
        self.vocab = Vocab(lc, self.model, lambda: self.geometry, opts.chat_templates)
        self.n_vocab = self.vocab.n_tokens
        self.n_layer = lc.llama_model_n_layer(self.model)

        cp = lc.llama_context_default_params()
        cp.n_ctx = opts.n_ctx
        cp.n_batch = opts.n_batch
        cp.n_ubatch = min(opts.n_ubatch, opts.n_batch)
        cp.n_threads, cp.n_threads_batch = self.cpu_threads, self.cpu_threads_batch
        cp.no_perf = False
        cp.type_k, cp.type_v = type_k, type_v
        cp.flash_attn_type = FLASH_ATTN[opts.flash_attn]
        # NOTE: llama-server's default, and the planner's bill: sliding-window layers keep the window
        # plus one ubatch, not n_ctx (the C default, swa_full, allocates n_ctx cells for them too)
        cp.swa_full = False
        cp.n_seq_max, cp.kv_unified = max(1, opts.n_seq), bool(opts.kv_unified)
        if opts.pooling is not None:
            cp.pooling_type = POOLING[opts.pooling]  # NOTE: embeddings are switched on per request (native/embed.py)
        if self.devices and any(c.in_ram for c in opts.cache_layers):
            # NOTE: a RAM bank is a view to its arena's end (the staging slices): op offload of a prompt's
            # expert matmuls would copy the whole arena to the device per layer; the RAM tier's run on the CPU
            cp.op_offload = False
        if opts.capture_topk or opts.capture_hidden:
            self._cb = lc.ggml_backend_sched_eval_callback(self._on_eval)
            cp.cb_eval = self._cb
            cp.cb_eval_user_data = None
        self.ctx = lc.llama_init_from_model(self.model, cp)
        if not self.ctx:
            self.close()
            why = _logs.last_error()
            if opts.type_v not in (None, "f16", "f32", "bf16") and opts.flash_attn != "on":
                raise UsageError(f"-ctv {opts.type_v}: a quantized V cache needs flash attention, which "
                                 f"llama.cpp did not enable ({why})", hint="add -fa on, or use -ctv f16")
            raise SparkError(f"{path}: could not create a context of {opts.n_ctx} tokens ({why})",
                             hint="try a smaller --ctx-size")
        # NOTE: llama.cpp rounds n_ctx up (to 256) and caps n_batch at the requested -c: feed and
        # check prompts with the context's own figures, never the options'
        # NOTE: n_ctx is what one sequence may hold (llama.cpp's n_ctx_seq: -c / -np, or all of -c
        # with --kv-unified); n_ctx_total the cells of every sequence together
        self.n_ctx_total = lc.llama_n_ctx(self.ctx)
        self.n_seq = lc.llama_n_seq_max(self.ctx)
        self.n_ctx = lc.llama_n_ctx_seq(self.ctx)
        self._pos = [0] * self.n_seq
        self.n_batch = max(1, min(lc.llama_n_batch(self.ctx), opts.n_batch))
        self.n_ubatch = max(1, min(lc.llama_n_ubatch(self.ctx), self.n_batch))
        self._batch = lc.llama_batch_init(self.n_batch, 0, 1)
        native = ExpertCache(self.lib.expert_cache, self.ctx) if self.lib.expert_cache is not None else None
        self.cache = CacheControl(native, self.n_layer, lambda: self.geometry.n_expert, opts.cache_layers)

    @property
    def geometry(self) -> ModelGeometry:
        if self._geometry is None:
            self._geometry = load_geometry(self.opts.model_path, require_moe=False)
        return self._geometry

    def _overrides(self) -> list[TensorOverride]:
        """Expert placement (the plan's, or derived from the cached and stock layers), then -ot."""
        o = self.opts
        if not self.devices:
            # NOTE: the file tier's layers keep plain, mapped expert tensors (never repacked into RAM)
            ram = cached_expert_overrides(self.geometry, [c.il for c in o.cache_layers]) if o.file_tier else ()
            return [*ram, *o.tensor_overrides]
        placed = o.expert_overrides
        if placed is None:
            # NOTE: a layer in the RAM tier keeps its experts on the CPU, as a stock host layer
            in_ram = {c.il for c in o.cache_layers if c.in_ram}
            stock = sorted((set(o.host_layers) - {c.il for c in o.cache_layers}) | in_ram)
            cached = [c.il for c in o.cache_layers if not c.in_ram]
            placed = (cached_expert_overrides(self.geometry, cached) if cached else ()) + stock_overrides(stock)
        return [*placed, *o.tensor_overrides]

    def _buffer_type(self, target: str) -> int:
        lib = self.lib
        if target == HOST:
            # NOTE: cached experts live in the device's pinned host memory where it has one (faster uploads)
            return (lib.dev_host_buffer_type(self.devices[0].handle) if self.devices else None) or lib.cpu_buffer_type()
        if target == CPU:
            return lib.cpu_buffer_type()
        names = {}
        for d in llama_lib.devices():
            buft = lib.dev_buffer_type(d.handle)
            if buft:
                names[lib.buft_name(buft).decode()] = buft
        if target not in names:
            raise DeviceError(f"-ot ...={target}: no buffer type named {target}",
                              hint="use CPU or one of " + ", ".join(names))
        return names[target]

    def _set_overrides(self, mp, overrides: list[TensorOverride]) -> None:
        if not overrides:
            return
        ov = (llama_lib.BuftOverride * (len(overrides) + 1))()
        for i, o in enumerate(overrides):
            b = o.pattern.encode()
            self._keep.append(b)
            ov[i] = llama_lib.BuftOverride(b, self._buffer_type(o.target))
        ov[len(overrides)] = llama_lib.BuftOverride(None, None)
        self._keep.append(ov)
        mp.tensor_buft_overrides = ctypes.cast(ov, ctypes.c_void_p)

    def _init_cache(self) -> None:
        if self.cache.native is None:
            self.close()
            raise NativeError("this llama.cpp build has no expert cache (native/ patch missing)",
                              hint="rebuild with scripts/bootstrap.sh")
        try:
            # NOTE: the miss path runs on the graph's threads (-t for decode, -tb for larger steps). Layers
            # not cached count their routing only when asked (a device stop each per step).
            self.cache.native.init(self.opts.cache_layers, device_budget=self.opts.device_budget, trace=self.opts.trace,
                            trace_max=self.opts.trace_max, n_threads=max(self.cpu_threads, self.cpu_threads_batch),
                            n_stage=self.opts.stage_slices if self.opts.cache_layers else 0,
                            count_uncached=self.opts.count_experts or (self.opts.trace and self.opts.trace_uncached),
                            file_path=str(self.opts.model_path) if self.opts.file_tier else None,
                            n_readers=self.opts.file_readers, host_budget=self.opts.host_budget,
                            ahead=self.opts.read_ahead if self.opts.file_tier else 0,
                            ahead_min_prob=self.opts.ahead_min_prob)
        except NativeError:
            self.close()
            raise

    # -- evaluation -----------------------------------------------------------------------

    def reset(self) -> None:
        """Forget the KV cache of every sequence (the expert cache keeps its slots)."""
        lc = self.lib.lc
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        self._pos = [0] * self.n_seq

    @property
    def n_past(self) -> int:
        """Positions sequence 0 holds (the one sequence of chat, bench and profiling)."""
        return self._pos[0]

    def seq_pos(self, seq: int) -> int:
        """Positions sequence `seq` holds: the next token's position."""
        return self._pos[seq]

    def seq_clear(self, seq: int) -> None:
        """Forget one sequence's KV entries (and recurrent state); the others keep theirs."""
        lc = self.lib.lc
        lc.llama_memory_seq_rm(lc.llama_get_memory(self.ctx), seq, -1, -1)
        self._pos[seq] = 0

    def truncate(self, n_keep: int, seq: int = 0) -> int:
        """Drop a sequence's KV entries from position n_keep on; returns the positions kept. A
        recurrent state (qwen35moe, qwen3next) cannot be cut back, and a sliding-window cache
        (gpt-oss, laguna) may have dropped the window before n_keep: then the sequence is cleared
        and 0 is kept."""
        lc = self.lib.lc
        mem = lc.llama_get_memory(self.ctx)
        if n_keep < self._pos[seq] and not lc.llama_memory_seq_rm(mem, seq, n_keep, -1):
            self.seq_clear(seq)
            return 0
        self._pos[seq] = min(self._pos[seq], n_keep)
        n_swa = lc.llama_model_n_swa(self.model)
        if self._pos[seq] > 0 and n_swa > 0:
            # llama-server's test: the window the next token attends to must still be cached
            pos_min = lc.llama_memory_seq_pos_min(mem, seq)
            if pos_min < 0 or pos_min > max(0, self._pos[seq] - n_swa):
                self.seq_clear(seq)
                return 0
        return self._pos[seq]

    @property
    def can_shift(self) -> bool:
        """Whether the KV cache can move positions (llama_memory_can_shift): not with a recurrent
        state or M-RoPE (qwen35moe, qwen3next), as llama-server's context shift requires."""
        lc = self.lib.lc
        return bool(lc.llama_memory_can_shift(lc.llama_get_memory(self.ctx)))

    def shift(self, seq: int, n_keep: int, n_discard: int) -> None:
        """llama-server's context shift of one sequence: drop positions [n_keep, n_keep + n_discard)
        and move the rest down by n_discard (llama_memory_seq_rm, then seq_add)."""
        lc = self.lib.lc
        mem = lc.llama_get_memory(self.ctx)
        if not lc.llama_memory_seq_rm(mem, seq, n_keep, n_keep + n_discard):
            raise SparkError(f"llama.cpp could not drop positions {n_keep} to {n_keep + n_discard} of sequence {seq}")
        lc.llama_memory_seq_add(mem, seq, n_keep + n_discard, self._pos[seq], -n_discard)
        self._pos[seq] -= n_discard

    def decode(self, entries: Sequence[tuple[int, int, bool]]) -> None:
        """One llama_decode of (token, sequence, output) entries, at most n_batch, each at its
        sequence's next position; an output entry's logits row is its index (logits_row). No room
        in the KV cache (--kv-unified, every sequence together): KVFullError, nothing evaluated."""
        lc = self.lib.lc
        b = self._batch
        b.n_tokens = len(entries)
        pos = list(self._pos)
        for i, (tok, seq, out) in enumerate(entries):
            b.token[i] = tok
            b.pos[i] = pos[seq]
            pos[seq] += 1
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = out
        rc = lc.llama_decode(self.ctx, b)
        if rc == 1:
            raise KVFullError("the KV cache has no room for this batch", hint="raise -c or lower -np")
        if rc != 0:
            raise SparkError(f"llama_decode failed with {rc} ({_logs.last_error()})")
        self._pos = pos

    def eval(self, tokens: Sequence[int], logits: str = "last") -> np.ndarray | None:
        """Feed tokens to sequence 0 (in n_batch chunks). logits: 'last' -> [n_vocab], 'all' -> [n, n_vocab],
        'none', 'outputs' -> None, but every token is an output (llama.cpp then runs the last layer on
        every token, so routing is recorded for all of them) without copying the logits."""
        if self.n_past + len(tokens) > self.n_ctx:
            raise SparkError(f"the prompt needs {self.n_past + len(tokens)} tokens but the context holds {self.n_ctx}",
                             hint="raise --ctx-size or shorten the prompt")
        rows = []
        nb = self.n_batch
        every = logits in ("all", "outputs")
        for start in range(0, len(tokens), nb):
            chunk = tokens[start:start + nb]
            last_chunk = start + nb >= len(tokens)
            self.decode([(t, 0, every or (logits == "last" and last_chunk and i == len(chunk) - 1))
                         for i, t in enumerate(chunk)])
            if logits == "all":
                for i in range(len(chunk)):
                    rows.append(self.logits_row(i))
        if logits == "last":
            return self.logits_row(len(tokens[-nb:]) - 1 if len(tokens) % nb == 0 else len(tokens) % nb - 1)
        if logits == "all":
            return np.stack(rows)
        return None

    def embed(self, tokens: Sequence[int], seq: int) -> np.ndarray:
        """The prompt's embeddings in sequence `seq`, which is cleared (native/embed.py)."""
        return embed_mod.embed(self, tokens, seq)

    def seq_state(self, seq: int) -> bytes:
        """Sequence `seq`'s KV state (native/seq_state.py)."""
        return seq_state_mod.get(self, seq)

    def seq_restore(self, seq: int, state: bytes, n_tokens: int) -> bool:
        """Put a saved state into sequence `seq`, which then holds `n_tokens` positions; False (and
        the sequence cleared) when llama.cpp refuses it."""
        self.seq_clear(seq)
        if not seq_state_mod.put(self, seq, state):
            self.seq_clear(seq)
            return False
        self._pos[seq] = n_tokens
        return True

    def logits_row(self, i: int) -> np.ndarray:
        """The logits of output entry `i` of the last decode (-1: its last output)."""
        ptr = self.lib.lc.llama_get_logits_ith(self.ctx, i)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def make_sampler(self, temp: float = 0.0, top_k: int = 40, top_p: float = 0.95, seed: int = 0,
                     min_p: float = 0.05, repeat_penalty: float = 1.0, repeat_last_n: int = 64,
                     grammar: str | None = None, *, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                     typical_p: float = 1.0, logit_bias: Sequence[tuple[int, float]] = (), ban_eog: bool = False):
        """llama-server's chain: a GBNF grammar (native/grammar.py), logit biases, penalties (repeat,
        frequency, presence over the last repeat_last_n tokens; -1: the context), top-k, typical-p,
        top-p, min-p, temperature, dist (temp <= 0: greedy after the penalties). `ban_eog`: every
        end-of-generation token gets a -inf bias (llama-server's ignore_eos). Close it when done
        (or let it go)."""
        lc = self.lib.lc
        chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        if grammar:
            g = lc.llama_sampler_init_grammar(self.vocab.handle, grammar.encode(), b"root")
            if not g:
                lc.llama_sampler_free(chain)
                raise SparkError(f"llama.cpp refused the grammar ({_logs.last_error() or 'see SPARK_VERBOSE=1'})")
            lc.llama_sampler_chain_add(chain, g)
        if ban_eog:
            logit_bias = [*logit_bias, *((t, float("-inf")) for t in self.vocab.eog_tokens)]
        if logit_bias:
            arr = (lc.llama_logit_bias * len(logit_bias))(*(lc.llama_logit_bias(t, b) for t, b in logit_bias))
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_logit_bias(self.n_vocab, len(logit_bias), arr))
        penalties, last_n = None, self.n_ctx if repeat_last_n < 0 else repeat_last_n
        if (repeat_penalty != 1.0 or frequency_penalty != 0.0 or presence_penalty != 0.0) and last_n != 0:
            # NOTE: this llama.cpp's penalties sampler takes n_vocab first
            penalties = lc.llama_sampler_init_penalties(self.n_vocab, last_n, repeat_penalty, frequency_penalty,
                                                        presence_penalty)
            lc.llama_sampler_chain_add(chain, penalties)
        if temp <= 0:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_greedy())
            return NativeSampler(lc, chain, penalties, last_n, greedy=True)
        if top_k > 0:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_k(top_k))
        if typical_p < 1.0:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_typical(typical_p, 1))
        if top_p < 1.0:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_p(top_p, 1))
        if min_p > 0.0:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_min_p(min_p, 1))
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_temp(temp))
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_dist(seed & 0xFFFFFFFF))
        return NativeSampler(lc, chain, penalties, last_n)

    def stream_generate(self, prompt: Sequence[int], **kw) -> Iterator[GenerationStep]:
        """The generation loop (generate.stream_generate) on this engine."""
        return stream_generate(self, prompt, **kw)

    # -- eval callback capture (works without the native patch) ---------------------------

    def _on_eval(self, t_ptr: int, ask: bool, user_data) -> bool:
        t = llama_lib.GGMLTensor.from_address(t_ptr)
        name = t.name
        hidden = self._hidden_prefix
        scores = self.opts.capture_topk and self.opts.capture_scores and _SCORES_RE.fullmatch(name) is not None
        topk = _TOPK_RE.fullmatch(name) if self.opts.capture_topk else None
        state = re.fullmatch(re.escape(hidden) + rb"(\d+)", name) if hidden is not None else None
        if ask:
            return topk is not None or state is not None or scores
        if state is not None:
            self._record_hidden(t_ptr, t, int(state.group(1)))
        if scores:
            # NOTE: ffn_moe_probs, then _biased (exp_probs_b) or _masked (expert groups) where the
            # model has them: the last one before the layer's top-k is what it ranked
            self._scores = self._read_rows(t_ptr, t)
        if topk is not None:
            il = int(topk.group(1))
            k, n_tok = t.ne[0], t.ne[1]
            # NOTE: the phase is the ubatch's: a new ubatch starts when the layer index does not grow,
            # and its first MoE layer routes every token (the last layer may route only the outputs)
            if il <= self._last_il:
                self._ubatch_tokens = n_tok
            self._last_il = il
            size = self.lib.nbytes(t_ptr)
            raw = (ctypes.c_char * size)()
            self.lib.tensor_get(t_ptr, raw, 0, size)
            base = np.frombuffer(raw, dtype=np.uint8)
            # NOTE: a strided view of the argsort result: read it by its strides
            ids = np.lib.stride_tricks.as_strided(base.view(np.int32) if t.nb[0] == 4 and size % 4 == 0 else base,
                                                  shape=(n_tok, k), strides=(t.nb[1], t.nb[0]))
            phase = DECODE if self._ubatch_tokens == 1 else PREFILL
            self.records.append(TopkRecord(il, phase, ids.astype(np.int32), self._scores))
            self._scores = None
        return True

    @property
    def _hidden_prefix(self) -> bytes | None:
        return None if not self.opts.capture_hidden else self.opts.capture_hidden.encode() + b"-"

    def _record_hidden(self, t_ptr: int, t, il: int) -> None:
        self.hidden.append((il, self._read_rows(t_ptr, t)))

    def _read_rows(self, t_ptr: int, t) -> np.ndarray:
        """One f32 tensor [n_tokens, n] (ggml ne = [n, n_tokens]), read by its strides."""
        if t.type != 0:  # GGML_TYPE_F32
            raise NativeError(f"{t.name.decode()}: expected an f32 tensor, got ggml type {t.type}")
        n, n_tok = t.ne[0], t.ne[1]
        size = self.lib.nbytes(t_ptr)
        raw = (ctypes.c_char * size)()
        self.lib.tensor_get(t_ptr, raw, 0, size)
        rows = np.lib.stride_tricks.as_strided(np.frombuffer(raw, dtype=np.float32), shape=(n_tok, n),
                                               strides=(t.nb[1], t.nb[0]))
        return rows.copy()

    # -- expert cache figures -------------------------------------------------------------

    @property
    def cpu_threads(self) -> int:
        return self.opts.threads

    @property
    def cpu_threads_batch(self) -> int:
        return self.opts.threads_batch

    def reset_stats(self) -> None:
        """Zero the expert cache's counters and trace, and drop the captured top-k records."""
        self.cache.reset_stats()
        self.records.clear()

    def restart_cache(self) -> None:
        """The expert cache as it was attached: pinned experts only, empty policy slots, the
        options' miss paths, zero counters (after a calibration, so that it leaves no trace)."""
        if self.cache.enabled and self.opts.cache_layers:
            self.lib.lc.llama_synchronize(self.ctx)
            self.cache.native.free()  # NOTE: before the new banks: both sets would not fit a full device
            self._init_cache()
            self.reset()

    def device_memory(self) -> list[tuple[str, int, int]]:
        """(name, free, total) of the devices in use, read now."""
        return [(d.name, *devices_mod.free_memory(d)) for d in self.devices]

    def load_log(self) -> list[str]:
        """llama.cpp's log lines while this engine loaded its model and context (debug level included)."""
        return list(self._load_log)

    def graph_splits(self) -> int | None:
        """Splits of the one-token graph as llama.cpp's scheduler last reserved it (after the expert
        cache is set up it reserves again at the next decode, host nodes included), from its log:
        `graph: nodes = N, splits = S, ...` or `graph (pp bs=.., tg bs=1): ..., splits = S_pp / S_tg, ...`."""
        for line in reversed(self._reserve_log):
            m = _SPLITS_RE.search(line)
            if m:
                return int(m.group(2) or m.group(1))
        return None

    def allocated_bytes(self) -> dict[str, int]:
        """Buffers llama.cpp reported while loading this model and context, by kind
        (model, KV, compute, RS) and buffer name, as `"<kind> <buffer>"` -> bytes (from its log)."""
        out: dict[str, int] = {}
        for line in self.load_log():
            m = _BUFFER_RE.search(line)
            if m:
                key = f"{m.group('kind')} {m.group('buf')}"
                out[key] = out.get(key, 0) + round(float(m.group('mib')) * (1 << 20))
        return out

    def layer_devices(self) -> dict[int, str]:
        """Layer -> device llama.cpp assigned it to (its dev_layer; the output layer is n_layer), from
        its load log."""
        out = {}
        for line in self.load_log():
            m = _LAYER_DEV_RE.search(line)
            if m:
                out[int(m.group("il"))] = m.group("dev")
        return out

    def overridden_tensors(self) -> dict[str, str]:
        """Tensor name -> buffer type of every tensor a tensor override placed (from llama.cpp's log)."""
        out = {}
        for line in self.load_log():
            m = _OVERRIDE_RE.search(line)
            if m:
                out[m.group("name")] = m.group("buft")
        return out

    # -- teardown -------------------------------------------------------------------------

    def close(self) -> None:
        lc = self.lib.lc
        if _logs.reserve is self._reserve_log:
            _logs.reserve = None
        if self.ctx:
            lc.llama_synchronize(self.ctx)
            self.cache.close()
            if self._batch is not None:
                lc.llama_batch_free(self._batch)
                self._batch = None
            lc.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            lc.llama_model_free(self.model)
            self.model = None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


