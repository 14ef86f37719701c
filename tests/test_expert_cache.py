"""The native expert cache on the RPC stand-in GPU: exact logits, counters, placement, errors."""

from __future__ import annotations

import numpy as np
import pytest

from collections import OrderedDict

from spark_cli.core.capture import records_to_counts, records_to_trace
from spark_cli.models.tiny_models import TINY_ARCHES, build_tiny_model
from spark_cli.core.trace import DECODE as PHASE_DECODE, PREFILL as PHASE_PREFILL
from spark_cli.native.engine import CacheLayer, Engine, EngineOptions
from spark_cli.errors import NativeError
from spark_cli.runs.exactness import logits
from spark_cli.core.gguf_info import load_geometry
from spark_cli.core.simulator import MissCosts, simulate

pytestmark = pytest.mark.model

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea and the wind.",
    "def fibonacci(n):\n    # return the n-th Fibonacci number\n",
]
LONG = ("The history of the printing press begins in the fifteenth century, when movable type "
        "changed how books were made, sold and read across Europe. ") * 6
N_DECODE = 12


def _run(eng: Engine, text: str, n_decode: int = N_DECODE) -> tuple[np.ndarray, list[int]]:
    """Logits of every prompt token, then of each greedy decode step; the greedy tokens."""
    return logits(eng, eng.vocab.tokenize(text), None, n_decode)


def _cache_layers(path, n_slots_extra: int, n_pinned: int) -> tuple[list[CacheLayer], object]:
    g = load_geometry(path)
    k = g.n_expert_used
    layers = [CacheLayer(il, k + n_slots_extra + n_pinned, tuple(range(n_pinned)), policy="lru")  # the LRU rule
              for il in g.moe_layers]
    return layers, g


def _models(request):
    return request.getfixturevalue("small_model")


@pytest.fixture(scope="module")
def tiny_models():
    return {a: build_tiny_model(a) for a in TINY_ARCHES}


def _assert_same(ref: tuple[np.ndarray, list[int]], got: tuple[np.ndarray, list[int]], what: str) -> None:
    """Bit-identical logits, prompt rows then one row per decode step, and the same greedy tokens."""
    assert ref[1] == got[1], f"{what}: greedy tokens differ"
    n_prompt = len(ref[0]) - len(ref[1])
    for i, (a, b) in enumerate(zip(ref[0], got[0])):
        row = f"prompt token {i}" if i < n_prompt else f"decode step {i - n_prompt}"
        assert np.array_equal(a, b), f"{what}: {row} logits differ (max |d| {np.abs(a - b).max()})"


def _exactness(path, endpoint, n_ubatch: int = 512, extra: int = 1, pinned: int = 1, prompts=PROMPTS,
               evictions: bool = True):
    """Cached logits == resident logits; with `evictions`, every cached layer must have evicted
    (more misses than LRU slots) and reused an expert, so the test cannot pass on an idle cache."""
    opts = dict(n_ctx=512, n_batch=512, n_ubatch=n_ubatch, rpc=[endpoint])
    with Engine(EngineOptions(path, **opts)) as ref_eng:
        refs = [_run(ref_eng, p) for p in prompts]
    layers, g = _cache_layers(path, extra, pinned)
    assert all(c.n_slots < g.n_expert for c in layers)
    with Engine(EngineOptions(path, cache_layers=layers, **opts)) as eng:
        for p, ref in zip(prompts, refs):
            _assert_same(ref, _run(eng, p), f"{path.name}: {p[:20]!r}")
        stats = eng.cache.stats()
    for c in layers if evictions else ():
        s = stats[c.il]
        assert s.misses > c.n_slots - len(c.pinned), f"{path.name} layer {c.il}: no eviction ({s})"
        assert s.hits > 0, f"{path.name} layer {c.il}: no reuse"
    assert sum(s.misses for s in stats.values()) > 0 and sum(s.hits for s in stats.values()) > 0
    return stats


@pytest.mark.parametrize("model", ["small_model", "small_random_model"])
def test_demo_model_bit_exact_with_evictions(model, request, rpc_server):
    stats = _exactness(request.getfixturevalue(model), rpc_server.endpoint)
    # slots far below the expert count: decode steps must have evicted experts
    assert sum(s.uploads for s in stats.values()) > sum(s.steps_cached for s in stats.values()) * 0.05


