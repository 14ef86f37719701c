"""-t/--threads and -tb/--threads-batch reach the CPU miss path, not only llama.cpp's context:
its host node runs on the graph's threads with a worker for each (the native params carry the
larger count), and `auto`'s calibration is measured, keyed and labelled per thread count (stock
--n-cpu-moe computes its CPU experts on every thread; so must Spark)."""

from __future__ import annotations

import pytest

from spark_cli.core.gguf_info import load_geometry
from spark_cli.core.simulator import PolicyParams
from spark_cli.native.engine import CacheLayer, Engine, EngineOptions
from spark_cli.native.expert_cache import ExpertCache
from spark_cli.runs import miss_path

pytestmark = pytest.mark.model

FIELDS = ("n_threads", "policy_window", "slru_protected_num", "slru_protected_den")


@pytest.fixture
def native_params(monkeypatch):
    """The params struct each ExpertCache.init hands to llama_expert_cache_init, as a dict."""
    seen: list[dict] = []
    orig = ExpertCache.init

    def init(self, *args, **kw):
        real = self.api.init

        def spy(ctx, params_ref, err, n):
            p = params_ref._obj
            seen.append({f: getattr(p, f) for f in FIELDS})
            return real(ctx, params_ref, err, n)

        self.api.init = spy
        try:
            return orig(self, *args, **kw)
        finally:
            self.api.init = real

    monkeypatch.setattr(ExpertCache, "init", init)
    return seen


def _options(model, endpoint, **kw) -> EngineOptions:
    g = load_geometry(model)
    layers = [CacheLayer(il, g.n_expert_used + 1, (0,), miss_path="cpu") for il in g.moe_layers]
    return EngineOptions(model, n_ctx=256, n_batch=256, rpc=[endpoint], cache_layers=layers, **kw)


@pytest.mark.parametrize("threads, batch, want", [(1, None, (1, 1)), (2, 1, (2, 1)), (1, 2, (1, 2))])
def test_native_params_carry_the_thread_counts(native_params, small_model, rpc_server, threads, batch, want):
    with Engine(_options(small_model, rpc_server.endpoint, n_threads=threads, n_threads_batch=batch)) as eng:
        assert (eng.cpu_threads, eng.cpu_threads_batch) == want
    p = native_params[-1]
    assert p["n_threads"] == max(want)  # workers for the larger of the graph's thread counts
    d = PolicyParams()
    assert (p["policy_window"], p["slru_protected_num"], p["slru_protected_den"]) == (
        d.window, d.protected_num, d.protected_den)


def test_calibration_is_per_thread_count(small_model, rpc_server, tmp_path):
    fp = load_geometry(small_model).fingerprint
    lines = {}
    for threads in (1, 2):
        with Engine(_options(small_model, rpc_server.endpoint, n_threads=threads)) as eng:
            _, lines[threads] = miss_path.resolve(eng, "auto", fp, tmp_path)
    assert "on 1 thread;" in lines[1] and "on 2 threads;" in lines[2]
    assert all("calibrated now" in line for line in lines.values())  # 2 threads did not reuse 1's figures
    assert len(list((tmp_path / "calibration").glob("*.json"))) == 2


@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_miss_path_exact_at_any_thread_count(small_model, rpc_server, threads):
    """The miss path's experts are split across the graph's threads, each on its own one-thread
    backend: logits equal the all-resident run's bit for bit whatever -t/-tb say."""
    from test_expert_cache import _assert_same

    from spark_cli.runs.exactness import logits, reference

    base = dict(n_ctx=512, n_batch=512, rpc=[rpc_server.endpoint])
    ref = reference(EngineOptions(small_model, **base), 4, lengths=(1, 12, 40))
    g = load_geometry(small_model)
    layers = [CacheLayer(il, g.n_expert_used + 1, (0,), miss_path="cpu") for il in g.moe_layers]
    with Engine(EngineOptions(small_model, cache_layers=layers, n_threads=threads, n_threads_batch=threads,
                              **base)) as eng:
        for p, rl, toks in zip(ref.prompts, ref.logits, ref.fed):
            _assert_same((rl, toks), logits(eng, p, None, 4), f"{threads} threads, {len(p)} tokens")
        stats = eng.cache.stats()
    assert sum(s.cpu_experts for s in stats.values()) > 0 and sum(s.cpu_us for s in stats.values()) > 0
