"""The native policy core (native/src/llama-expert-cache-policy.cpp) against simulator.LayerCache.

Fast tier: the core is std C++ only, so it is compiled here with the system compiler (no
llama.cpp, no model) and driven through native/tests/policy-shim.cpp. Random steps go through
both, for every policy and miss path; after every step the slots, ticks, segments, counts,
hits, misses, admissions and pending state must agree, and the slot ids the expert matmuls
read must follow the filler rule (design.md, "Expert cache semantics").
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spark_cli.core.simulator import NATIVE_POLICY_IDS, POLICIES, LayerCache, MissCosts, PolicyParams

REPO = Path(__file__).resolve().parent.parent
SOURCES = [REPO / "native" / "src" / "llama-expert-cache-policy.cpp", REPO / "native" / "tests" / "policy-shim.cpp"]
NATIVE_POLICIES = [p for p in POLICIES if p in ("lru", "lfu-aged", "slru", "tinylfu")]
NATIVE_MISS_PATH_IDS = {"upload": 0, "cpu": 1, "auto": 2}

i32p = ctypes.POINTER(ctypes.c_int32)


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    """The core and the shim compiled once per session: a loaded library, or why there is none."""
    cxx = _compiler()
    if cxx is None:
        return "no C++ compiler (CXX, c++, g++ or clang++) on PATH: the policy core test needs one (apt-get install g++)"
    so = tmp_path_factory.mktemp("policy_core") / "libecp.so"
    cmd = [cxx, "-O1", "-std=c++17", "-shared", "-fPIC", "-I", str(REPO / "native" / "src"), *map(str, SOURCES), "-o", str(so)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        return f"compiling the policy core failed:\n{' '.join(cmd)}\n{r.stderr}"
    lib = ctypes.CDLL(str(so))
    lib.ecp_new.restype = ctypes.c_void_p
    lib.ecp_new.argtypes = [ctypes.c_int32, ctypes.c_int32, i32p] + [ctypes.c_int32] * 8
    lib.ecp_set_costs.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int32]
    lib.ecp_free.argtypes = [ctypes.c_void_p]
    lib.ecp_step.restype = ctypes.c_int32
    lib.ecp_step.argtypes = [ctypes.c_void_p, i32p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32,
                             i32p, i32p, i32p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    lib.ecp_state.argtypes = [ctypes.c_void_p] + [ctypes.c_void_p] * 6
    lib.ecp_fill_free.restype = ctypes.c_int32
    lib.ecp_fill_free.argtypes = [ctypes.c_void_p, i32p, ctypes.c_int64, ctypes.c_int64, i32p]
    return lib


def loaded(built):
    if isinstance(built, str):
        pytest.fail(built, pytrace=False)  # a failure in the test, never a skip: the fast tier must run this
    return built


def _ptr(a: np.ndarray):
    return a.ctypes.data_as(ctypes.c_void_p)


class Native:
    """One layer of the native core, stepped as the host node steps it."""

    def __init__(self, lib, n_expert, slots, pinned, policy, miss_path, max_admit, params: PolicyParams,
                 n_stage: int = 0, costs: MissCosts = MissCosts()):
        self.lib, self.n_expert, self.S = lib, n_expert, slots
        pin = (ctypes.c_int32 * max(1, len(pinned)))(*pinned)
        self.h = lib.ecp_new(n_expert, slots, pin, len(pinned), NATIVE_POLICY_IDS[policy], NATIVE_MISS_PATH_IDS[miss_path],
                             max_admit, params.window, params.protected_num, params.protected_den, n_stage)
        lib.ecp_set_costs(self.h, costs.cpu_expert_ns, costs.cpu_ns, costs.upload_ns, int(costs.concurrent))

    def close(self):
        self.lib.ecp_free(self.h)

    def step(self, rows: list[list[int]], decode: bool, hybrid: bool):
        T, k = len(rows), len(rows[0])
        ids = np.asarray(rows, dtype=np.int32)
        out = np.zeros(10, dtype=np.int32)
        admit = np.zeros(2 * self.n_expert, dtype=np.int32)
        dst = np.full(T * k, -7, dtype=np.int32)
        missed = np.full(T * k, 7, dtype=np.uint8)
        waits = np.zeros(self.S, dtype=np.uint8)
        err = ctypes.create_string_buffer(256)
        rc = self.lib.ecp_step(self.h, ids.ctypes.data_as(i32p), T, k, int(decode), int(hybrid),
                               out.ctypes.data_as(i32p), admit.ctypes.data_as(i32p), dst.ctypes.data_as(i32p),
                               _ptr(missed), _ptr(waits), err, len(err))
        assert rc == 0, f"native step failed: {err.value.decode()}"
        o = dict(zip(("hits", "misses", "cpu", "skipped", "n_admit", "fits", "to_cpu", "read_only", "n_staged", "split"),
                     out.tolist()))
        o["admitted"] = [tuple(p) for p in admit[: 2 * o["n_admit"]].reshape(-1, 2).tolist()]
        return o, dst.reshape(T, k), missed.reshape(T, k), set(np.flatnonzero(waits).tolist())

    def fill_free(self, rows: list[list[int]]) -> list[tuple[int, int]]:
        ids = np.asarray(rows, dtype=np.int32)
        admit = np.zeros(2 * self.n_expert, dtype=np.int32)
        n = self.lib.ecp_fill_free(self.h, ids.ctypes.data_as(i32p), len(rows), len(rows[0]), admit.ctypes.data_as(i32p))
        assert n >= 0, "native fill_free refused the ids"
        return [tuple(p) for p in admit[: 2 * n].reshape(-1, 2).tolist()]

    def state(self):
        se = np.zeros(self.S, dtype=np.int32)
        tick = np.zeros(self.S, dtype=np.uint64)
        seg = np.zeros(self.S, dtype=np.uint8)
        es = np.zeros(self.n_expert, dtype=np.int32)
        freq = np.zeros(self.n_expert, dtype=np.uint32)
        sc = np.zeros(3, dtype=np.int64)
        self.lib.ecp_state(self.h, _ptr(se), _ptr(tick), _ptr(seg), _ptr(es), _ptr(freq), _ptr(sc))
        return dict(slot_expert=se.tolist(), slot_tick=tick.tolist(), slot_seg=seg.tolist(), expert_slot=es.tolist(),
                    freq=freq.tolist(), protected=int(sc[0]), age=int(sc[1]), tick=int(sc[2]))


def expected_state(c: LayerCache) -> dict:
    """The simulator's state in the native encoding (-2 - e: pending; expert_slot of ready slots only)."""
    se = [-2 - e if c.slot_pending[s] else e for s, e in enumerate(c.slot_expert)]
    es = [s if s >= 0 and not c.slot_pending[s] else -1 for s in c.expert_slot]
    return dict(slot_expert=se, slot_tick=list(c.slot_tick), slot_seg=list(c.slot_seg), expert_slot=es,
                freq=list(c.freq), protected=c.protected, age=c.age, tick=c.tick)