def test_prefill_through_the_cache_is_exact(small_model, rpc_server):
    # ubatches of 2 tokens x k=2 fit 4 LRU slots: prefill takes the cached path too
    stats = _exactness(small_model, rpc_server.endpoint, n_ubatch=2, extra=2, pinned=1)
    assert all(s.steps_stock == 0 for s in stats.values())


def test_long_prefill_then_decode_is_exact(small_model, rpc_server):
    stats = _exactness(small_model, rpc_server.endpoint, prompts=[LONG], evictions=False)
    # the long prefill does not fit the slots: resident experts ran from the banks, the rest on the CPU
    assert all(s.steps_stock == 0 for s in stats.values())
    assert all(s.cpu_experts >= 1 for s in stats.values())
    assert sum(s.blocking_upload_bytes for s in stats.values()) > 0  # decode misses: the upload path


# every tiny model on both miss paths with S = P + k: tests/test_families.py
@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe", "deepseek2", "glm4moe", "gpt-oss"])
def test_tiny_architectures_bit_exact(arch, tiny_models, rpc_server):
    _exactness(tiny_models[arch], rpc_server.endpoint, prompts=PROMPTS[:2])


class _SlotModel:
    """The documented slot rule, independently: pinned experts in the first P slots; a miss
    takes the lowest-index free slot, else the least-recently-used slot not touched this step."""

    def __init__(self, n_slots: int, pinned: tuple[int, ...], k: int):
        self.slots = list(pinned) + [-1] * (n_slots - len(pinned))
        self.pinned, self.k = set(pinned), k
        self.lru: OrderedDict[int, int] = OrderedDict()  # expert -> slot, least recent first

    def step(self, ids: np.ndarray) -> None:
        lru_cap = len(self.slots) - len(self.pinned)
        if ids.size > lru_cap:  # too large for the slots: read-only (bank + CPU), the state is untouched
            return
        distinct = list(dict.fromkeys(int(e) for e in ids.reshape(-1)))
        for e in distinct:
            if e in self.lru:
                self.lru.move_to_end(e)
        for e in distinct:
            if e in self.pinned or e in self.lru:
                continue
            free = [i for i in range(len(self.pinned), len(self.slots)) if self.slots[i] == -1]
            if free:
                slot = free[0]
            else:
                _, slot = self.lru.popitem(last=False)
            self.slots[slot] = e
            self.lru[e] = slot


# an exception in the eval callback (a tensor name it misread) would return false to ggml and stop the graph
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_counters_equal_python_lru_replay(small_model, rpc_server):
    """The cached run's native trace equals the eval callback's ids (an independent capture),
    the counters equal the simulator's replay, and after every decode call each slot holds
    the expert the lowest-free-slot rule puts there."""
    layers, g = _cache_layers(small_model, 1, 1)
    opts = EngineOptions(small_model, n_ctx=512, n_ubatch=4, rpc=[rpc_server.endpoint], cache_layers=layers,
                         trace=True, capture_topk=True)
    models = {c.il: _SlotModel(c.n_slots, c.pinned, g.n_expert_used) for c in layers}
    checked = 0
    with Engine(opts) as eng:
        done = 0

        def replay_and_check() -> None:
            nonlocal done, checked
            for r in eng.records[done:]:  # the eval callback's ids, step by step
                if r.il in models:
                    models[r.il].step(r.ids)
            done = len(eng.records)
            for c in layers:
                assert eng.cache.slots(c.il) == models[c.il].slots, f"layer {c.il} after step {done}"
                checked += 1

        one_token_ubatches = 0
        for p in PROMPTS:
            eng.reset()
            toks = eng.vocab.tokenize(p)
            logits = eng.eval(toks, logits="last")
            replay_and_check()
            one_token_ubatches += len(toks) % 4 == 1  # a 1-token ubatch counts as decode
            for _ in range(16):
                logits = eng.eval([int(np.argmax(logits))], logits="last")
                replay_and_check()
        stats = eng.cache.stats()
        records = eng.cache.trace_records()
        callback = list(eng.records)
        slots = {c.il: eng.cache.slots(c.il) for c in layers}
        counts_pre, counts_dec = eng.cache.routing_counts(PHASE_PREFILL), eng.cache.routing_counts(PHASE_DECODE)
    assert checked == 3 * 17 * len(layers)
    # native trace == eval-callback ids, step by step (the callback also sees the empty steps of the
    # last layer in a prompt's ubatches without outputs; they route nothing)
    callback = [r for r in callback if r.ids.size]
    assert [(r.il, r.phase) for r in records] == [(r.il, r.phase) for r in callback]
    for a, b in zip(records, callback):
        assert np.array_equal(a.ids, b.ids), f"layer {a.il}: trace and callback ids differ"
    trace = records_to_trace(records, g.n_layer, g.n_expert, g.fingerprint)
    sim = simulate(trace, "lru-pinned", {c.il: c.n_slots for c in layers},
                   pinned={c.il: list(c.pinned) for c in layers}, phases=("prefill", "decode"), cpu_path=True)
    for c in layers:
        s, ref = stats[c.il], sim.layers[c.il]
        assert (s.hits, s.misses, s.uploads) == (ref.hits, ref.misses, ref.uploads), f"layer {c.il}"
        assert (s.steps_cached, s.steps_stock) == (ref.cached_steps, ref.stock_steps)
        assert s.misses > c.n_slots - len(c.pinned)  # evictions happened
        assert slots[c.il][: len(c.pinned)] == list(c.pinned)
        held = {e if e >= 0 else -2 - e for e in slots[c.il] if e != -1}
        assert held == set(ref.final_resident)
    pre, dec = records_to_counts(records, g.n_layer, g.n_expert)
    assert np.array_equal(pre, counts_pre) and np.array_equal(dec, counts_dec)
    assert dec.sum() == (3 * 16 + one_token_ubatches) * g.n_expert_used * len(g.moe_layers)


