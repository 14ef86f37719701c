"""Issue 26: --policy auto replays the trace through each native policy with the plan's slots."""

from __future__ import annotations

import numpy as np

from _geometry import MiB, make_geometry
from spark_cli.core import plan_file, planner
from spark_cli.core.simulator import DEFAULT_POLICY, ONLINE_POLICIES
from spark_cli.core.trace import RoutingTrace

E, K = 32, 2


def _geo():
    return make_geometry(n_layer=2, n_expert=E, k=K, dense=())


def _budget(g, slots: int) -> int:
    return planner.fixed_bytes(g, 4096) + 2 * (slots + 1) * 10 * MiB


def _trace(g, rows) -> RoutingTrace:
    ids = np.full((len(rows), g.n_layer, K), -1, dtype=np.int16)
    for t, r in enumerate(rows):
        ids[t, :] = r
    return RoutingTrace(ids, np.ones(len(rows)), np.arange(len(rows)), E, g.fingerprint)


def _recency_rows(rng, n: int) -> list:
    """A working set of 6 experts that moves to 6 new ones every 30 steps: recency pays."""
    rows = []
    for t in range(n):
        base = (t // 30) * 6 % (E - 6)
        rows.append(base + rng.choice(6, K, replace=False))
    return rows


def _frequency_rows(rng, n: int) -> list:
    """A stable hot set of 8 experts under a stream of one-off cold ones: frequency pays."""
    rows = []
    for t in range(n):
        hot = rng.choice(8, 1, p=np.array([8, 7, 6, 5, 4, 3, 2, 1]) / 36)[0]
        cold = 8 + rng.integers(0, E - 8)
        rows.append(np.array([hot, cold]))
    return rows


def _auto(rows, seed_slots: int = 6):
    g = _geo()
    tr = _trace(g, rows)
    req = planner.PlanRequest(_budget(g, seed_slots), 4096, trace=tr, policy=planner.AUTO_POLICY)
    return planner.plan_for(g, req).plan, g, tr


def test_auto_picks_lru_on_a_recency_trace() -> None:
    plan, g, tr = _auto(_recency_rows(np.random.default_rng(1), 600))
    assert set(plan.policy_replay) == set(ONLINE_POLICIES)
    assert plan.policy == "lru" == max(plan.policy_replay, key=plan.policy_replay.get)
    assert plan.policy_replay["lru"] > plan.policy_replay["tinylfu"]
    # the figures are the replay of this plan's slots with each policy
    again = planner.replayed_miss(plan, tr)
    assert abs((1 - again) - plan.policy_replay["lru"]) < 1e-12 and plan.predicted_miss == again


def test_auto_picks_tinylfu_on_a_frequency_trace() -> None:
    plan, _, _ = _auto(_frequency_rows(np.random.default_rng(2), 600))
    assert plan.policy == "tinylfu"
    assert plan.policy_replay["tinylfu"] > plan.policy_replay["lru"]


def test_auto_without_a_trace_is_the_default_and_says_so() -> None:
    from spark_cli.commands.plan import policy_line

    g = _geo()
    plan = planner.plan_for(g, planner.PlanRequest(_budget(g, 6), 4096, policy=planner.AUTO_POLICY)).plan
    assert plan.policy == DEFAULT_POLICY and plan.policy_replay is None
    assert "no decode steps to replay" in policy_line(plan) and DEFAULT_POLICY in policy_line(plan)


def test_auto_choice_and_figures_survive_the_plan_file(tmp_path) -> None:
    plan, _, _ = _auto(_recency_rows(np.random.default_rng(3), 300))
    plan_file.save(plan, tmp_path / "p.json")
    back = plan_file.load(tmp_path / "p.json")
    assert back.policy == plan.policy and back.policy_replay == plan.policy_replay
