"""The CPU miss path on the RPC stand-in GPU: resident experts on the device from the banks,
misses on the CPU from the host weights, admissions uploaded in the background. Both sides
run ggml-cpu kernels, so logits must equal the all-resident run bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from spark_cli.exactness import MIXED_SLACK, max_diff, prompts, reference, within_bound
from spark_cli.engine import CacheLayer, Engine, EngineOptions
from spark_cli.gguf_info import load_geometry

pytestmark = pytest.mark.model

N_DECODE = 10


def _run(eng: Engine, toks: list[int]) -> tuple[np.ndarray, list[int], list[np.ndarray]]:
    eng.reset()
    prefill = eng.eval(toks, logits="all")
    logits, out, steps = prefill[-1], [], []
    for _ in range(N_DECODE):
        t = int(np.argmax(logits))
        out.append(t)
        logits = eng.eval([t], logits="last")
        steps.append(logits)
    return prefill, out, steps


def _same(ref, got, what: str) -> None:
    assert np.array_equal(ref[0], got[0]), f"{what}: prefill logits differ"
    assert ref[1] == got[1], f"{what}: greedy tokens differ"
    for i, (a, b) in enumerate(zip(ref[2], got[2])):
        assert np.array_equal(a, b), f"{what}: decode step {i} differs (max |d| {np.abs(a - b).max()})"


def _check(path, endpoint: str, miss_path: str, n_ubatch: int = 512, pinned: int = 1) :
    opts = dict(n_ctx=512, n_batch=512, n_ubatch=n_ubatch, rpc=[endpoint])
    with Engine(EngineOptions(path, **opts)) as ref_eng:
        ps = prompts(ref_eng)
        refs = [_run(ref_eng, p) for p in ps]
    g = load_geometry(path)
    k = g.n_expert_used
    # S = P + k: every step that misses must evict
    layers = [CacheLayer(il, pinned + k, tuple(range(pinned)), miss_path=miss_path) for il in g.moe_layers]
    with Engine(EngineOptions(path, cache_layers=layers, **opts)) as eng:
        for p, ref in zip(ps, refs):
            _same(ref, _run(eng, p), f"{path.name} {miss_path} {len(p)} tokens")
        return eng.cache_stats()


def _total(stats, key: str) -> int:
    return sum(getattr(s, key) for s in stats.values())


@pytest.mark.parametrize("miss_path", ["cpu", "upload"])
def test_demo_model_exact_on_both_miss_paths(miss_path, small_model, rpc_server):
    stats = _check(small_model, rpc_server.endpoint, miss_path)
    assert _total(stats, "misses") > 0 and _total(stats, "hits") > 0
    assert _total(stats, "steps_stock") == 0  # prefills too large for the slots still use the banks
    # one device -> host stop per cached layer and step
    assert all(s.syncs == s.steps_cached for s in stats.values())
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


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe", "deepseek2", "glm4moe", "gpt-oss"])
def test_tiny_architectures_exact_on_cpu_path(arch, rpc_server):
    from spark_cli.demo_model import build_tiny_model

    stats = _check(build_tiny_model(arch), rpc_server.endpoint, "cpu")
    assert _total(stats, "cpu_experts") > 0, f"{arch}: the CPU miss path was not used"
    assert _total(stats, "blocking_upload_bytes") == 0


def test_switching_the_miss_path_keeps_results(small_model, rpc_server):
    opts = dict(n_ctx=512, rpc=[rpc_server.endpoint])
    with Engine(EngineOptions(small_model, **opts)) as ref_eng:
        toks = prompts(ref_eng, (12,))[0]
        ref = _run(ref_eng, toks)
    g = load_geometry(small_model)
    layers = [CacheLayer(il, g.n_expert_used + 1, (0,)) for il in g.moe_layers]
    with Engine(EngineOptions(small_model, cache_layers=layers, **opts)) as eng:
        for path in ("cpu", "upload", "cpu"):
            eng.set_miss_path(path)
            assert eng.miss_paths() == {il: path for il in g.moe_layers}
            _same(ref, _run(eng, toks), f"after switching to {path}")


@pytest.mark.gpu
@pytest.mark.parametrize("miss_path", ["cpu", "upload"])
def test_cuda_miss_paths_within_the_stock_bound(miss_path, small_model):
    """On CUDA each expert's output is the device kernel's or the CPU kernel's: cached logits may
    differ from all-resident by about what stock --cpu-moe (every expert on the CPU) shows on the
    same prompts and tokens (the all-resident run's greedy tokens are fed to every run)."""
    from spark_cli import llama_lib

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