# the auto path with free uploads: every step stages its misses, most entries first, while slices last
STAGE_ALL = MissCosts(cpu_ns=1000, upload_ns=0)


@pytest.mark.parametrize("policy,miss_path", [
    ("lru", "cpu"), ("tinylfu", "cpu"), ("tinylfu", "upload"), ("slru", "cpu"), ("lfu-aged", "cpu"),
    ("tinylfu", "auto"), ("lru", "upload-staged"),
])
def test_counters_equal_python_replay(policy, miss_path, small_model, rpc_server):
    """The native counters and slots equal the simulator's replay of the native trace, for each
    native policy and miss path (ubatches of 4: some prompt steps do not fit the slots); with
    staging slices, the staged misses too (auto with free uploads; upload's large steps)."""
    n_stage = 3 if miss_path in ("auto", "upload-staged") else 0
    miss_path = "upload" if miss_path == "upload-staged" else miss_path
    layers, g = _cache_layers(small_model, 1, 1)
    layers = [CacheLayer(c.il, c.n_slots, c.pinned, miss_path=miss_path, policy=policy) for c in layers]
    opts = EngineOptions(small_model, n_ctx=512, n_ubatch=4, rpc=[rpc_server.endpoint], cache_layers=layers, trace=True,
                         stage_slices=n_stage)
    with Engine(opts) as eng:
        eng.cache.set_miss_costs({c.il: STAGE_ALL for c in layers})
        for p in PROMPTS:
            _run(eng, p, n_decode=16)
        stats = eng.cache.stats()
        records = eng.cache.trace_records()
        slots = {c.il: eng.cache.slots(c.il) for c in layers}
    trace = records_to_trace(records, g.n_layer, g.n_expert, g.fingerprint)
    sim = simulate(trace, "lru-pinned" if policy == "lru" else policy, {c.il: c.n_slots for c in layers},
                   pinned={c.il: list(c.pinned) for c in layers}, phases=("prefill", "decode"), miss_path=miss_path,
                   cpu_path=True, n_stage=n_stage, costs=STAGE_ALL)
    for c in layers:
        s, ref = stats[c.il], sim.layers[c.il]
        got = (s.hits, s.misses, s.uploads, s.cpu_experts, s.admit_skipped, s.staged_uploads)
        want = (ref.hits, ref.misses, ref.uploads, ref.cpu_experts, ref.admit_skipped, ref.staged)
        assert got == want, f"layer {c.il}: native {got} != replay {want}"
        assert (s.steps_cached, s.steps_stock) == (ref.cached_steps, ref.stock_steps)
        # pinned experts never leave their slots; the others hold what the replay holds (-2 - e: pending)
        assert slots[c.il][: len(c.pinned)] == list(c.pinned)
        assert {e if e >= 0 else -2 - e for e in slots[c.il] if e != -1} == set(ref.final_resident)
    if miss_path in ("cpu", "auto"):
        assert sum(s.blocking_upload_bytes for s in stats.values()) == 0
        assert sum(s.async_uploads for s in stats.values()) > 0
    if n_stage:  # the replay staged as native did, and something was staged
        assert sum(s.staged_uploads for s in stats.values()) > 0
        assert sum(s.staged_upload_bytes for s in stats.values()) == sum(
            stats[c.il].staged_uploads * g.layers[c.il].expert_bytes_per_expert for c in layers)