def expected_slot_ids(c: LayerCache, rows: list[list[int]], staged: list[int] = ()
                      ) -> tuple[list[list[int]], list[list[int]], set[int]]:
    """Slot ids per entry: a ready slot, a staged miss's staging slice (S + 1 + its index), else a
    filler no other entry of the token reads (the zeroed guard S, then the lowest slot not pending,
    then a pending slot, which the device waits for)."""
    S = c.S
    stage = {e: S + 1 + i for i, e in enumerate(staged)}
    ids, missed, waits = [], [], set()
    for r in rows:
        row = [c.expert_slot[e] if c.expert_slot[e] >= 0 and not c.slot_pending[c.expert_slot[e]]
               else stage.get(e, -1) for e in r]
        missed.append([int(s < 0) for s in row])
        for j, s in enumerate(row):
            if s >= 0:
                continue
            free = [f for f in [S, *range(S)] if f not in row]
            ready = [f for f in free if f == S or not c.slot_pending[f]]
            row[j] = ready[0] if ready else free[0]
            if not ready:
                waits.add(free[0])
        ids.append(row)
    return ids, missed, waits


@st.composite
def cases(draw, miss_path: str):
    n_expert = draw(st.integers(2, 12))
    k = draw(st.integers(1, min(4, n_expert)))
    n_pin = draw(st.integers(0, min(3, n_expert - k)))
    slots = draw(st.integers(n_pin + k, n_expert))
    pinned = draw(st.permutations(range(n_expert)))[:n_pin]
    max_admit = draw(st.integers(0, k + 1))
    den = draw(st.integers(1, 4))
    params = PolicyParams(window=draw(st.sampled_from([0, 1, 2, 3, 16])), protected_num=draw(st.integers(0, den)),
                          protected_den=den)
    # the upload path on a layer without a CPU recipe: steps too large for the slots are stock
    hybrid = miss_path != "upload" or draw(st.booleans())
    n_stage = draw(st.integers(0, 4))
    costs = MissCosts(draw(st.integers(0, 50)), draw(st.integers(0, 200)), draw(st.booleans()), draw(st.integers(0, 100)))
    hot = draw(st.integers(k, n_expert))  # routing concentrated on the first `hot` experts: hits happen
    token = st.lists(st.integers(0, hot - 1), min_size=k, max_size=k, unique=True)
    steps = []
    for _ in range(draw(st.integers(1, 30))):
        rows = draw(st.lists(token, min_size=1, max_size=draw(st.sampled_from([1, 1, 2, 5]))))
        decode = len(rows) == 1 and draw(st.booleans())
        if hybrid or len(rows) * k <= slots - n_pin:
            steps.append((rows, decode))
    return n_expert, slots, pinned, max_admit, params, hybrid, steps, n_stage, costs


