"""Several sequences decoded together (native/generate.BatchLoop, -np): continuous batching of
prompts of mixed lengths beside decoding sequences, on the RPC stand-in through the expert cache.

Exactness, checked honestly: through the cache, a batched run's logits equal the all-resident
run's with the same batching bit for bit (the cache's contract). Against the same sequence
decoded alone, llama.cpp itself need not be batch-invariant (a step of 4 tokens may take other
kernels than a step of 1): the cache may differ from alone by no more than stock llama.cpp does."""

from __future__ import annotations

import numpy as np
import pytest

from spark_cli.core.gguf_info import load_geometry
from spark_cli.core.simulator import MissCosts
from spark_cli.core.trace import DECODE
from spark_cli.native.engine import CacheLayer, Engine, EngineOptions
from spark_cli.native.generate import BatchLoop, Decoding, Greedy, StopRules
from spark_cli.models.tiny_models import build_tiny_model

pytestmark = pytest.mark.model

N_DECODE = 8
WORDS = ("the cat sat on the mat while a dog barked at the moon and then everyone went "
         "home to sleep until the morning came with rain").split()


def _prompts(eng: Engine, lengths: tuple[int, ...]) -> list[list[int]]:
    out = []
    for n in lengths:
        toks = eng.vocab.tokenize(" ".join(WORDS[i % len(WORDS)] for i in range(n)))
        out.append(toks[:n])
    return out


def _run(eng: Engine, prompts: list[list[int]], together: bool) -> list[tuple[list[int], np.ndarray]]:
    """Each prompt's greedy tokens and the logits after each, decoded all at once (together) or
    one after another; each prompt in its own sequence."""
    eng.reset()
    loop = BatchLoop(eng)
    got: dict[int, tuple[list[int], list[np.ndarray]]] = {i: ([], []) for i in range(len(prompts))}

    def add(i: int) -> None:
        dec = Decoding(eng, i, n_prompt=len(prompts[i]), sampler=Greedy(), max_tokens=N_DECODE,
                       stop=StopRules(eog=False), keep_logits=True)

        def emit(step, i=i) -> None:
            if step.token is not None:
                got[i][0].append(step.token)
                got[i][1].append(step.logits)

        loop.add(dec, emit, prompt=prompts[i])

    for i in range(len(prompts)):
        add(i)
        if not together:
            while loop.busy:
                loop.step()
    shapes = []
    while loop.busy:
        shapes.append(loop.step())
    if together:
        # continuous batching: some step mixed prompt chunks with the decode tokens of other sequences
        assert any(s.prompt_tokens and s.decode_tokens for s in shapes), shapes
        assert max(s.decode_tokens for s in shapes) == len(prompts)
    return [(t, np.stack(l)) for t, l in got.values()]


def _diff(a, b) -> float:
    return max(float(np.abs(x[1].astype(np.float64) - y[1]).max()) for x, y in zip(a, b))


def _cached(path, costs: MissCosts | None) -> tuple[list[CacheLayer], MissCosts | None]:
    g = load_geometry(path)
    k = g.n_expert_used
    path_name = "auto" if costs is not None else "cpu"
    return [CacheLayer(il, k + 2, (0,), miss_path=path_name, policy="lru") for il in g.moe_layers], costs


@pytest.mark.parametrize("model,n_seq,costs", [
    ("demo", 4, None),
    ("demo", 4, MissCosts(cpu_ns=1000, upload_ns=2500)),
    ("qwen35moe", 3, None),
], ids=["demo-cpu", "demo-auto", "qwen35moe-hybrid"])
def test_batched_sequences_match_alone(model, n_seq, costs, small_model, rpc_server):
    path = small_model if model == "demo" else build_tiny_model(model)
    opts = dict(n_ctx=256 * n_seq, n_batch=24, n_ubatch=24, n_seq=n_seq, rpc=[rpc_server.endpoint], n_threads=1)
    lengths = (1, 30, 9, 45)[:n_seq]
    with Engine(EngineOptions(path, **opts)) as ref:
        assert ref.n_seq == n_seq and ref.n_ctx == 256
        prompts = _prompts(ref, lengths)
        stock_alone, stock_together = _run(ref, prompts, False), _run(ref, prompts, True)
    layers, costs = _cached(path, costs)
    with Engine(EngineOptions(path, cache_layers=layers, stage_slices=4 if costs else 0, **opts)) as eng:
        if costs is not None:
            eng.cache.set_miss_costs({c.il: costs for c in layers})
        alone = _run(eng, prompts, False)
        eng.reset_stats()
        together = _run(eng, prompts, True)
        stats, decoded = eng.cache.stats(), eng.cache.routing_counts(DECODE).sum()
    # the cache's contract, with the same batching: bit for bit the all-resident run
    for (t, l), (rt, rl), n in zip(together, stock_together, lengths):
        assert t == rt and np.array_equal(l, rl), f"{model}: {n}-token prompt, batched, max |d| {np.abs(l - rl).max()}"
    for (t, l), (rt, rl), n in zip(alone, stock_alone, lengths):
        assert t == rt and np.array_equal(l, rl), f"{model}: {n}-token prompt, alone"
    # batched against alone: no further from it than stock llama.cpp is
    bound = _diff(stock_together, stock_alone)
    assert _diff(together, alone) <= bound
    if bound == 0:
        assert [t for t, _ in together] == [t for t, _ in alone]
    assert sum(s.misses for s in stats.values()) > 0 and sum(s.hits for s in stats.values()) > 0
    # a step of one token per sequence is a decode step: counted as decode, and it admits
    g = load_geometry(path)
    assert decoded >= n_seq * (N_DECODE - 2) * g.n_expert_used * len(g.moe_layers)
    assert sum(s.async_uploads for s in stats.values()) > 0
    if costs is not None:
        assert sum(s.staged_uploads for s in stats.values()) > 0