@pytest.mark.parametrize("costs", [STAGE_ALL, MissCosts(cpu_ns=1000, upload_ns=2500)], ids=["stage-all", "split"])
@pytest.mark.parametrize("n_ubatch", [512, 3])
def test_auto_path_bit_exact(costs, n_ubatch, small_model, rpc_server):
    """The per-expert split: staged misses run on the device from staging slices, the rest on the
    CPU, in prompt steps too large for the slots and in decode steps; logits bit-identical to
    all-resident. The split cost rule (2.5 entries' CPU time per upload) sends experts of 3+ entries
    up and the rest to the CPU; with evictions forced (S = P + k + 1)."""
    opts = dict(n_ctx=512, n_batch=512, n_ubatch=n_ubatch, rpc=[rpc_server.endpoint])
    prompts = [PROMPTS[0], LONG]
    with Engine(EngineOptions(small_model, **opts)) as ref_eng:
        refs = [_run(ref_eng, p) for p in prompts]
    layers, g = _cache_layers(small_model, 1, 1)
    layers = [CacheLayer(c.il, c.n_slots, c.pinned, miss_path="auto", policy="tinylfu") for c in layers]
    with Engine(EngineOptions(small_model, cache_layers=layers, stage_slices=4, **opts)) as eng:
        eng.cache.set_miss_costs({c.il: costs for c in layers})
        assert set(eng.cache.miss_paths().values()) == {"auto"}
        for p, ref in zip(prompts, refs):
            _assert_same(ref, _run(eng, p), f"auto {costs}: {p[:20]!r}")
        stats = eng.cache.stats()
    staged = sum(s.staged_uploads for s in stats.values())
    on_cpu = sum(s.cpu_experts for s in stats.values())
    assert staged > 0 and on_cpu > 0, (staged, on_cpu)  # both sides served misses
    assert sum(s.blocking_upload_bytes for s in stats.values()) == 0


def test_bank_memory_matches_plan(small_model, rpc_server):
    layers, g = _cache_layers(small_model, 1, 1)
    with Engine(EngineOptions(small_model, n_ctx=256, rpc=[rpc_server.endpoint], cache_layers=layers)) as eng:
        got = eng.cache.bank_bytes()
    want = sum((c.n_slots + 1) * t.bytes_per_expert for c in layers for t in g.layers[c.il].experts)
    # per-tensor alignment padding only
    assert want <= got <= want + 3 * 512 * len(layers)


def test_counting_only_without_cache_matches_eval_callback(small_model, rpc_server):
    g = load_geometry(small_model)
    opts = EngineOptions(small_model, n_ctx=512, rpc=[rpc_server.endpoint], count_experts=True, capture_topk=True)
    with Engine(opts) as eng:
        for p in PROMPTS:
            _run(eng, p, n_decode=6)
        assert eng.cache.bank_bytes() == 0
        native = eng.cache.routing_counts(PHASE_PREFILL), eng.cache.routing_counts(PHASE_DECODE)
        captured = records_to_counts(eng.records, g.n_layer, g.n_expert)
    assert native[1].sum() > 0
    assert np.array_equal(native[0], captured[0]) and np.array_equal(native[1], captured[1])


