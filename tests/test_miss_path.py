"""The CPU miss path on the RPC stand-in GPU: resident experts on the device from the banks,
misses on the CPU from the host weights, admissions uploaded in the background. Both sides
run ggml-cpu kernels, so logits must equal the all-resident run bit for bit."""

from __future__ import annotations

import ctypes
import dataclasses

import numpy as np
import pytest

from test_expert_cache import _assert_same
from spark_cli.runs.exactness import MIXED_SLACK, logits, max_diff, prompts, reference, within_bound
from spark_cli.native.engine import CacheLayer, Engine, EngineOptions
from spark_cli.native.expert_cache import CacheStats
from spark_cli.core.gguf_info import load_geometry

pytestmark = pytest.mark.model

N_DECODE = 10


def _run(eng: Engine, toks: list[int]) -> tuple[np.ndarray, list[int]]:
    """Logits of every prompt token, then of each greedy decode step; the greedy tokens."""
    return logits(eng, toks, None, N_DECODE)


def _check(path, endpoint: str, miss_path: str, n_ubatch: int = 512, pinned: int = 1) :
    opts = dict(n_ctx=512, n_batch=512, n_ubatch=n_ubatch, rpc=[endpoint])
    ref = reference(EngineOptions(path, **opts), N_DECODE)
    g = load_geometry(path)
    k = g.n_expert_used
    # S = P + k: every step that misses must evict
    layers = [CacheLayer(il, pinned + k, tuple(range(pinned)), miss_path=miss_path) for il in g.moe_layers]
    with Engine(EngineOptions(path, cache_layers=layers, **opts)) as eng:
        for p, rl, toks in zip(ref.prompts, ref.logits, ref.fed):
            _assert_same((rl, toks), _run(eng, p), f"{path.name} {miss_path} {len(p)} tokens")
        return eng.cache.stats()


def _total(stats, key: str) -> int:
    return sum(getattr(s, key) for s in stats.values())


@pytest.mark.parametrize("miss_path", ["cpu", "upload"])
def test_demo_model_exact_on_both_miss_paths(miss_path, small_model, rpc_server):
    stats = _check(small_model, rpc_server.endpoint, miss_path)
    assert _total(stats, "misses") > 0 and _total(stats, "hits") > 0
    assert _total(stats, "steps_stock") == 0  # prefills too large for the slots still use the banks
    # one device -> host stop per cached layer and step, with one copy down and one up: the CPU miss
    # path packs the ids with the matmuls' input, and its partial result and mask with the slot ids
    assert all(s.syncs == s.steps_cached == s.stop_reads == s.stop_writes for s in stats.values())
    if miss_path == "cpu":
        assert _total(stats, "blocking_upload_bytes") == 0
        assert _total(stats, "async_uploads") > 0 and _total(stats, "cpu_experts") > 0
        assert _total(stats, "cpu_expert_bytes") > 0
    else:
        assert _total(stats, "async_uploads") == 0
        assert _total(stats, "blocking_upload_bytes") > 0


def test_small_ubatches_exact_on_cpu_path(small_model, rpc_server):
    # several ubatches per prompt, some fitting the slots and some not
    stats = _check(small_model, rpc_server.endpoint, "cpu", n_ubatch=3, pinned=0)
    assert _total(stats, "cpu_experts") > 0


def test_switching_the_miss_path_keeps_results(small_model, rpc_server):
    opts = dict(n_ctx=512, rpc=[rpc_server.endpoint])
    with Engine(EngineOptions(small_model, **opts)) as ref_eng:
        toks = prompts(ref_eng, (12,))[0]
        ref = _run(ref_eng, toks)
    g = load_geometry(small_model)
    layers = [CacheLayer(il, g.n_expert_used + 1, (0,)) for il in g.moe_layers]
    with Engine(EngineOptions(small_model, cache_layers=layers, **opts)) as eng:
        for path in ("cpu", "upload", "cpu"):
            eng.cache.set_miss_path(path)
            assert eng.cache.miss_paths() == {il: path for il in g.moe_layers}
            _assert_same(ref, _run(eng, toks), f"after switching to {path}")