def test_a_sequence_ends_while_others_go_on(small_model, rpc_server):
    """Sequences of different lengths leave the loop as they end; their KV entries stay, and a
    new sequence started mid-way in a freed one joins the next step."""
    opts = dict(n_ctx=512, n_batch=64, n_ubatch=64, n_seq=2, rpc=[rpc_server.endpoint], n_threads=1)
    with Engine(EngineOptions(small_model, **opts)) as eng:
        p = _prompts(eng, (12, 20))
        loop = BatchLoop(eng)
        ends: list[tuple[int, str, int]] = []
        order: list[int] = []

        def emit(seq):
            def f(step) -> None:
                if step.token is not None:
                    order.append(seq)
                if step.finish:
                    ends.append((seq, step.finish, step.generated_tokens))
            return f

        loop.add(Decoding(eng, 0, n_prompt=12, max_tokens=2, stop=StopRules(eog=False)), emit(0), prompt=p[0])
        loop.add(Decoding(eng, 1, n_prompt=20, max_tokens=9, stop=StopRules(eog=False)), emit(1), prompt=p[1])
        while loop.busy:
            loop.step()
            if ends == [(0, "length", 2)] and 0 not in loop.active and len(order) < 11:
                assert eng.seq_pos(0) == 12 + 2
                eng.truncate(0, seq=0)
                loop.add(Decoding(eng, 0, n_prompt=12, max_tokens=3, stop=StopRules(eog=False)), emit(2), prompt=p[0])
        assert sorted(ends) == [(0, "length", 2), (1, "length", 9), (2, "length", 3)]
        assert eng.seq_pos(1) == 20 + 9 and eng.seq_pos(0) == 12 + 3
        assert order.index(2) < len(order) - order[::-1].index(1) - 1  # the new one decoded beside seq 1


def test_prompt_progress_after_each_chunk():
    """on_progress: a report before any prompt token is evaluated (processed == cache), then one
    after each chunk of that sequence's own (none for a step that took none of it), the cached
    prefix as cache, the last at total; reporting changes nothing the loop computes."""
    opts = EngineOptions(build_tiny_model("llama"), n_ctx=256, n_batch=16, n_ubatch=16, n_seq=2, device="none",
                         n_threads=1)
    with Engine(opts) as eng:
        p = _prompts(eng, (20, 30))

        def run(report: bool) -> tuple[dict[int, list[tuple[int, int, int, float]]], list[int]]:
            eng.reset()
            loop = BatchLoop(eng)
            # sequence 1 holds the first 10 tokens of its prompt already
            loop.add(Decoding(eng, 1, n_prompt=10, max_tokens=0), lambda step: None, prompt=p[1][:10])
            while loop.busy:
                loop.step()
            seen: dict[int, list[tuple[int, int, int, float]]] = {0: [], 1: []}
            tokens: list[int] = []
            for seq, cached in ((0, 0), (1, 10)):
                def progress(r, seq=seq) -> None:
                    seen[seq].append((r.total, r.cache, r.processed, r.seconds))
                loop.add(Decoding(eng, seq, n_prompt=len(p[seq]) - cached, max_tokens=3, stop=StopRules(eog=False)),
                         lambda step: tokens.append(step.token), prompt=p[seq][cached:], cached=cached,
                         on_progress=progress if report else None)
            while loop.busy:
                loop.step()
            return seen, tokens

        seen, tokens = run(True)
        quiet, same = run(False)
    # n_batch 16: sequence 0 takes 16 then 4 tokens; sequence 1 none, then 12, then its last 8
    assert [r[:3] for r in seen[0]] == [(20, 0, 0), (20, 0, 16), (20, 0, 20)]
    assert [r[:3] for r in seen[1]] == [(30, 10, 10), (30, 10, 22), (30, 10, 30)]
    for reports in seen.values():
        ms = [r[3] for r in reports]
        assert ms[0] == 0.0 and ms == sorted(ms) and ms[-1] > 0
    assert quiet == {0: [], 1: []} and tokens == same