def replay(lib, policy, miss_path, case):
    n_expert, slots, pinned, max_admit, params, hybrid, steps, n_stage, costs = case
    sim = LayerCache(n_expert, slots, pinned, policy, miss_path, max_admit, params, n_stage, costs)
    nat = Native(lib, n_expert, slots, pinned, policy, miss_path, max_admit, params, n_stage, costs)
    try:
        assert nat.state() == expected_state(sim), "initial state"
        for t, (rows, decode) in enumerate(steps):
            large = len(rows) * len(rows[0]) > slots - len(pinned)
            distinct = list(dict.fromkeys(e for r in rows for e in r))
            entries = {e: sum(r.count(e) for r in rows) for e in distinct}
            o = sim.step(distinct, decode, large=large, entries=entries)
            got, dst, missed, waits = nat.step(rows, decode, hybrid)
            where = f"step {t} ({len(rows)} tokens, {'decode' if decode else 'prefill'}{', large' if large else ''})"
            on_cpu = miss_path != "upload" or large
            assert got["read_only"] == int(large or (miss_path != "upload" and not decode)), where
            assert got["to_cpu"] == int(on_cpu), where
            assert got["split"] == int(on_cpu and n_stage > 0 and miss_path != "cpu"), where
            want = dict(hits=len(o.hits), misses=len(o.misses), cpu=len(o.misses) - len(o.staged) if on_cpu else 0,
                        skipped=o.skipped, admitted=list(o.admitted), n_staged=len(o.staged))
            assert {k: got[k] for k in want} == want, where
            assert nat.state() == expected_state(sim), where
            ids, miss, wait = expected_slot_ids(sim, rows, o.staged)
            assert dst.tolist() == ids, f"{where}: slot ids"
            assert missed.tolist() == miss, f"{where}: CPU-computed entries"
            assert waits == wait, f"{where}: pending fillers"
            for r in dst.tolist():
                assert len(set(r)) == len(r), f"{where}: a slot id twice in a token"
    finally:
        nat.close()


@pytest.mark.parametrize("miss_path", list(NATIVE_MISS_PATH_IDS))
@pytest.mark.parametrize("policy", NATIVE_POLICIES)
def test_native_core_equals_layer_cache(built, policy, miss_path):
    core = loaded(built)

    @settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(case=cases(miss_path))
    def check(case):
        replay(core, policy, miss_path, case)

    check()


def test_every_native_policy_is_checked():
    assert set(NATIVE_POLICIES) == {p for p in NATIVE_POLICY_IDS if p != "lru-pinned"}


def test_bad_id_is_an_error_not_a_crash(built):
    nat = Native(loaded(built), 4, 2, [], "lru", "upload", 1, PolicyParams())
    try:
        with pytest.raises(AssertionError, match="out of range"):
            nat.step([[5]], True, True)
        o, dst, _, _ = nat.step([[1]], True, True)  # the core is usable after the refusal
        assert (o["misses"], o["admitted"], dst.tolist()) == (1, [(1, 0)], [[0]])
    finally:
        nat.close()