@pytest.mark.gpu
@pytest.mark.parametrize("miss_path", ["cpu", "upload"])
def test_cuda_miss_paths_within_the_stock_bound(miss_path, small_model):
    """On CUDA each expert's output is the device kernel's or the CPU kernel's: cached logits may
    differ from all-resident by about what stock --cpu-moe (every expert on the CPU) shows on the
    same prompts and tokens (the all-resident run's greedy tokens are fed to every run)."""
    from spark_cli.native import llama_lib

    gpus = [d for d in llama_lib.gpu_devices() if not d.name.startswith("RPC")]
    assert gpus, "a CUDA device is present but this llama.cpp build does not see it (build with SPARK_CUDA=1)"
    g = load_geometry(small_model)
    opts = dict(n_ctx=512, device=gpus[0].name)
    ref = reference(EngineOptions(small_model, **opts), N_DECODE)
    with Engine(EngineOptions(small_model, host_layers=list(g.moe_layers), **opts)) as eng:
        bound, _ = max_diff(eng, ref)
    layers = [CacheLayer(il, 1 + g.n_expert_used, (0,), miss_path=miss_path) for il in g.moe_layers]
    with Engine(EngineOptions(small_model, cache_layers=layers, **opts)) as eng:
        got, _ = max_diff(eng, ref)
    assert within_bound(got, bound), \
        f"{miss_path}: max |d logit| {got:.3g} above {MIXED_SLACK} x stock --cpu-moe's {bound:.3g}"


