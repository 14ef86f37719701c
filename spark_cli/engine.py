"""A small engine over llama.cpp's low-level API: devices, tensor overrides, the expert cache.

llama-cpp-python's `Llama` class exposes neither `model_params.devices` nor
`tensor_buft_overrides`; this engine owns the model and context itself.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from . import faults, llama_lib
from .errors import ModelFileError, NativeError, SparkError

KV_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}
EXPERT_KINDS = "gate|up|down|gate_up"
PHASE_PREFILL, PHASE_DECODE = 0, 1
MISS_PATHS = {"upload": 0, "cpu": 1}


def expert_pattern(layers: Sequence[int]) -> str:
    """Regex over GGUF tensor names for the routed expert weights of `layers`."""
    alt = "|".join(str(i) for i in sorted(layers))
    return rf"^blk\.({alt})\.ffn_({EXPERT_KINDS})_exps\.weight$"


def native_policy_id(policy: str) -> int:
    from .simulator import NATIVE_POLICY_IDS, canonical_policy

    p = canonical_policy(policy)
    if p not in NATIVE_POLICY_IDS:
        raise SparkError(f"--policy {policy}: the native cache cannot run it",
                         hint="use one of " + ", ".join(NATIVE_POLICY_IDS))
    return NATIVE_POLICY_IDS[p]


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


@dataclass(frozen=True)
class CacheLayer:
    """One cached MoE layer: `n_slots` device slots, the first `len(pinned)` pinned."""

    il: int
    n_slots: int
    pinned: tuple[int, ...] = ()
    miss_path: str = "upload"  # upload | cpu (see MISS_PATHS)
    max_admit: int = -1        # cpu: background admissions per decode step (<0: k)
    policy: str = "lru"        # a native policy of simulator.NATIVE_POLICY_IDS


@dataclass
class EngineOptions:
    model_path: Path
    n_ctx: int = 2048
    n_batch: int = 512
    n_ubatch: int = 512
    n_threads: int | None = None
    device: str = "auto"               # auto: first GPU-type device (CUDA, or --rpc); cpu: none
    rpc: list[str] = field(default_factory=list)
    host_layers: list[int] = field(default_factory=list)  # expert tensors of these layers stay in host RAM
    cache_layers: list[CacheLayer] = field(default_factory=list)
    count_experts: bool = False        # native routing counters without a cache
    trace: bool = False                # native trace of routed ids
    capture_topk: bool = False         # eval-callback capture of ffn_moe_topk-<il> (no native needed)
    device_budget: int = 0             # bytes the expert banks may take (0: device free memory)
    type_k: str = "f16"
    type_v: str = "f16"
    repack: bool = True                # allow CPU weight repacking where no cache needs plain layout


@dataclass
class TopkRecord:
    il: int
    phase: int
    ids: np.ndarray  # [n_tokens, k] int32


class _Logs:
    """llama.cpp log lines, kept (not printed) so errors can quote the last one."""

    def __init__(self) -> None:
        self.lines: deque[str] = deque(maxlen=200)
        self.verbose = bool(os.environ.get("SPARK_VERBOSE"))
        self._partial = ""

    def __call__(self, level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        s = self._partial + text.decode(errors="replace")
        *done, self._partial = s.split("\n")
        for line in done:
            self.lines.append(line)
            if self.verbose:
                print(line, file=__import__("sys").stderr)

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
        self._batch = None
        self._keep: list[object] = []
        self.records: list[TopkRecord] = []
        self.n_past = 0
        self._last_il = 1 << 30  # eval-callback capture: layer seen last, to find ubatch starts
        self._ubatch_tokens = 0

        path = Path(opts.model_path)
        if not path.is_file():
            raise ModelFileError(f"{path}: no such model file", hint="pass the path of a .gguf file")
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ModelFileError(f"{path}: not a GGUF file")

        self.devices = self._pick_devices()
        mp = lc.llama_model_default_params()
        dev_arr = (ctypes.c_void_p * (len(self.devices) + 1))(*[d.handle for d in self.devices], None)
        self._keep.append(dev_arr)
        mp.devices = ctypes.cast(dev_arr, ctypes.c_void_p)
        mp.n_gpu_layers = -1 if self.devices else 0
        overrides = []
        if self.devices and opts.cache_layers:
            # NOTE: cached experts live in the device's pinned host memory where it has one (faster uploads)
            pinned = self.lib.dev_host_buffer_type(self.devices[0].handle) or self.lib.cpu_buffer_type()
            overrides.append((expert_pattern([c.il for c in opts.cache_layers]), pinned))
        stock = sorted(set(opts.host_layers) - {c.il for c in opts.cache_layers})
        if self.devices and stock:
            # as llama.cpp's --n-cpu-moe: the CPU buffer type, computed on the CPU
            overrides.append((expert_pattern(stock), self.lib.cpu_buffer_type()))
        if overrides:
            ov = (llama_lib.BuftOverride * (len(overrides) + 1))()
            for i, (pat, buft) in enumerate(overrides):
                b = pat.encode()
                self._keep.append(b)
                ov[i] = llama_lib.BuftOverride(b, buft)
            ov[len(overrides)] = llama_lib.BuftOverride(None, None)
            self._keep.append(ov)
            mp.tensor_buft_overrides = ctypes.cast(ov, ctypes.c_void_p)
        # NOTE: the cache copies expert slices byte for byte: host weights must keep plain layout
        mp.use_extra_bufts = bool(opts.repack and not opts.cache_layers and repack_is_safe())
        self.model = lc.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            raise ModelFileError(f"{path}: llama.cpp could not load it ({_logs.last_error() or 'see SPARK_VERBOSE=1'})")
        self.vocab = lc.llama_model_get_vocab(self.model)
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)
        self.n_layer = lc.llama_model_n_layer(self.model)

        cp = lc.llama_context_default_params()
        cp.n_ctx = opts.n_ctx
        cp.n_batch = opts.n_batch
        cp.n_ubatch = min(opts.n_ubatch, opts.n_batch)
        threads = opts.n_threads or os.cpu_count() or 1
        cp.n_threads = threads
        cp.n_threads_batch = threads
        cp.no_perf = False
        for name, val in (("type_k", opts.type_k), ("type_v", opts.type_v)):
            if val not in KV_TYPES:
                raise SparkError(f"--cache-type-{name[-1]}: unknown type '{val}'", hint=f"use one of {', '.join(KV_TYPES)}")
            setattr(cp, name, KV_TYPES[val])
        if opts.capture_topk:
            self._cb = lc.ggml_backend_sched_eval_callback(self._on_eval)
            cp.cb_eval = self._cb
            cp.cb_eval_user_data = None
        self.ctx = lc.llama_init_from_model(self.model, cp)
        if not self.ctx:
            self.close()
            raise SparkError(f"{path}: could not create a context of {opts.n_ctx} tokens ({_logs.last_error()})",
                             hint="try a smaller --ctx")
        self.n_ctx = lc.llama_n_ctx(self.ctx)
        self._batch = lc.llama_batch_init(opts.n_batch, 0, 1)
        if opts.cache_layers or opts.count_experts or opts.trace:
            self._init_cache()

    # -- set-up ---------------------------------------------------------------------------

    def _pick_devices(self) -> list[llama_lib.Device]:
        from . import rpc

        o = self.opts
        if o.rpc:
            return rpc.connect(o.rpc)
        if o.device == "cpu":
            return []
        gpus = [d for d in llama_lib.gpu_devices() if not d.name.startswith("RPC")]
        if o.device == "auto":
            return gpus[:1]
        named = [d for d in llama_lib.devices() if d.name == o.device]
        if not named:
            raise SparkError(f"--device {o.device}: no such device",
                             hint="available: " + ", ".join(d.name for d in llama_lib.devices()))
        return named

    def _init_cache(self) -> None:
        if not self.lib.has_expert_cache:
            raise NativeError("this llama.cpp build has no expert cache (native/ patch missing)",
                              hint="rebuild with scripts/bootstrap.sh")
        layers = (llama_lib.ExpertCacheLayerParams * max(1, len(self.opts.cache_layers)))()
        for i, c in enumerate(self.opts.cache_layers):
            pinned = (ctypes.c_int32 * max(1, len(c.pinned)))(*c.pinned)
            self._keep.append(pinned)
            layers[i] = llama_lib.ExpertCacheLayerParams(c.il, c.n_slots, len(c.pinned),
                                                        ctypes.cast(pinned, ctypes.POINTER(ctypes.c_int32)),
                                                        MISS_PATHS[c.miss_path], c.max_admit,
                                                        native_policy_id(c.policy))
        p = self.lib.ec_default_params()
        p.layers = ctypes.cast(layers, ctypes.POINTER(llama_lib.ExpertCacheLayerParams))
        p.n_layers = len(self.opts.cache_layers)
        p.device_budget = self.opts.device_budget
        p.trace = self.opts.trace
        err = ctypes.create_string_buffer(512)
        rc = self.lib.ec_init(self.ctx, ctypes.byref(p), err, len(err))
        if rc != 0:
            msg = err.value.decode(errors="replace")
            self.close()
            raise NativeError(f"expert cache: {msg}", hint=CACHE_HINTS.get(rc))

    # -- tokens ---------------------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        lc = self.lib.lc
        data = text.encode("utf-8")
        n_max = len(data) + 16
        buf = (lc.llama_token * n_max)()
        n = lc.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            buf = (lc.llama_token * -n)()
            n = lc.llama_tokenize(self.vocab, data, len(data), buf, -n, add_special, parse_special)
        return list(buf[:n])

    def piece(self, token: int, special: bool = False) -> bytes:
        buf = ctypes.create_string_buffer(256)
        n = self.lib.lc.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self.lib.lc.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        return bool(self.lib.lc.llama_vocab_is_eog(self.vocab, token))

    def chat_prompt(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """Format messages with the GGUF's chat template (llama.cpp's built-in templates)."""
        lc = self.lib.lc
        tmpl = lc.llama_model_chat_template(self.model, None)
        if not tmpl:
            # NOTE: a model without a template gets a plain transcript
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            return text + ("assistant:" if add_generation_prompt else "")
        arr = (lc.llama_chat_message * len(messages))()
        keep = []
        for i, m in enumerate(messages):
            role, content = m["role"].encode(), m["content"].encode()
            keep += [role, content]
            arr[i] = lc.llama_chat_message(role, content)
        size = sum(len(m["content"]) for m in messages) * 2 + 1024
        for _ in range(2):
            buf = ctypes.create_string_buffer(size)
            n = lc.llama_chat_apply_template(tmpl, arr, len(messages), add_generation_prompt, buf, size)
            if n < 0:
                raise SparkError("the model's chat template is not supported by llama.cpp",
                                 hint="use --prompt with raw text")
            if n <= size:
                return buf.raw[:n].decode("utf-8", errors="replace")
            size = n + 1
        raise SparkError("chat template output kept growing")

    # -- evaluation -----------------------------------------------------------------------

    def reset(self) -> None:
        """Forget the KV cache (the expert cache keeps its slots)."""
        lc = self.lib.lc
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        self.n_past = 0

    def truncate(self, n_keep: int) -> None:
        """Drop KV entries from position n_keep on."""
        lc = self.lib.lc
        lc.llama_memory_seq_rm(lc.llama_get_memory(self.ctx), 0, n_keep, -1)
        self.n_past = min(self.n_past, n_keep)

    def eval(self, tokens: Sequence[int], logits: str = "last") -> np.ndarray | None:
        """Feed tokens (in n_batch chunks). logits: 'last' -> [n_vocab], 'all' -> [n, n_vocab], 'none',
        'outputs' -> None, but every token is an output (llama.cpp then runs the last layer on
        every token, so routing is recorded for all of them) without copying the logits."""
        lc = self.lib.lc
        if self.n_past + len(tokens) > self.n_ctx:
            raise SparkError(f"the prompt needs {self.n_past + len(tokens)} tokens but the context holds {self.n_ctx}",
                             hint="raise --ctx or shorten the prompt")
        rows = []
        b = self._batch
        nb = self.opts.n_batch
        for start in range(0, len(tokens), nb):
            chunk = tokens[start:start + nb]
            last_chunk = start + nb >= len(tokens)
            b.n_tokens = len(chunk)
            for i, t in enumerate(chunk):
                b.token[i] = t
                b.pos[i] = self.n_past + i
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = 0
                b.logits[i] = logits in ("all", "outputs") or (logits == "last" and last_chunk and i == len(chunk) - 1)
            rc = lc.llama_decode(self.ctx, b)
            if rc != 0:
                raise SparkError(f"llama_decode failed with {rc} ({_logs.last_error()})")
            self.n_past += len(chunk)
            if logits == "all":
                for i in range(len(chunk)):
                    rows.append(self._logits_row(i))
        if logits == "last":
            return self._logits_row(len(tokens[-nb:]) - 1 if len(tokens) % nb == 0 else len(tokens) % nb - 1)
        if logits == "all":
            return np.stack(rows)
        return None

    def _logits_row(self, i: int) -> np.ndarray:
        ptr = self.lib.lc.llama_get_logits_ith(self.ctx, i)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def make_sampler(self, temp: float = 0.0, top_k: int = 40, top_p: float = 0.95, seed: int = 0):
        lc = self.lib.lc
        chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        if temp <= 0:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_greedy())
        else:
            if top_k > 0:
                lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_k(top_k))
            if top_p < 1.0:
                lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_p(top_p, 1))
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_temp(temp))
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_dist(seed & 0xFFFFFFFF))
        return chain

    def generate(self, prompt: Sequence[int], n_predict: int, sampler=None) -> Iterator[int]:
        """Yield generated tokens; stops at end-of-generation or n_predict."""
        lc = self.lib.lc
        own = sampler is None
        sampler = sampler or self.make_sampler()
        try:
            if prompt:
                self.eval(prompt, logits="last")
            for _ in range(n_predict):
                tok = lc.llama_sampler_sample(sampler, self.ctx, -1)
                if self.is_eog(tok):
                    return
                yield tok
                self.eval([tok], logits="last")
        finally:
            if own:
                lc.llama_sampler_free(sampler)

    # -- eval callback capture (works without the native patch) ---------------------------

    def _on_eval(self, t_ptr: int, ask: bool, user_data) -> bool:
        t = llama_lib.GGMLTensor.from_address(t_ptr)
        name = t.name
        if ask:
            return name.startswith(b"ffn_moe_topk-")
        if name.startswith(b"ffn_moe_topk-"):
            il = int(name.split(b"-", 1)[1])
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
            phase = PHASE_DECODE if self._ubatch_tokens == 1 else PHASE_PREFILL
            self.records.append(TopkRecord(il, phase, ids.astype(np.int32)))
        return True

    # -- expert cache figures -------------------------------------------------------------

    @property
    def cache_enabled(self) -> bool:
        return bool(self.lib.has_expert_cache and self.ctx and self.lib.ec_enabled(self.ctx))

    def cache_stats(self) -> dict[int, dict[str, int]]:
        out = {}
        if not self.cache_enabled:
            return out
        for il in range(self.n_layer):
            s = llama_lib.ExpertCacheStats()
            if self.lib.ec_get_stats(self.ctx, il, ctypes.byref(s)) == 0:
                out[il] = {f: getattr(s, f) for f, _ in llama_lib.ExpertCacheStats._fields_}
        return out

    def set_miss_path(self, path: str | dict[int, str]) -> None:
        """Switch the miss path of every cached layer (or per layer: {il: path}); the graph stays."""
        per_layer = path if isinstance(path, dict) else {c.il: path for c in self.opts.cache_layers}
        for il, p in per_layer.items():
            rc = self.lib.ec_set_miss_path(self.ctx, il, MISS_PATHS[p])
            if rc != 0:
                raise NativeError(f"expert cache: layer {il} cannot use the {p} miss path ({_logs.last_error()})",
                                  hint=CACHE_HINTS.get(rc))

    def miss_paths(self) -> dict[int, str]:
        names = {v: k for k, v in MISS_PATHS.items()}
        return {c.il: names.get(self.lib.ec_get_miss_path(self.ctx, c.il), "?") for c in self.opts.cache_layers}

    def routing_counts(self, phase: int) -> np.ndarray:
        """[n_layer, n_expert] routed occurrences in one phase (zeros for dense layers)."""
        rows = []
        n_exp = 0
        for il in range(self.n_layer):
            buf = (ctypes.c_uint64 * 4096)()
            n = self.lib.ec_get_counts(self.ctx, il, phase, buf, 4096) if self.cache_enabled else -1
            rows.append(np.array(buf[:n], dtype=np.int64) if n > 0 else None)
            n_exp = max(n_exp, n)
        return np.stack([r if r is not None else np.zeros(max(n_exp, 0), np.int64) for r in rows]) if n_exp > 0 \
            else np.zeros((self.n_layer, 0), np.int64)

    def slots(self, il: int) -> list[int]:
        buf = (ctypes.c_int32 * 4096)()
        n = self.lib.ec_get_slots(self.ctx, il, buf, 4096)
        return list(buf[:n]) if n > 0 else []

    def trace_records(self) -> list[TopkRecord]:
        n = self.lib.ec_get_trace(self.ctx, None, 0)
        if n <= 0:
            return []
        buf = (ctypes.c_int32 * n)()
        self.lib.ec_get_trace(self.ctx, buf, n)
        a = np.frombuffer(buf, dtype=np.int32)
        out, i = [], 0
        while i < n:
            il, n_tok, k, phase = (int(x) for x in a[i:i + 4])
            out.append(TopkRecord(il, phase, a[i + 4:i + 4 + n_tok * k].reshape(n_tok, k).copy()))
            i += 4 + n_tok * k
        return out

    def reset_stats(self) -> None:
        if self.cache_enabled:
            self.lib.ec_reset_stats(self.ctx)
        self.records.clear()

    def bank_bytes(self) -> int:
        return int(self.lib.ec_device_bytes(self.ctx)) if self.cache_enabled else 0

    def device_memory(self) -> list[tuple[str, int, int]]:
        """(name, free, total) of the devices in use, read now."""
        out = []
        for d in self.devices:
            free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
            self.lib.dev_memory(d.handle, ctypes.byref(free), ctypes.byref(total))
            out.append((d.name, free.value, total.value))
        return out

    # -- teardown -------------------------------------------------------------------------

    def close(self) -> None:
        lc = self.lib.lc
        if self.ctx:
            lc.llama_synchronize(self.ctx)
            if self.lib.has_expert_cache:
                self.lib.ec_free(self.ctx)
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


CACHE_HINTS = {
    -2: "cache only MoE layers",
    -3: "give each cached layer at least as many LRU slots as experts used per token",
    -4: "pinned expert ids must be distinct and below the expert count",
    -5: "lower the slot counts or raise the device budget",
    -6: "cached layers must run on a GPU-type device with their experts in host RAM",
    -7: "list each layer once, within the model's layer count",
}