@pytest.mark.parametrize("case,match", [
    ("few_slots", "fewer LRU slots"),
    ("out_of_range", "out of range"),
    ("bad_expert", "pinned expert id"),
    ("dup_expert", "pinned expert id"),
    ("twice", "listed twice"),
    ("no_memory", "expert banks need"),
    ("cpu_layer", "not on a GPU-type device"),
])
def test_invalid_configurations_are_errors(case, match, small_model, rpc_server):
    g = load_geometry(small_model)
    k, E = g.n_expert_used, g.n_expert
    cfg = dict(n_ctx=128, rpc=[rpc_server.endpoint])
    layers = {
        "few_slots": [CacheLayer(0, k, (0,))],
        "out_of_range": [CacheLayer(g.n_layer + 3, k + 1)],
        "bad_expert": [CacheLayer(0, k + 1, (E,))],
        "dup_expert": [CacheLayer(0, k + 2, (1, 1))],
        "twice": [CacheLayer(0, k + 1), CacheLayer(0, k + 1)],
        "no_memory": [CacheLayer(il, E - 1) for il in g.moe_layers],
        "cpu_layer": [CacheLayer(0, k + 1)],
    }[case]
    if case == "no_memory":
        cfg["device_budget"] = 1 << 20
    if case == "cpu_layer":
        cfg = dict(n_ctx=128, device="cpu")
    with pytest.raises(NativeError, match=match) as e:
        Engine(EngineOptions(small_model, cache_layers=layers, **cfg))
    assert "\n" not in e.value.one_line()


@pytest.mark.parametrize("arch", ["deepseek2", "glm4moe", "laguna"])
def test_a_dense_layer_is_not_moe(arch, tiny_models, rpc_server):
    """A real dense layer (the leading dense block of deepseek2, glm4moe, laguna) is refused: ERR_NOT_MOE."""
    path = tiny_models[arch]
    g = load_geometry(path)
    dense = [l.index for l in g.layers if not l.is_moe and not l.is_nextn]
    assert dense, f"tiny {arch} has no dense layer"
    with pytest.raises(NativeError, match=f"layer {dense[0]} is not a MoE layer") as e:
        Engine(EngineOptions(path, n_ctx=128, rpc=[rpc_server.endpoint],
                             cache_layers=[CacheLayer(dense[0], g.n_expert_used + 1)]))
    assert "cache only MoE layers" in e.value.one_line()


def test_prompt_routing_is_prefill_in_every_layer(small_model, rpc_server):
    # the last layer routes only the output row of a prompt; it is still prefill
    g = load_geometry(small_model)
    opts = EngineOptions(small_model, n_ctx=256, rpc=[rpc_server.endpoint], count_experts=True, capture_topk=True)
    with Engine(opts) as eng:
        toks = eng.vocab.tokenize(PROMPTS[1])
        eng.eval(toks, logits="last")
        pre, dec = eng.cache.routing_counts(PHASE_PREFILL), eng.cache.routing_counts(PHASE_DECODE)
        cap_pre, cap_dec = records_to_counts(eng.records, g.n_layer, g.n_expert)
    last = max(g.moe_layers)
    assert dec.sum() == 0 and cap_dec.sum() == 0
    assert pre[last].sum() == g.n_expert_used  # one output row
    assert all(pre[il].sum() == len(toks) * g.n_expert_used for il in g.moe_layers if il != last)
    assert np.array_equal(pre, cap_pre)


@pytest.mark.gpu
def test_cuda_cache_bit_exact(small_model):
    """On a CUDA build with a GPU: the same exactness contract on the real device. Ubatches
    of 2 tokens fit the LRU slots, so prefill runs the same CUDA kernels on banks too."""
    from spark_cli.native import llama_lib

    gpus = [d for d in llama_lib.gpu_devices() if not d.name.startswith("RPC")]
    assert gpus, "a CUDA device is present but this llama.cpp build does not see it (build with SPARK_CUDA=1)"
    opts = dict(n_ctx=512, n_ubatch=2, device=gpus[0].name)
    with Engine(EngineOptions(small_model, **opts)) as ref_eng:
        refs = [_run(ref_eng, p) for p in PROMPTS]
    layers, _ = _cache_layers(small_model, 2, 1)
    with Engine(EngineOptions(small_model, cache_layers=layers, **opts)) as eng:
        for p, ref in zip(PROMPTS, refs):
            _assert_same(ref, _run(eng, p), f"CUDA {p[:20]!r}")
