"""The offline policy replay in scripts/experiments/simulate_adaptive.py: a cycle advances by
what its acceptance table says, costs come from the cost model, and tables survive a round
trip."""

import numpy as np

from dflash2_mlx import adaptive
from scripts.experiments import simulate_adaptive as sim

# 10 ms a plain step, 15 ms a drafting cycle of any size; no context slope.
COSTS = adaptive.CostModel({1: (0.010, 0.0), 2: (0.012, 0.0), 4: (0.012, 0.0)},
                           {2: (0.003, 0.0), 4: (0.003, 0.0)})


def table(accepted_at_every_position: int, length: int = 40, largest: int = 4):
    return {b: np.full(length, min(accepted_at_every_position, b - 1)) for b in range(2, largest + 1)}


def test_replay_advances_by_the_table_and_prices_each_cycle():
    start = 10
    n, seconds, used = sim.replay(adaptive.Fixed(1), table(3), start, start + 60, 17, COSTS, 0.0)
    assert (n, used) == (17, {1: 16}) and np.isclose(seconds, 16 * 0.010)
    # Block 4 with every draft accepted: 4 tokens a cycle after the prefill's one.
    n, seconds, used = sim.replay(adaptive.Fixed(4), table(3), start, start + 60, 17, COSTS, 0.001)
    assert (n, used) == (17, {4: 4}) and np.isclose(seconds, 4 * 0.016)
    # Nothing accepted: one token a cycle, so drafting loses to plain steps.
    n, seconds, used = sim.replay(adaptive.Fixed(4), table(0), start, start + 60, 9, COSTS, 0.0)
    assert (n, used) == (9, {4: 8}) and seconds > 8 * 0.010


def test_replay_steps_plainly_past_the_last_full_block():
    n, _, used = sim.replay(adaptive.Fixed(4), table(3, length=2), 0, 100, 13, COSTS, 0.0)
    assert n == 13 and used == {4: 1, 1: 8}  # the first cycle lands at 4, past the table


def test_adaptive_drafts_where_the_table_pays_and_steps_plainly_where_it_does_not():
    good = sim.run("", lambda h: adaptive.Adaptive(COSTS, 4, adaptive.Acceptance.empty(3)),
                   [(table(3), 0, 100)], 33, COSTS, 0.0, True)
    bad = sim.run("", lambda h: adaptive.Adaptive(COSTS, 4, adaptive.Acceptance.empty(3)),
                  [(table(0), 0, 100)], 33, COSTS, 0.0, True)
    assert good[2].get(1, 0) == 0 and good[1] > 2 / 0.010  # more than twice plain speed
    assert bad[2][1] > 20  # mostly plain steps after the first few failed drafts


def test_tables_round_trip(tmp_path):
    tables = [(table(2, 7), 3, 12), (table(1, 5), 4, 11)]
    sim.save_tables(tmp_path / "t.npz", tables)
    back = sim.load_tables(tmp_path / "t.npz")
    assert [(s, n) for _, s, n in back] == [(3, 12), (4, 11)]
    for (a, _, _), (b, _, _) in zip(tables, back):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_shadow_probes_are_priced_and_bring_drafting_back():
    # Drafts fail for the first 30 positions, then every one is accepted.
    late = {b: np.concatenate([np.zeros(30), np.full(90, b - 1)]) for b in range(2, 5)}
    make = lambda budget: lambda h: adaptive.Adaptive(COSTS, 4, adaptive.Acceptance.empty(3),
                                                      shadow_budget=budget)
    with_shadows = sim.run("", make(adaptive.SHADOW_BUDGET), [(late, 0, 120)], 100, COSTS, 0.0, False)
    without = sim.run("", make(0), [(late, 0, 120)], 100, COSTS, 0.0, False)
    assert with_shadows[2][1] < without[2][1] and with_shadows[1] > without[1]
    # A drafter never right: the shadows cost about their budget's share of the plain steps.
    never = table(0, length=200)
    n, s_shadow, used = sim.replay(make(adaptive.SHADOW_BUDGET)(None), never, 0, 200, 150, COSTS, 0.0)
    _, s_none, used_none = sim.replay(make(0)(None), never, 0, 200, 150, COSTS, 0.0)
    assert used.keys() == used_none.keys() and used[1] > 100
    assert 1.0 < s_shadow / s_none <= 1 + 1.2 * adaptive.SHADOW_BUDGET