class _RemapCapture(Engine):
    """An engine that keeps every step's device slot ids and mask of the cached layers: the mask from
    the host node's packed output (after the entries' rows: the mask, then the slot ids as F32, each
    starting on a row), the slot ids as the device's matmuls read them (cast back to I32)."""

    def __init__(self, opts: EngineOptions) -> None:
        self.remaps: list[tuple[np.ndarray, np.ndarray]] = []  # ([T, k] slot ids, [T, k] mask)
        self._packed: np.ndarray | None = None
        super().__init__(dataclasses.replace(opts, capture_topk=True))  # installs the eval callback

    def _on_eval(self, t_ptr: int, ask: bool, user_data) -> bool:
        from spark_cli.native import llama_lib

        t = llama_lib.GGMLTensor.from_address(t_ptr)
        name = t.name
        if ask:
            return name.startswith((b"spark_ec_cpu-", b"spark_ec_slots-"))
        size = self.lib.nbytes(t_ptr)
        raw = (ctypes.c_char * size)()
        self.lib.tensor_get(t_ptr, raw, 0, size)
        if name.startswith(b"spark_ec_cpu-"):
            self._packed = np.frombuffer(raw, dtype=np.float32).reshape(t.ne[1], t.ne[0]).copy()
        elif self._packed is not None:
            k, n_tok = t.ne[0], t.ne[1]
            slots = np.frombuffer(raw, dtype=np.int32).reshape(n_tok, k).copy()
            tail = self._packed[k * n_tok:].reshape(-1)
            mask, slots_f = tail[:k * n_tok], tail[len(tail) // 2:len(tail) // 2 + k * n_tok]
            assert (slots_f == slots.reshape(-1)).all(), "the device's slot ids differ from the host node's"
            self.remaps.append((slots, mask.reshape(n_tok, k)))
            self._packed = None
        return True


def test_missed_entries_never_repeat_a_slot_in_a_token(small_model, rpc_server):
    """A token's CPU-computed entries read filler slots on the device, never one slot twice:
    device MUL_MAT_ID kernels assume an id at most once per token (Vulkan leaves the extra rows
    unwritten, CUDA's mm_ids_helper keeps one). ggml-cpu does not care, so the stand-in checks
    the ids themselves; the mask drops exactly the CPU-computed entries."""
    g = load_geometry(small_model)
    k, S = g.n_expert_used, 1 + g.n_expert_used
    layers = [CacheLayer(il, S, (0,), miss_path="cpu") for il in g.moe_layers]
    with _RemapCapture(EngineOptions(small_model, n_ctx=512, rpc=[rpc_server.endpoint], cache_layers=layers)) as eng:
        toks = prompts(eng, (40,))[0]
        eng.eval(toks, logits="last")
        for _ in range(4):
            eng.eval([toks[0]], logits="last")
        st = CacheStats.total(eng.cache.stats().values())
    assert eng.remaps and st.cpu_experts > 0
    multi = 0
    for slots, mask in eng.remaps:
        assert ((slots >= 0) & (slots <= S)).all()  # a slot or the guard
        assert all(len(set(row)) == k for row in slots.tolist()), "a slot id repeats within a token"
        assert set(np.unique(mask)) <= {0.0, 1.0}
        multi += int(((mask == 0).sum(axis=1) >= 2).sum())
    assert multi > 0, "no token had two CPU-computed entries: the case this test is about did not occur"


def _decode_traffic(path, endpoint: str, n: int = 6, **kw):
    """RPC traffic of n one-token decode steps after a 12-token prompt, and the cache's counters."""
    from spark_cli.native import rpc_traffic

    with Engine(EngineOptions(path, n_ctx=512, rpc=[endpoint], **kw)) as eng:
        toks = prompts(eng, (12,))[0]
        eng.eval(toks, logits="last")
        eng.reset_stats()
        before = rpc_traffic.read([endpoint])
        for tok in toks[:n]:
            eng.eval([tok], logits="last")
        after = rpc_traffic.read([endpoint])
        return after - before, CacheStats.total(eng.cache.stats().values())


def test_a_cached_stop_waits_for_one_reply_a_stock_host_layer_for_two(small_model, rpc_server):
    """Measured on the wire (TCP segments from the RPC server, two per reply: its size, then the
    data): what the stops add to all-resident's per decode step. A cached layer's stop on the CPU
    miss path reads one packed tensor; a stock host layer's reads its input and the routed ids."""
    g = load_geometry(small_model)
    n, moe = 6, len(g.moe_layers)
    base, _ = _decode_traffic(small_model, rpc_server.endpoint, n)
    stock, _ = _decode_traffic(small_model, rpc_server.endpoint, n, host_layers=list(g.moe_layers))
    layers = [CacheLayer(il, 1 + g.n_expert_used, (0,), miss_path="cpu") for il in g.moe_layers]
    spark, st = _decode_traffic(small_model, rpc_server.endpoint, n, cache_layers=layers)
    assert st.syncs == n * moe and st.stop_reads == st.stop_writes == st.syncs and st.cpu_experts > 0
    stock_per_stop = (stock.segs_in - base.segs_in) / (2 * n * moe)
    spark_per_stop = (spark.segs_in - base.segs_in) / (2 * n * moe)
    assert 1.5 <= stock_per_stop <= 2.5, stock_per_stop
    assert 0.5 <= spark_per_stop <= 1.25, spark_per_stop


def test_an_uncached_layer_stops_only_when_its_routing_is_counted(small_model, rpc_server):
    """A plan that caches one layer stops once per decode step; counting the routing of the other
    layers (learning, tracing) adds a stop in each of them."""
    g = load_geometry(small_model)
    n, moe = 6, len(g.moe_layers)
    one = [CacheLayer(g.moe_layers[0], 1 + g.n_expert_used, (0,), miss_path="cpu")]
    base, _ = _decode_traffic(small_model, rpc_server.endpoint, n)
    quiet, st = _decode_traffic(small_model, rpc_server.endpoint, n, cache_layers=one)
    counted, st_counted = _decode_traffic(small_model, rpc_server.endpoint, n, cache_layers=one, count_experts=True)
    assert st.syncs == n and st_counted.syncs == n * moe
    assert 0.5 <= (quiet.segs_in - base.segs_in) / (2 * n) <= 1.25
    assert (counted.segs_in - base.segs_in) / (2 * n) >= 0.75 * moe