def test_split_stages_while_the_step_ends_sooner():
    """Worked cases of the per-expert rule (simulator; the native core follows it above)."""
    from spark_cli.core.simulator import split_misses
    entries = {3: 10, 5: 1, 7: 4, 9: 4}
    # CPU 100 ns an entry (1900 ns in all), upload 300 ns, side by side: staging 3 ends the step at
    # max(300, 900), then 7 (ties by id) at max(600, 500); 9 would end it at max(900, 100): later
    side = MissCosts(cpu_ns=100, upload_ns=300, concurrent=True)
    assert split_misses([5, 7, 3, 9], entries, 8, side, by_cost=True) == [3, 7]
    assert split_misses([5, 7, 3, 9], entries, 8, MissCosts(100, 450, True), by_cost=True) == [3]
    # one after the other: every expert whose CPU time beats one upload (1000, 400, 400 > 300 > 100)
    serial = MissCosts(cpu_ns=100, upload_ns=300, concurrent=False)
    assert split_misses([5, 7, 3, 9], entries, 8, serial, by_cost=True) == [3, 7, 9]
    # no cost rule (the upload path's large steps): most entries first while slices last
    assert split_misses([5, 7, 3, 9], entries, 3, serial, by_cost=False) == [3, 7, 9]
    # free uploads stage everything that fits; a CPU that costs nothing keeps everything
    assert split_misses([5, 7, 3, 9], entries, 8, MissCosts(100, 0, True), by_cost=True) == [3, 7, 9, 5]
    assert split_misses([5, 7, 3, 9], entries, 8, MissCosts(0, 10, True), by_cost=True) == []
    # a fixed CPU cost per expert (its weights read once): 5's one entry costs 1100 ns > 300 one after the other
    assert split_misses([5, 7, 3, 9], entries, 8, MissCosts(100, 300, False, 1000), by_cost=True) == [3, 7, 9, 5]


@st.composite
def ram_tier_cases(draw):
    """The RAM tier (native's file tier: the upload path, no CPU recipe): prompts too large for the
    LRU slots, one-token decode steps and small prompts, in any order."""
    n_expert = draw(st.integers(2, 12))
    k = draw(st.integers(1, min(4, n_expert)))
    n_pin = draw(st.integers(0, min(3, n_expert - k)))
    slots = draw(st.integers(n_pin + k, n_expert))
    pinned = draw(st.permutations(range(n_expert)))[:n_pin]
    token = st.lists(st.integers(0, n_expert - 1), min_size=k, max_size=k, unique=True)
    steps = [draw(st.lists(token, min_size=1, max_size=draw(st.sampled_from([1, 1, 2, 5, 12]))))
             for _ in range(draw(st.integers(1, 25)))]
    return n_expert, slots, pinned, steps


@pytest.mark.parametrize("policy", NATIVE_POLICIES)
def test_ram_tier_prompt_fills_free_slots_as_the_simulator(built, policy):
    """A step too large for the LRU slots fills the free ones (the misses with most entries, the
    hottest last), as LayerCache.fill_free says; every other step is the policy's. State after every
    step equal; and a prompt with free slots places exactly min(free, misses) experts."""
    core = loaded(built)

    @settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(case=ram_tier_cases())
    def check(case):
        n_expert, slots, pinned, steps = case
        params = PolicyParams()
        sim = LayerCache(n_expert, slots, pinned, policy, "upload", 1 << 30, params, fill_free=True)
        nat = Native(core, n_expert, slots, pinned, policy, "upload", 1 << 30, params)
        try:
            for t, rows in enumerate(steps):
                distinct = list(dict.fromkeys(e for r in rows for e in r))
                entries = {e: sum(r.count(e) for r in rows) for e in distinct}
                where = f"step {t} ({len(rows)} tokens)"
                if len(rows) * len(rows[0]) > slots - len(pinned):
                    free, miss = sim.n_free, sum(sim.expert_slot[e] < 0 for e in distinct)
                    o = sim.step(distinct, False, large=True, entries=entries)
                    assert len(o.admitted) == min(free, miss), where
                    assert nat.fill_free(rows) == o.admitted, where
                else:
                    sim.step(distinct, len(rows) == 1)
                    nat.step(rows, len(rows) == 1, False)
                assert nat.state() == expected_state(sim), where
        finally:
            nat.close()

    check()


def test_fill_free_places_the_most_routed_last():
    """Worked case: 2 free slots, misses 3 (5 entries), 1 (2), 2 (2): 3 and 1 (ties by id) placed, 1 first."""
    c = LayerCache(6, 3, [0], "lru", "upload", fill_free=True)
    o = c.step([0, 3, 1, 2], False, large=True, entries={0: 9, 3: 5, 1: 2, 2: 2})
    assert o.admitted == [(1, 1), (3, 2)] and o.hits == [0] and o.misses == [3, 1, 2]
    assert c.slot_tick[2] > c.slot_tick[1]
    assert c.step([4, 5, 3], False, large=True, entries={4: 3, 5: 3, 3: 1}).admitted == []  # no free slot
